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

/* The dtypes (bit 1 << cpu.h's code) this build's kernel takes, 0 without one (neither
 * AVX512-BF16 nor AVX2); native.supports_prefill_attention asks. */
int prefill_attention_dtypes(void) {
#if defined(PREFILL_TILES)
    return OPERAND_DTYPES;
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

/* o[r] += p[r] . v for rows 0..rows-1 (a multiple of 4); vp: the block's pack_values */
static void block_values(const uint16_t *p, const uint32_t *vp, float *o, int d, int rows) {
    for (int r0 = 0; r0 < rows; r0 += 4) pv_rows(p + r0 * KEYS, vp, o + (int64_t)r0 * d, d);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Without AVX512-BF16 (AVX2 CPUs): a PV tile of PV_ROWS rows x 32 channels on the fp32 values,
 * 12 accumulators of AVX2's 16 registers; P is kept fp32. */
#define PV_ROWS 3

/* o[r][0, 8 nv) += p[r] . v over the block's KEYS keys, rows 0..PV_ROWS-1, for a slice of
 * pack_values_f32 (vp, 8 nv channels); nv constant where inlined */
static inline __attribute__((always_inline)) void pv_tile(const float *p, const float *vp,
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

/* block_values above, slices outer: a slice of the block's values (16 KiB) stays in L1 while
 * every row tile passes (rows a multiple of PV_ROWS) */
static void block_values(const float *p, const float *vp, float *o, int d, int rows) {
    for (int x0 = 0; x0 < d; x0 += 32) {
        const float *slice = vp + (int64_t)KEYS * x0;
        for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
            if (d - x0 >= 32)
                pv_tile(p + r0 * KEYS, slice, o + (int64_t)r0 * d + x0, d, 4);
            else
                pv_tile(p + r0 * KEYS, slice, o + (int64_t)r0 * d + x0, d, 2);
        }
    }
}
#endif

#if defined(PREFILL_TILES)
/* The block's softmax step of one row: its scores sr (KEYS, the first `limit` visible) in
 * log2 units (times c), the row's max *m and sum *l updated, its weights into pr, and its
 * output row o rescaled. */
static inline void softmax_row(const float *sr, int limit, float c, float *m, float *l,
                               operand *pr, float *o, int d) {
    lanes x[KEYS / LANES];
    lane_mask valid[KEYS / LANES];
    lanes top = lanes_set1(NONE);
    for (int v = 0; v < KEYS / LANES; v++) {
        valid[v] = first_lanes(limit - LANES * v);
        x[v] = lanes_mul(lanes_load(sr + LANES * v), lanes_set1(c));
        top = lanes_max_where(top, valid[v], x[v]);
    }
    const float block_max = lanes_max_of(top);
    const float new_max = block_max > *m ? block_max : *m;
    const float rescale = exp2f(*m - new_max);
    lanes sum = lanes_zero();
    for (int v = 0; v < KEYS / LANES; v++) {
        const lanes w = lanes_keep(valid[v], lanes_exp2(lanes_sub(x[v], lanes_set1(new_max))));
        sum = lanes_add(sum, w);
        store_weights(pr + LANES * v, w);
    }
    *l = *l * rescale + lanes_sum_of(sum);
    *m = new_max;
    if (rescale != 1.f)
        for (int x0 = 0; x0 < d; x0 += LANES)
            lanes_store(o + x0, lanes_mul(lanes_load(o + x0), lanes_set1(rescale)));
}
#endif

/* q: [q_len, h_q, d] (token stride q_stride, heads d apart); k, v: [s_len, h_kv, d] (token
 * strides k_stride, v_stride, heads d apart); all of dtype, s_len >= q_len. out: [q_len, h_q, d]
 * of dtype, contiguous; lse: fp32 [h_q, q_len] (natural log). Returns 0; 1 where this build
 * lacks the kernel or takes no dtype inputs, d is not a multiple of 16 up to MAX_HEAD_DIM or the
 * group is over MAX_GROUP; 2 if a scratch allocation failed. */
int prefill_attention(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                      const void *v, int64_t v_stride, int dtype, int q_len, int s_len, int h_q,
                      int h_kv, int d, float scale, void *out, float *lse) {
#if defined(PREFILL_TILES)
    if (!(OPERAND_DTYPES >> dtype & 1) || d % 16 || d > MAX_HEAD_DIM || h_q % h_kv ||
        h_q / h_kv > MAX_GROUP || s_len < q_len)
        return 1;
    const int g = h_q / h_kv;
    const int s_pad = (s_len + KEYS - 1) / KEYS * KEYS, key_blocks = s_pad / KEYS;
    const int64_t head_words = (int64_t)s_pad * d / PACK; /* a head's packed K (or V) */
    /* one KV head's at a time: the threads share it in the last-level cache (16 MiB at 32K,
     * all heads' would be 128), and below glibc's mmap threshold a call reuses the last one's
     * pages instead of faulting in fresh ones */
    packed *kp = malloc(sizeof(packed) * head_words), *vp = malloc(sizeof(packed) * head_words);
    if (!kp || !vp) return free(kp), free(vp), 2;
    const int rows = TOKENS * g, rows_pad = (rows + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
    const int token_blocks = (q_len + TOKENS - 1) / TOKENS, offset = s_len - q_len;
    const float c = scale * 1.44269504f; /* scores in log2 units: exp2 of their differences */
    int status = 0;
#pragma omp parallel reduction(| : status) if ((int64_t)h_kv * token_blocks > 1)
    {
        operand *qb = aligned_alloc(64, sizeof(operand) * rows_pad * d),
                *pb = aligned_alloc(64, sizeof(operand) * rows_pad * KEYS);
        float *sb = aligned_alloc(64, sizeof(float) * rows_pad * KEYS),
              *ob = aligned_alloc(64, sizeof(float) * rows_pad * d),
              *m = malloc(sizeof(float) * rows_pad), *l = malloc(sizeof(float) * rows_pad);
        status = !(qb && pb && sb && ob && m && l);
        for (int h = 0; h < h_kv; h++) {
#pragma omp for schedule(static)
            for (int kb = 0; kb < key_blocks; kb++) {
                pack_keys(element_at(k, (int64_t)h * d, dtype), dtype, k_stride, s_len, d,
                          kb * KEYS, kp + (int64_t)kb * KEYS * d / PACK);
                pack_values(element_at(v, (int64_t)h * d, dtype), dtype, v_stride, s_len, d,
                            kb * KEYS, vp + (int64_t)kb * KEYS * d / PACK);
            }
            /* the last token blocks (the most keys) first */
#pragma omp for schedule(dynamic)
            for (int item = 0; item < token_blocks; item++) {
                if (status) continue;
                const int t0 = (token_blocks - 1 - item) * TOKENS;
                const int tokens = q_len - t0 < TOKENS ? q_len - t0 : TOKENS, valid = tokens * g;
                /* row r: token t0 + r / g, query head h g + r % g */
                for (int r = 0; r < valid; r++)
                    load_operands(qb + (int64_t)r * d,
                                  element_at(q, (int64_t)(t0 + r / g) * q_stride +
                                                    (h * g + r % g) * d, dtype),
                                  dtype, d);
                for (int r = valid; r < rows_pad; r++)
                    memset(qb + (int64_t)r * d, 0, sizeof(operand) * d);
                for (int r = 0; r < rows_pad; r++) m[r] = NONE, l[r] = 0.f;
                memset(ob, 0, sizeof(float) * rows_pad * d);
                const int last = offset + t0 + tokens - 1; /* the last key any row sees */
                const int rows_tiles = (valid + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
                for (int kb = 0; kb * KEYS <= last; kb++) {
                    const int key0 = kb * KEYS;
                    block_scores(qb, d, rows_tiles, kp + (int64_t)key0 * d / PACK, last + 1 - key0,
                                 sb);
                    for (int r = 0; r < rows_tiles; r++) {
                        int limit = offset + t0 + r / g + 1 - key0; /* keys of the block it sees */
                        if (r >= valid || limit <= 0) {
                            memset(pb + r * KEYS, 0, sizeof(operand) * KEYS);
                            continue;
                        }
                        softmax_row(sb + r * KEYS, limit < KEYS ? limit : KEYS, c, m + r, l + r,
                                    pb + r * KEYS, ob + (int64_t)r * d, d);
                    }
                    block_values(pb, vp + (int64_t)key0 * d / PACK, ob, d, rows_tiles);
                }
                for (int r = 0; r < valid; r++) {
                    const int t = t0 + r / g, head = h * g + r % g;
                    const float inv = 1.f / l[r];
                    float *o = ob + (int64_t)r * d;
                    for (int x = 0; x < d; x++) o[x] *= inv;
                    from_f32(o, d, dtype,
                             (char *)out + ((int64_t)t * h_q + head) * d * element_size(dtype));
                    lse[(int64_t)head * q_len + t] = (m[r] + log2f(l[r])) * 0.69314718f;
                }
            }
        }
        free(qb), free(pb), free(sb), free(ob), free(m), free(l);
    }
    free(kp), free(vp);
    return status ? 2 : 0;
#else
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)dtype,
        (void)q_len, (void)s_len, (void)h_q, (void)h_kv, (void)d, (void)scale, (void)out, (void)lse;
    return 1;
#endif
}
