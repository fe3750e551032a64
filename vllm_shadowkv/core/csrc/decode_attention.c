/* The sparse decode step's exact attention, over K/V rows read in place through their row ids
 * (native.py; the torch reference is attention.decode_attention).
 *
 * For request b and KV head h the attended keys are, in order: the exact region (E rows, the
 * first exact_len[b] valid), the slots (k chunks of c rows, a chunk valid when its slot holds
 * one) and the generated tokens (the step's own last: query token t sees the first
 * gen_before[b] + t + 1). The group's query heads and the step's tokens are the query rows of
 * their KV head, so each key row is read once for all of them. Online softmax over blocks of
 * rows with fp32 sums: no gather of the rows, no mask, no score matrix, and invisible rows are
 * never read. bf16 keys and queries multiply as they are (AVX512-BF16 dot products, as the
 * landmark scores); other dtypes, or AVX2 CPUs, convert to fp32 (on AVX2 the keys in registers),
 * and the values always are. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu.h"
#include "sparse_step.h"

#define BLOCK 16 /* rows per online-softmax update */
/* A finite "no score": -ffast-math assumes no infinities, so none are compared; exp of it
 * minus any real score is 0. */
#define NONE (-1e30f)

struct layout {
    int exact_width, slot_width, chunk;
    int64_t exact_len, gen_before;
    const int32_t *slot_chunks;  /* the head's k slots */
};

/* The first query token that sees row w (s_q or more: none). */
static inline int64_t first_token(const struct layout *l, int w) {
    if (w < l->exact_width) return w < l->exact_len ? 0 : INT32_MAX;
    w -= l->exact_width;
    if (w < l->slot_width) return l->slot_chunks[w / l->chunk] >= 0 ? 0 : INT32_MAX;
    w -= l->slot_width;  /* generated token w: seen by the tokens t with w <= gen_before + t */
    return w > l->gen_before ? w - l->gen_before : 0;
}

/* q: [B, s_q, h_q, d] contiguous. rows: the pages as rows of row_stride elements (unit stride
 * over d). k_rows, v_rows: int64 [B, h_kv, width]. exact_len, gen_before: int64 [B];
 * slot_chunks: int32 [B, h_kv, k]. out: [B, s_q, h_q, d] of out_dtype; lse: fp32 [B, s_q, h_q].
 * Returns 0; 1 if d or h_q * s_q is over its maximum or a scratch allocation failed. */
int decode_attention(const void *q, int q_dtype, const void *rows, int dtype, int64_t row_stride,
                     const int64_t *k_rows, const int64_t *v_rows, int batch, int s_q, int h_q,
                     int h_kv, int d, int width, int exact_width, const int64_t *exact_len,
                     const int32_t *slot_chunks, int k, int chunk, const int64_t *gen_before,
                     float scale, void *out, int out_dtype, float *lse) {
    const int g = h_q / h_kv, nq = s_q * g;
    if (d > MAX_HEAD_DIM || nq > MAX_QUERY_ROWS) return 1;
    const int64_t row_bytes = row_stride * (int64_t)element_size(dtype);
    const size_t q_bytes = element_size(q_dtype), o_bytes = element_size(out_dtype);
    int dots16 = 0, dots8 = 0;  /* dots16: bf16 rows and queries, AVX512-BF16 dot products */
#if defined(__AVX512BF16__)
    dots16 = dtype == BF16 && q_dtype == BF16;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    dots8 = !dots16 && dots8_fit(dtype, d);  /* else fp32 queries and rows in registers */
#endif
    int status = 0;
#pragma omp parallel reduction(| : status) if (batch * h_kv > 1)
    {
        float *qf = malloc(sizeof(float) * nq * d), *acc = malloc(sizeof(float) * nq * d),
              *kvf = malloc(sizeof(float) * BLOCK * d), *p = malloc(sizeof(float) * nq * BLOCK),
              *m = malloc(sizeof(float) * nq), *l_sum = malloc(sizeof(float) * nq);
        status = !(qf && acc && kvf && p && m && l_sum);
        /* (request, KV head) pairs across the threads: each writes only its own rows */
#pragma omp for schedule(dynamic)
        for (int64_t bh = 0; bh < (int64_t)batch * h_kv; bh++) {
            if (status) continue;
            const int b = (int)(bh / h_kv), h = (int)(bh % h_kv);
            const struct layout l = {exact_width, k * chunk, chunk, exact_len[b], gen_before[b],
                                     slot_chunks + bh * k};
            const int64_t *kr = k_rows + bh * width, *vr = v_rows + bh * width;
            /* query row t * g + j: token t, group member j (query head h * g + j) */
            const void *queries[MAX_QUERY_ROWS];
            for (int t = 0; t < s_q; t++)
                for (int j = 0; j < g; j++) {
                    const int64_t at = ((int64_t)b * s_q + t) * h_q + h * g + j;
                    queries[t * g + j] = (const char *)q + at * d * q_bytes;
                    if (!dots16) to_f32(queries[t * g + j], q_dtype, d, qf + (t * g + j) * d);
                }
            for (int r = 0; r < nq; r++) m[r] = NONE, l_sum[r] = 0.f;
            for (int64_t x = 0; x < (int64_t)nq * d; x++) acc[x] = 0.f;
            int w = 0;
            while (w < width) {
                int64_t key_ids[BLOCK], value_ids[BLOCK], firsts[BLOCK];
                int64_t seen_from = s_q;  /* the first token seeing any row of the block */
                int n = 0;
                for (; w < width && n < BLOCK; w++) {
                    const int64_t first = first_token(&l, w);
                    if (first >= s_q) continue;
                    key_ids[n] = kr[w], value_ids[n] = vr[w], firsts[n++] = first;
                    seen_from = first < seen_from ? first : seen_from;
                }
                if (n == 0) break;
                for (int i = 0; i < n; i++)  /* the block's values arrive while keys are used */
                    for (int64_t line = 0; line < d * (int64_t)element_size(dtype); line += 64)
                        __builtin_prefetch((const char *)rows + value_ids[i] * row_bytes + line);
                if (dots16) {
#if defined(__AVX512BF16__)
                    const struct rows block = {rows, key_ids, row_bytes, 0, n, 1, d, n};
                    bf16_dots(&block, queries, nq, p, 0, n);
#endif
                } else if (dots8) {
#if defined(__AVX2__) && defined(__FMA__)
                    const struct rows block = {rows, key_ids, row_bytes, 0, n, 1, d, n};
                    f32_dots8(&block, dtype, qf, nq, p, 0, n);
#endif
                } else {
                    for (int i = 0; i < n; i++)
                        to_f32((const char *)rows + key_ids[i] * row_bytes, dtype, d,
                               kvf + i * d);
                    for (int r = 0; r < nq; r++)
                        for (int i = 0; i < n; i++) {
                            float dot = 0.f;
                            for (int x = 0; x < d; x++) dot += qf[r * d + x] * kvf[i * d + x];
                            p[r * n + i] = dot;
                        }
                }
                for (int r = 0; r < nq; r++) {
                    const int t = r / g;
                    float *pr = p + r * n, top = NONE;
                    if (t < seen_from) {  /* no row of the block for this token */
                        for (int i = 0; i < n; i++) pr[i] = 0.f;
                        continue;
                    }
                    for (int i = 0; i < n; i++) {
                        pr[i] = t >= firsts[i] ? pr[i] * scale : NONE;
                        top = pr[i] > top ? pr[i] : top;
                    }
                    softmax_update(pr, n, top, m + r, l_sum + r, acc + r * d, d);
                }
                for (int i = 0; i < n; i++)
                    to_f32((const char *)rows + value_ids[i] * row_bytes, dtype, d, kvf + i * d);
                add_values(acc, p, kvf, n, nq, d);
            }
            for (int r = 0; r < nq; r++) {
                const int64_t at = ((int64_t)b * s_q + r / g) * h_q + h * g + r % g;
                const float inv = l_sum[r] > 0.f ? 1.f / l_sum[r] : 0.f;
                for (int x = 0; x < d; x++) acc[r * d + x] *= inv;
                from_f32(acc + r * d, d, out_dtype, (char *)out + at * d * o_bytes);
                lse[at] = l_sum[r] > 0.f ? m[r] + logf(l_sum[r]) : -INFINITY;
            }
        }
        free(qf), free(acc), free(kvf), free(p), free(m), free(l_sum);
    }
    return status;
}
