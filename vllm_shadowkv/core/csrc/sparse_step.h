/* The kernels that sparse_step.c composes into one call (each also called alone from native.py);
 * included where they are defined, so that a changed signature fails to compile. */
#pragma once
#include <stdint.h>

int landmark_scores(const void *q, int q_dtype, const void *landmarks, int dtype,
                    int64_t row_stride, int64_t head_stride, const int64_t *lm_rows,
                    const int32_t *lm_start, const int32_t *lm_count, int batch, int s_q,
                    int h_q, int h_kv, int d, int max_count, float scale, float *out,
                    int64_t ld);
int select_slots(const float *scores, int max_count, const int32_t *landmark_chunks,
                 const int32_t *lm_start, const int32_t *lm_count, const int32_t *slot_count,
                 int batch, int h_kv, int k, int32_t *slot_chunks, int32_t *miss_slots,
                 int32_t *miss_count);
int64_t list_misses(const int32_t *slot_chunks, const int32_t *miss_slots,
                    const int32_t *miss_count, int batch, int h_kv, int k, int64_t *heads,
                    int64_t *chunks, int64_t *filled, int64_t *per_request);
void rebuild_keys(const void *a, int a_dtype, int64_t a_row_stride, const int64_t *a_rows,
                  const int32_t *a_positions, const int32_t *a_start, const void *b,
                  int b_dtype, int rank, const int32_t *slot_chunks, const int32_t *miss_slots,
                  const int32_t *miss_count, int batch, int h_kv, int k, int c,
                  const void *cos_sin, int cos_sin_dtype, int rotary_dim, int neox, void *out,
                  int out_dtype, int64_t out_row_stride, const int64_t *slot_index, int d);
int64_t gather_store_rows(void *dst, int dst_dtype, int64_t dst_stride, int64_t dst_len,
                          const int64_t *dst_rows, int split, const void *pool, int src_dtype,
                          const int64_t *page_offsets, const int64_t *first_page,
                          const int64_t *num_heads, const int64_t *num_rows,
                          const int64_t *counts, int n_keys, int64_t page_rows,
                          int64_t row_numel, const int64_t *heads, const int64_t *chunks,
                          int64_t n);
int decode_attention(const void *q, int q_dtype, const void *rows, int dtype, int64_t row_stride,
                     const int64_t *k_rows, const int64_t *v_rows, int batch, int s_q, int h_q,
                     int h_kv, int d, int width, int exact_width, const int64_t *exact_len,
                     const int32_t *slot_chunks, int k, int chunk, const int64_t *gen_before,
                     float scale, void *out, int out_dtype, float *lse);
