/* Causal attention of a prompt chunk over its whole context (prefill and each later chunk of a
 * chunked prefill), flash-attention style, for bf16 inputs; the torch reference is
 * attention.attention_with_lse_reference (through native.prefill_attention's test).
 *
 * Why not vLLM's CPU kernel, which the exact attention called before: without AMX tiles it
 * converts its bf16 inputs to fp32 and multiplies with fp32 FMAs, half the rate of the
 * AVX512-BF16 dot product, which here does both products: S = Q K^T and O += P V, with P
 * rounded to bf16 as FlashAttention rounds it to 16 bits, fp32 sums and softmax.
 *
 * A work item is one KV head and a block of TOKENS query tokens: its rows are the tokens x the
 * group's query heads (each key block read once for all of them). The heads go one at a time:
 * the head's K and V are packed into the dot product's pair layouts (bf16_tiles.h; O(s d),
 * against the O(s q d) of the products), then its items run. Query token t sits at position
 * s_len - q_len + t and sees the keys up to it.
 *
 * Without AVX512-BF16 (AVX2 CPUs) the same items run in fp32 on 8-lane FMAs, as vLLM's kernel
 * multiplies there: 1.4-2.1x its speed, mostly by keeping each tile's keys or values in L1
 * (benchmarks/RESULTS.md, "Prefill attention on AVX2"). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"

#define TOKENS 16   /* query tokens per work item */
#define MAX_GROUP 16
#define NONE (-1e30f)

/* 1 where this build has the kernel (AVX512-BF16 or AVX2); native.supports_prefill_attention
 * asks. */
int prefill_attention_built(void) {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* o[r][x0, x0 + 16 nv) += p[r] . v over the block's KEYS keys, rows r0..r0+3; nv constant where
 * inlined. p: bf16 rows of KEYS; vp: the block's packed V (bf16_tiles.h's pack_values). */
static inline __attribute__((always_inline)) void pv_tile(const uint16_t *p, const uint32_t *vp,
                                                          float *o, int d, int x0, const int nv) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_loadu_ps(o + r * d + x0 + 16 * v);
    for (int pair = 0; pair < KEYS / 2; pair++) {
        __m512bh b[4];
        for (int v = 0; v < nv; v++)
            b[v] = (__m512bh)_mm512_loadu_si512(vp + ((x0 / 16 + v) * (KEYS / 2) + pair) * 16);
        for (int r = 0; r < 4; r++) {
            const __m512bh a =
                (__m512bh)_mm512_set1_epi32(((const int32_t *)(p + r * KEYS))[pair]);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(o + r * d + x0 + 16 * v, acc[r][v]);
}

static void pv_rows(const uint16_t *p, const uint32_t *vp, float *o, int d) {
    int x0 = 0;
    for (; x0 + 64 <= d; x0 += 64) pv_tile(p, vp, o, d, x0, 4);
    switch ((d - x0) / 16) {
    case 3: pv_tile(p, vp, o, d, x0, 3); break;
    case 2: pv_tile(p, vp, o, d, x0, 2); break;
    case 1: pv_tile(p, vp, o, d, x0, 1); break;
    }
}

/* The block's softmax step of one row: its scores sr (KEYS, the first `limit` visible) in
 * log2 units (times c), the row's max *m and sum *l updated, its weights as bf16 into pr, and
 * its output row o rescaled. */
static inline void softmax_row(const float *sr, int limit, float c, float *m, float *l,
                               uint16_t *pr, float *o, int d) {
    __m512 x[KEYS / 16];
    __mmask16 valid[KEYS / 16];
    __m512 top = _mm512_set1_ps(NONE);
    for (int v = 0; v < KEYS / 16; v++) {
        const int left = limit - 16 * v;
        valid[v] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        x[v] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * v), _mm512_set1_ps(c));
        top = _mm512_mask_max_ps(top, valid[v], top, x[v]);
    }
    const float block_max = _mm512_reduce_max_ps(top);
    const float new_max = block_max > *m ? block_max : *m;
    const float rescale = exp2f(*m - new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < KEYS / 16; v++) {
        const __m512 w = _mm512_maskz_mov_ps(
            valid[v], exp2_ps(_mm512_sub_ps(x[v], _mm512_set1_ps(new_max))));
        sum = _mm512_add_ps(sum, w);
        _mm256_storeu_si256((__m256i *)(pr + 16 * v), (__m256i)_mm512_cvtneps_pbh(w));
    }
    *l = *l * rescale + _mm512_reduce_add_ps(sum);
    *m = new_max;
    if (rescale != 1.f)
        for (int x0 = 0; x0 < d; x0 += 16)
            _mm512_storeu_ps(o + x0, _mm512_mul_ps(_mm512_loadu_ps(o + x0),
                                                   _mm512_set1_ps(rescale)));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Without AVX512-BF16 (AVX2 CPUs): the same work items in fp32 on bf16_tiles.h's fp32 tiles,
 * P kept fp32. A PV tile is PV_ROWS rows x 32 channels: 12 accumulators of AVX2's 16
 * registers. */
#define PV_ROWS 3

/* o[r][0, 8 nv) += p[r] . v over the block's KEYS keys, rows 0..PV_ROWS-1, for a slice of
 * pack_values_f32 (vp, 8 nv channels); nv constant where inlined */
static inline __attribute__((always_inline)) void pv_tile_f32(const float *p, const float *vp,
                                                              float *o, int d, const int nv) {
    __m256 acc[PV_ROWS][4];
    for (int r = 0; r < PV_ROWS; r++)
        for (int u = 0; u < nv; u++) acc[r][u] = _mm256_loadu_ps(o + r * d + 8 * u);
    for (int j = 0; j < KEYS; j++) {
        __m256 a[PV_ROWS];
        for (int r = 0; r < PV_ROWS; r++) a[r] = _mm256_broadcast_ss(p + r * KEYS + j);
        for (int u = 0; u < nv; u++) {
            const __m256 b = _mm256_loadu_ps(vp + j * 8 * nv + 8 * u);
            for (int r = 0; r < PV_ROWS; r++) acc[r][u] = _mm256_fmadd_ps(a[r], b, acc[r][u]);
        }
    }
    for (int r = 0; r < PV_ROWS; r++)
        for (int u = 0; u < nv; u++) _mm256_storeu_ps(o + r * d + 8 * u, acc[r][u]);
}

/* o[r] += p[r] . v for rows 0..rows-1 (a multiple of PV_ROWS); slices outer: a slice of the
 * block's values (16 KiB) stays in L1 while every row passes */
static void pv_block_f32(const float *p, const float *vp, float *o, int d, int rows) {
    for (int x0 = 0; x0 < d; x0 += 32) {
        const float *slice = vp + (int64_t)KEYS * x0;
        for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
            if (d - x0 >= 32)
                pv_tile_f32(p + r0 * KEYS, slice, o + (int64_t)r0 * d + x0, d, 4);
            else
                pv_tile_f32(p + r0 * KEYS, slice, o + (int64_t)r0 * d + x0, d, 2);
        }
    }
}

static inline float max8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float sum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* softmax_row above on 8 lanes, the weights kept fp32 */
static inline void softmax_row_f32(const float *sr, int limit, float c, float *m, float *l,
                                   float *pr, float *o, int d) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 x[KEYS / 8], valid[KEYS / 8];
    __m256 top = _mm256_set1_ps(NONE);
    for (int u = 0; u < KEYS / 8; u++) {
        valid[u] = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(limit - 8 * u), lane));
        x[u] = _mm256_mul_ps(_mm256_loadu_ps(sr + 8 * u), _mm256_set1_ps(c));
        top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(NONE), x[u], valid[u]));
    }
    const float block_max = max8(top);
    const float new_max = block_max > *m ? block_max : *m;
    const float rescale = exp2f(*m - new_max);
    __m256 sum = _mm256_setzero_ps();
    for (int u = 0; u < KEYS / 8; u++) {
        const __m256 w = _mm256_and_ps(
            valid[u], exp2_ps8(_mm256_sub_ps(x[u], _mm256_set1_ps(new_max))));
        sum = _mm256_add_ps(sum, w);
        _mm256_storeu_ps(pr + 8 * u, w);
    }
    *l = *l * rescale + sum8(sum);
    *m = new_max;
    if (rescale != 1.f)
        for (int x0 = 0; x0 < d; x0 += 8)
            _mm256_storeu_ps(o + x0, _mm256_mul_ps(_mm256_loadu_ps(o + x0),
                                                   _mm256_set1_ps(rescale)));
}

/* prefill_attention's loop with the tiles above (arguments as there) */
static int prefill_attention_f32(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                                 int64_t k_stride, const uint16_t *v, int64_t v_stride,
                                 int q_len, int s_len, int h_q, int h_kv, int d, float scale,
                                 uint16_t *out, float *lse) {
    const int g = h_q / h_kv;
    const int s_pad = (s_len + KEYS - 1) / KEYS * KEYS, key_blocks = s_pad / KEYS;
    float *kp = malloc(sizeof(float) * s_pad * d), *vp = malloc(sizeof(float) * s_pad * d);
    if (!kp || !vp) return free(kp), free(vp), 2;
    const int rows = TOKENS * g, rows_pad = (rows + S_ROWS - 1) / S_ROWS * S_ROWS;
    const int token_blocks = (q_len + TOKENS - 1) / TOKENS, offset = s_len - q_len;
    const float c = scale * 1.44269504f;
    int status = 0;
#pragma omp parallel reduction(| : status) if ((int64_t)h_kv * token_blocks > 1)
    {
        float *qb = aligned_alloc(64, sizeof(float) * rows_pad * d),
              *pb = aligned_alloc(64, sizeof(float) * rows_pad * KEYS),
              *sb = aligned_alloc(64, sizeof(float) * rows_pad * KEYS),
              *ob = aligned_alloc(64, sizeof(float) * rows_pad * d),
              *m = malloc(sizeof(float) * rows_pad), *l = malloc(sizeof(float) * rows_pad);
        status = !(qb && pb && sb && ob && m && l);
        for (int h = 0; h < h_kv; h++) {
#pragma omp for schedule(static)
            for (int kb = 0; kb < key_blocks; kb++) {
                pack_keys_f32(k + (int64_t)h * d, k_stride, s_len, d, kb * KEYS,
                              kp + (int64_t)kb * KEYS * d);
                pack_values_f32(v + (int64_t)h * d, v_stride, s_len, d, kb * KEYS,
                                vp + (int64_t)kb * KEYS * d);
            }
#pragma omp for schedule(dynamic)
            for (int item = 0; item < token_blocks; item++) {
                if (status) continue;
                const int t0 = (token_blocks - 1 - item) * TOKENS;
                const int tokens = q_len - t0 < TOKENS ? q_len - t0 : TOKENS, valid = tokens * g;
                for (int r = 0; r < rows_pad; r++) {
                    if (r < valid)
                        to_f32(q + (int64_t)(t0 + r / g) * q_stride + (int64_t)(h * g + r % g) * d,
                               BF16, d, qb + (int64_t)r * d);
                    else
                        memset(qb + (int64_t)r * d, 0, sizeof(float) * d);
                    m[r] = NONE, l[r] = 0.f;
                }
                memset(ob, 0, sizeof(float) * rows_pad * d);
                const int last = offset + t0 + tokens - 1;
                const int rows_tiles = (valid + S_ROWS - 1) / S_ROWS * S_ROWS;
                for (int kb = 0; kb * KEYS <= last; kb++) {
                    const int key0 = kb * KEYS;
                    const float *kh = kp + (int64_t)key0 * d;
                    /* keys outer: a tile's 16 keys (8 KiB at d = 128) stay in L1 */
                    for (int kt = 0; kt < KEYS / 16 && key0 + kt * 16 <= last; kt++)
                        for (int r0 = 0; r0 < rows_tiles; r0 += S_ROWS)
                            s_tile_f32(qb + (int64_t)r0 * d, d, kh + (int64_t)kt * 16 * d,
                                       sb + r0 * KEYS + kt * 16, KEYS);
                    for (int r = 0; r < rows_tiles; r++) {
                        const int limit = offset + t0 + r / g + 1 - key0;
                        if (r >= valid || limit <= 0) {
                            memset(pb + r * KEYS, 0, sizeof(float) * KEYS);
                            continue;
                        }
                        softmax_row_f32(sb + r * KEYS, limit < KEYS ? limit : KEYS, c, m + r,
                                        l + r, pb + r * KEYS, ob + (int64_t)r * d, d);
                    }
                    pv_block_f32(pb, vp + (int64_t)key0 * d, ob, d, rows_tiles);
                }
                for (int r = 0; r < valid; r++) {
                    const int t = t0 + r / g, head = h * g + r % g;
                    const float inv = 1.f / l[r];
                    float *o = ob + (int64_t)r * d;
                    for (int x = 0; x < d; x++) o[x] *= inv;
                    from_f32(o, d, BF16, out + ((int64_t)t * h_q + head) * d);
                    lse[(int64_t)head * q_len + t] = (m[r] + log2f(l[r])) * 0.69314718f;
                }
            }
        }
        free(qb), free(pb), free(sb), free(ob), free(m), free(l);
    }
    free(kp), free(vp);
    return status ? 2 : 0;
}
#endif

/* q: [q_len, h_q, d] (token stride q_stride, heads d apart); k, v: [s_len, h_kv, d] (token
 * strides k_stride, v_stride, heads d apart); all bf16, s_len >= q_len. out: [q_len, h_q, d]
 * bf16 contiguous; lse: fp32 [h_q, q_len] (natural log). Returns 0; 1 where this build lacks
 * the kernel, d is not a multiple of 16 up to MAX_HEAD_DIM or the group is over MAX_GROUP; 2 if a
 * scratch allocation failed. */
int prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                      const uint16_t *v, int64_t v_stride, int q_len, int s_len, int h_q,
                      int h_kv, int d, float scale, uint16_t *out, float *lse) {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
    if (d % 16 || d > MAX_HEAD_DIM || h_q % h_kv || h_q / h_kv > MAX_GROUP || s_len < q_len)
        return 1;
#endif
#if defined(__AVX512BF16__)
    const int g = h_q / h_kv;
    const int s_pad = (s_len + KEYS - 1) / KEYS * KEYS, key_blocks = s_pad / KEYS;
    const int64_t head_words = (int64_t)s_pad * d / 2; /* a head's packed K (or V), in pairs */
    /* one KV head's at a time: the threads share it in the last-level cache (16 MiB at 32K,
     * all heads' would be 128), and below glibc's mmap threshold a call reuses the last one's
     * pages instead of faulting in fresh ones */
    uint32_t *kp = malloc(sizeof(uint32_t) * head_words),
             *vp = malloc(sizeof(uint32_t) * head_words);
    if (!kp || !vp) return free(kp), free(vp), 2;
    const int rows = TOKENS * g, rows_pad = (rows + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
    const int token_blocks = (q_len + TOKENS - 1) / TOKENS, offset = s_len - q_len;
    const float c = scale * 1.44269504f; /* scores in log2 units: exp2 of their differences */
    int status = 0;
#pragma omp parallel reduction(| : status) if ((int64_t)h_kv * token_blocks > 1)
    {
        uint16_t *qb = aligned_alloc(64, sizeof(uint16_t) * rows_pad * d),
                 *pb = aligned_alloc(64, sizeof(uint16_t) * rows_pad * KEYS);
        float *sb = aligned_alloc(64, sizeof(float) * rows_pad * KEYS),
              *ob = aligned_alloc(64, sizeof(float) * rows_pad * d),
              *m = malloc(sizeof(float) * rows_pad), *l = malloc(sizeof(float) * rows_pad);
        status = !(qb && pb && sb && ob && m && l);
        for (int h = 0; h < h_kv; h++) {
#pragma omp for schedule(static)
            for (int kb = 0; kb < key_blocks; kb++) {
                pack_keys(k + (int64_t)h * d, k_stride, s_len, d, kb * KEYS,
                          kp + (int64_t)kb * KEYS * d / 2);
                pack_values(v + (int64_t)h * d, v_stride, s_len, d, kb * KEYS,
                            vp + (int64_t)kb * KEYS * d / 2);
            }
            /* the last token blocks (the most keys) first */
#pragma omp for schedule(dynamic)
            for (int item = 0; item < token_blocks; item++) {
                if (status) continue;
                const int t0 = (token_blocks - 1 - item) * TOKENS;
                const int tokens = q_len - t0 < TOKENS ? q_len - t0 : TOKENS, valid = tokens * g;
                /* row r: token t0 + r / g, query head h g + r % g */
                for (int r = 0; r < valid; r++)
                    memcpy(qb + (int64_t)r * d,
                           q + (int64_t)(t0 + r / g) * q_stride + (int64_t)(h * g + r % g) * d,
                           sizeof(uint16_t) * d);
                for (int r = valid; r < rows_pad; r++) memset(qb + (int64_t)r * d, 0, 2 * d);
                for (int r = 0; r < rows_pad; r++) m[r] = NONE, l[r] = 0.f;
                memset(ob, 0, sizeof(float) * rows_pad * d);
                const int last = offset + t0 + tokens - 1; /* the last key any row sees */
                const int rows_tiles = (valid + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
                for (int kb = 0; kb * KEYS <= last; kb++) {
                    const int key0 = kb * KEYS;
                    const uint32_t *kh = kp + (int64_t)key0 * d / 2;
                    for (int r0 = 0; r0 < rows_tiles; r0 += ROW_TILE)
                        for (int kg = 0; kg < KEYS / 16 && key0 + kg * 16 <= last; kg += 2)
                            s_tile(qb + (int64_t)r0 * d, d, kh + (int64_t)kg * 16 * d / 2,
                                   sb + r0 * KEYS + kg * 16, KEYS);
                    for (int r = 0; r < rows_tiles; r++) {
                        int limit = offset + t0 + r / g + 1 - key0; /* keys of the block it sees */
                        if (r >= valid || limit <= 0) {
                            memset(pb + r * KEYS, 0, sizeof(uint16_t) * KEYS);
                            continue;
                        }
                        softmax_row(sb + r * KEYS, limit < KEYS ? limit : KEYS, c, m + r, l + r,
                                    pb + r * KEYS, ob + (int64_t)r * d, d);
                    }
                    const uint32_t *vh = vp + (int64_t)key0 * d / 2;
                    for (int r0 = 0; r0 < rows_tiles; r0 += 4)
                        pv_rows(pb + r0 * KEYS, vh, ob + (int64_t)r0 * d, d);
                }
                for (int r = 0; r < valid; r++) {
                    const int t = t0 + r / g, head = h * g + r % g;
                    const float inv = 1.f / l[r];
                    float *o = ob + (int64_t)r * d;
                    for (int x = 0; x < d; x++) o[x] *= inv;
                    from_f32(o, d, BF16, out + ((int64_t)t * h_q + head) * d);
                    lse[(int64_t)head * q_len + t] = (m[r] + log2f(l[r])) * 0.69314718f;
                }
            }
        }
        free(qb), free(pb), free(sb), free(ob), free(m), free(l);
    }
    free(kp), free(vp);
    return status ? 2 : 0;
#elif defined(__AVX2__) && defined(__FMA__)
    return prefill_attention_f32(q, q_stride, k, k_stride, v, v_stride, q_len, s_len, h_q, h_kv,
                                 d, scale, out, lse);
#else
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)q_len,
        (void)s_len, (void)h_q, (void)h_kv, (void)d, (void)scale, (void)out, (void)lse;
    return 1;
#endif
}
