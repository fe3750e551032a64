/* ShadowKV's chunk scores for a ragged batch, one call per layer and step (native.py; the
 * torch reference is select.landmark_scores).
 *
 * For request b and KV head h, each of the step's s_q x g query rows (the group's query heads)
 * takes a softmax over the request's landmarks; the scores are those probabilities summed over
 * the query tokens and maxed over the group. Landmark rows are read in place through their row
 * ids (the engine's pages). bf16 rows and queries multiply as they are (exact products, fp32
 * sums, as the reference's fp32 matmul of bf16 values): 16 rows at one stride (a page's) by
 * AMX, the other rows by AVX512-BF16 dot products; other dtypes, or CPUs without these, are
 * converted to fp32 (on AVX2 in registers, cpu.h's f32_dots8). Built with -O3 -ffast-math: the
 * loops vectorise, the softmax's exp through glibc's libmvec. */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"
#include "sparse_step.h"


/* Rows of any dtype against fp32 query rows qf [h_kv][nq][d]. */
static void f32_dots(const struct rows *r, int dtype, const float *qf, int nq, float *logits) {
    float row[MAX_HEAD_DIM];
    for (int i = 0; i < r->n; i++)
        for (int h = 0; h < r->h_kv; h++) {
            to_f32(r->base + r->ids[i] * r->row_bytes + h * r->head_bytes, dtype, r->d, row);
            for (int t = 0; t < nq; t++) {
                const float *qt = qf + (h * nq + t) * r->d;
                float acc = 0.f;
                for (int k = 0; k < r->d; k++) acc += row[k] * qt[k];
                logits[((int64_t)h * nq + t) * r->ld + i] = acc;
            }
        }
}

#if defined(__AMX_BF16__)
/* Rows [i, i + 16), at one stride (a page's): per head, 16 rows x 32 of d times the B tile in
 * one instruction, no horizontal sums. */
static void amx_block(const struct rows *r, int64_t step_bytes, const uint16_t *tiles, int nq,
                      float *logits, int i) {
    const char *first = r->base + r->ids[i] * r->row_bytes;
    float c[16][16];
    for (int h = 0; h < r->h_kv; h++) {
        _tile_zero(0);
        for (int kb = 0; kb < r->d / 32; kb++) {
            _tile_loadd(1, first + h * r->head_bytes + kb * 64, step_bytes);
            _tile_loadd(2, tiles + ((int64_t)h * (r->d / 32) + kb) * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, c, 64);
        for (int t = 0; t < nq; t++)
            for (int j = 0; j < 16; j++) logits[((int64_t)h * nq + t) * r->ld + i + j] = c[j][t];
    }
}

/* The rows by AMX where 16 lie at one stride; returns how many rows it covered. */
static int amx_dots(const struct rows *r, const void *const *queries, int nq, float *logits) {
    uint16_t *tiles;
    if (r->d % 32 || nq > 16 || r->n < 16 || !amx_usable() ||
        !(tiles = malloc((size_t)r->h_kv * r->d * 32)))
        return 0;
    amx_configure();
    /* the head's query rows as B tiles: gathered as [d][nq] columns first */
    uint16_t *columns = calloc((size_t)r->d * 16, 2);
    for (int h = 0; h < r->h_kv; h++) {
        for (int t = 0; t < nq; t++)
            for (int k = 0; k < r->d; k++)
                columns[k * 16 + t] = ((const uint16_t *)queries[h * nq + t])[k];
        vnni_tiles(columns, 16, r->d, nq, tiles + (int64_t)h * r->d * 16);
    }
    free(columns);
    int i = 0;
    for (; i + 16 <= r->n; i += 16) {
        const int64_t step = r->ids[i + 1] - r->ids[i];
        int strided = 1;
        for (int j = 2; j < 16; j++) strided &= r->ids[i + j] == r->ids[i] + j * step;
        if (strided)
            amx_block(r, step * r->row_bytes, tiles, nq, logits, i);
        else
            bf16_dots(r, queries, nq, logits, i, i + 16);
    }
    _tile_release();
    free(tiles);
    return i;
}
#endif

static void row_dots(const struct rows *r, int dtype, const void *const *queries, int q_dtype,
                     int nq, float *logits) {
#if defined(__AVX512BF16__)
    if (dtype == BF16 && q_dtype == BF16) {
        int done = 0;
#if defined(__AMX_BF16__)
        done = amx_dots(r, queries, nq, logits);
#endif
        bf16_dots(r, queries, nq, logits, done, r->n);
        return;
    }
#endif
    float *qf = malloc(sizeof(float) * r->h_kv * nq * r->d);
    for (int t = 0; t < r->h_kv * nq; t++) to_f32(queries[t], q_dtype, r->d, qf + t * r->d);
#if defined(__AVX2__) && defined(__FMA__)
    if (dots8_fit(dtype, r->d)) {
        f32_dots8(r, dtype, qf, nq, logits, 0, r->n);
        free(qf);
        return;
    }
#endif
    f32_dots(r, dtype, qf, nq, logits);
    free(qf);
}

/* Request b's query rows: h * nq + s * g + j is token s, group member j of KV head h. */
static void request_queries(const void *q, int q_dtype, int b, int s_q, int h_q, int h_kv,
                            int d, const void **queries) {
    const int g = h_q / h_kv, nq = s_q * g;
    for (int h = 0; h < h_kv; h++)
        for (int s = 0; s < s_q; s++)
            for (int j = 0; j < g; j++)
                queries[h * nq + s * g + j] = (const char *)q +
                    (((int64_t)b * s_q + s) * h_q + h * g + j) * d * element_size(q_dtype);
}

/* KV head h's n scores from its group's logits rows (overwritten by their probabilities): each
 * member's softmax summed over the query tokens (in sum, n floats), maxed over the group. */
static void head_scores(float *logits, int64_t ld, int h, int s_q, int g, int n, float scale,
                        float *sum, float *scores) {
    const int nq = s_q * g;
    for (int i = 0; i < n; i++) scores[i] = 0.f;
    for (int j = 0; j < g; j++) {
        for (int s = 0; s < s_q; s++) {
            float *x = logits + ((int64_t)h * nq + s * g + j) * ld, top = -INFINITY;
            float total = 0.f;
            for (int i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
            for (int i = 0; i < n; i++) {
                x[i] = expf((x[i] - top) * scale);
                total += x[i];
            }
            const float inv = 1.f / total;
            for (int i = 0; i < n; i++) sum[i] = (s ? sum[i] : 0.f) + x[i] * inv;
        }
        for (int i = 0; i < n; i++) scores[i] = sum[i] > scores[i] ? sum[i] : scores[i];
    }
}

/* q: [B, s_q, h_q, d] contiguous, of q_dtype. landmarks: row i of head h at i * row_stride +
 * h * head_stride (elements; unit stride over d). lm_rows int64 [NL]; lm_start, lm_count int32
 * [B]. out: fp32 [B, h_kv, max_count], already -1. Logits scratch: h_q * s_q rows of ld >=
 * max_count fp32 (native.py pads ld off a multiple of 4 KiB: query rows that far apart would
 * share the same few L1 sets). With at least as many requests as threads, each thread takes
 * whole requests in its own scratch; with fewer, the threads share each request's rows, then its
 * KV heads. Returns 0; 1 if d or h_q * s_q is over its maximum, 2 if a scratch allocation
 * failed. */
int landmark_scores(const void *q, int q_dtype, const void *landmarks, int dtype,
                    int64_t row_stride, int64_t head_stride, const int64_t *lm_rows,
                    const int32_t *lm_start, const int32_t *lm_count, int batch, int s_q,
                    int h_q, int h_kv, int d, int max_count, float scale, float *out,
                    int64_t ld) {
    const int g = h_q / h_kv, nq = s_q * g;
    if (d > MAX_HEAD_DIM || h_q * s_q > MAX_QUERY_ROWS) return 1;
#if defined(__AMX_BF16__)
    (void)amx_usable();  /* its one-time check, before the threads ask */
#endif
    const size_t logits_bytes = sizeof(float) * (size_t)h_q * s_q * ld;
    const size_t row_bytes = row_stride * element_size(dtype),
                 head_bytes = head_stride * element_size(dtype);
    const int threads = kernel_threads();
    int failed = 0;
    if (batch >= threads) {
#pragma omp parallel reduction(| : failed) if (batch > 1)
        {
            float *logits = malloc(logits_bytes), *sum = malloc(sizeof(float) * ld);
            failed = !(logits && sum);
#pragma omp for schedule(dynamic)
            for (int b = 0; b < batch; b++) {
                const int n = lm_count[b];
                if (n == 0 || failed) continue;
                const void *queries[MAX_QUERY_ROWS];
                request_queries(q, q_dtype, b, s_q, h_q, h_kv, d, queries);
                const struct rows r = {landmarks, lm_rows + lm_start[b], row_bytes, head_bytes,
                                       n, h_kv, d, ld};
                row_dots(&r, dtype, queries, q_dtype, nq, logits);
                for (int h = 0; h < h_kv; h++)
                    head_scores(logits, ld, h, s_q, g, n, scale, sum,
                                out + ((int64_t)b * h_kv + h) * max_count);
            }
            free(logits), free(sum);
        }
        return failed ? 2 : 0;
    }
    float *logits = malloc(logits_bytes);
    if (!logits) return 2;
    for (int b = 0; b < batch && !failed; b++) {
        const int n = lm_count[b];
        if (n == 0) continue;
        const void *queries[MAX_QUERY_ROWS];
        request_queries(q, q_dtype, b, s_q, h_q, h_kv, d, queries);
        const int blocks = 16 * threads;  /* a run of whole 16-row blocks per thread */
        const int span = (n + blocks - 1) / blocks * 16;
#pragma omp parallel reduction(| : failed)
        {
            float *sum = malloc(sizeof(float) * ld);
            failed = !sum;
#pragma omp for schedule(static)
            for (int i0 = 0; i0 < n; i0 += span) {
                const int i1 = i0 + span < n ? i0 + span : n;
                const struct rows r = {landmarks, lm_rows + lm_start[b] + i0, row_bytes,
                                       head_bytes, i1 - i0, h_kv, d, ld};
                row_dots(&r, dtype, queries, q_dtype, nq, logits + i0);
            }
#pragma omp for schedule(dynamic)
            for (int h = 0; h < h_kv; h++)
                if (sum)
                    head_scores(logits, ld, h, s_q, g, n, scale, sum,
                                out + ((int64_t)b * h_kv + h) * max_count);
            free(sum);
        }
    }
    free(logits);
    return failed ? 2 : 0;
}
