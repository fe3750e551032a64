/* ShadowKV's whole CPU decode step of one layer for a ragged batch, in one call (native.py's
 * SparseStep; the composed path is decode.decode_step with the slots in place, which calls the
 * same kernels one by one): the slots' chunk ids and B read from the pages, landmark scores,
 * top-k and slots, the misses listed, their keys rebuilt and their values gathered from the
 * store into their rows of the pages, the chunk ids written back, and attention over the rows
 * in place. What a batch keeps from step to step (row ids, tables, scratch) is set once per
 * batch and layer; a step sets its queries, generated rows and outputs. One call instead of
 * about a hundred torch and ctypes calls: each costs microseconds once the model's weights have
 * swept the caches between layers. */
#include "cpu.h"
#include "sparse_step.h"

/* Mirrored field by field by native.SparseStep: pointers, int64 and double only. Offsets are
 * in elements of the pages (int32 elements for the chunk ids); rows are rows of d elements. */
struct sparse_step {
    void *pages;  /* the layer's cache */
    int64_t dtype, num_rows, batch, s_q, h_q, h_kv, d, rank, k, chunk;
    double scale, landmark_scale;
    /* the step's */
    const void *q;  /* [B, s_q, h_q, d] */
    int64_t q_dtype;
    void *out;      /* [B, s_q, h_q, d] of q_dtype */
    float *lse;     /* [B, s_q, h_q] */
    const int64_t *k_rows, *v_rows;  /* [B, h_kv, width]: exact region, slots, generated */
    int64_t width;
    const int64_t *gen_before;  /* [B] */
    /* the batch's */
    const int64_t *landmark_rows;  /* [NL] element offsets */
    const int32_t *lm_start, *lm_count, *landmark_chunks;  /* [B], [B], [NL, h_kv] */
    const int32_t *slot_count;  /* [B]: the slots each request owns of its k (padding after) */
    int64_t max_landmarks, logits_ld;
    float *scores;  /* [B, h_kv, max_landmarks] scratch */
    const int64_t *a_rows;  /* [TA] element offsets */
    const int32_t *a_positions, *a_start;
    const int64_t *b_offsets;  /* [B * h_kv * rank] element offsets of B's rows */
    void *b;                   /* [B, h_kv, rank, d] scratch */
    const void *cos_sin;
    int64_t cos_sin_dtype, rotary_dim, neox;
    const int64_t *slot_ids;  /* [B * h_kv * k] int32 element offsets of the slots' chunk ids */
    int32_t *slot_chunks, *miss_slots, *miss_count;  /* [B, h_kv, k] x2, [B, h_kv] scratch */
    const int64_t *slot_k_rows, *slot_v_rows;         /* [B, h_kv, k, c] rows */
    int64_t *heads, *chunks, *filled, *misses, *value_rows;  /* [B h k] x3, [B], [B h k c] */
    int64_t exact_width;
    const int64_t *exact_len;  /* [B] */
    /* the value store: its first extent and the batch's page tables (keys in batch order) */
    const void *pool;
    int64_t pool_dtype;
    const int64_t *page_offsets, *first_page, *num_heads, *num_rows_stored;
    int64_t page_rows, row_numel;
};

/* Returns 0; -1 if a kernel's scratch allocation failed; -2 if a value row's destination is
 * outside the pages; 1 + i if the store does not hold the i-th missed row (the pages' slots may
 * then hold rebuilt keys of chunks whose ids were not written: the caller raises). */
int64_t sparse_step(const struct sparse_step *s) {
    const int batch = (int)s->batch, h_kv = (int)s->h_kv, d = (int)s->d, k = (int)s->k,
              c = (int)s->chunk, dtype = (int)s->dtype;
    const size_t esize = element_size(dtype);
    char *pages = s->pages;
    int32_t *ids = s->pages;
    const int64_t slots = (int64_t)batch * h_kv * k;
    for (int64_t i = 0; i < slots; i++) s->slot_chunks[i] = ids[s->slot_ids[i]];
    for (int64_t i = 0; i < (int64_t)batch * h_kv * s->rank; i++)
        memcpy((char *)s->b + i * d * esize, pages + s->b_offsets[i] * esize, d * esize);
    if (landmark_scores(s->q, (int)s->q_dtype, pages, dtype, 1, d, s->landmark_rows,
                        s->lm_start, s->lm_count, batch, (int)s->s_q, (int)s->h_q, h_kv, d,
                        (int)s->max_landmarks, (float)s->landmark_scale, s->scores,
                        s->logits_ld) ||
        select_slots(s->scores, (int)s->max_landmarks, s->landmark_chunks, s->lm_start,
                     s->lm_count, s->slot_count, batch, h_kv, k, s->slot_chunks, s->miss_slots,
                     s->miss_count))
        return -1;
    const int64_t n = list_misses(s->slot_chunks, s->miss_slots, s->miss_count, batch, h_kv, k,
                                  s->heads, s->chunks, s->filled, s->misses);
    if (n) {
        rebuild_keys(pages, dtype, 1, s->a_rows, s->a_positions, s->a_start, s->b, dtype,
                     (int)s->rank, s->slot_chunks, s->miss_slots, s->miss_count, batch, h_kv, k,
                     c, s->cos_sin, (int)s->cos_sin_dtype, (int)s->rotary_dim, (int)s->neox,
                     pages, dtype, d, s->slot_k_rows, d);
        for (int64_t m = 0; m < n; m++)  /* each missed chunk's c value rows, in its slot */
            memcpy(s->value_rows + m * c, s->slot_v_rows + s->filled[m] * c,
                   sizeof(int64_t) * c);
        const int64_t bad = gather_store_rows(
            pages, dtype, d, s->num_rows, s->value_rows, c, s->pool, (int)s->pool_dtype,
            s->page_offsets, s->first_page, s->num_heads, s->num_rows_stored, s->misses, batch,
            s->page_rows, s->row_numel, s->heads, s->chunks, n);
        if (bad) return bad;
    }
    for (int64_t i = 0; i < slots; i++) ids[s->slot_ids[i]] = s->slot_chunks[i];
    if (decode_attention(s->q, (int)s->q_dtype, pages, dtype, d, s->k_rows, s->v_rows, batch,
                         (int)s->s_q, (int)s->h_q, h_kv, d, (int)s->width, (int)s->exact_width,
                         s->exact_len, s->slot_chunks, k, c, s->gen_before, (float)s->scale,
                         s->out, (int)s->q_dtype, s->lse))
        return -1;
    return 0;
}
