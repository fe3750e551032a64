/* What the C kernels share: dtype codes (native.DTYPES), conversions, the row copy, bf16 dot
 * products, AMX set-up, the online softmax's block update and value sums, and top-k. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

#define MAX_HEAD_DIM 512
#define MAX_QUERY_ROWS 1024 /* a call's query rows: h_q x s_q (queries on the stack) */
#define PREFETCH_AHEAD 4     /* rows prefetched ahead in the scattered row copies */
/* Rows prefetched ahead by the bf16 row dots: rows are read through ids (a request's landmarks
 * lie in runs of a page's 16 rows), where the hardware's stream prefetch starts over. */
#define DOTS_AHEAD 2
/* and, into L2, this many rows ahead: once the model's weights have swept the caches between
 * layers the rows come from memory, and 2 rows ahead did not cover its latency (the landmark
 * pass, cold: 10-30 % faster at 32K-128K; benchmarks/RESULTS.md, "ShadowKV's CPU step of a
 * layer in one C call") */
#define DOTS_FAR 16

static inline size_t element_size(int dtype) { return dtype == F32 ? 4 : 2; }

/* &base[index] for elements of dtype */
static inline const void *element_at(const void *base, int64_t index, int dtype) {
    return (const char *)base + index * (int64_t)element_size(dtype);
}

int kernel_threads(void); /* threads.c: the threads of the kernels' parallel loops */

static inline void to_f32(const void *src, int dtype, int n, float *out) {
    if (dtype == BF16) {
        const uint16_t *s = src;
        for (int k = 0; k < n; k++) {
            uint32_t bits = (uint32_t)s[k] << 16;
            memcpy(out + k, &bits, 4);
        }
    } else if (dtype == F16) {
        const _Float16 *s = src;
        for (int k = 0; k < n; k++) out[k] = (float)s[k];
    } else {
        memcpy(out, src, (size_t)n * 4);
    }
}

/* fp32 -> dtype, rounding to nearest even as torch does (no NaN inputs here) */
static inline void from_f32(const float *src, int n, int dtype, void *out) {
    if (dtype == BF16) {
        uint16_t *o = out;
        for (int k = 0; k < n; k++) {
            uint32_t bits;
            memcpy(&bits, src + k, 4);
            o[k] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
        }
    } else if (dtype == F16) {
        _Float16 *o = out;
        for (int k = 0; k < n; k++) o[k] = (_Float16)src[k];
    } else {
        memcpy(out, src, (size_t)n * 4);
    }
}

/* One row of `width` elements, converted through `scratch` (width floats) where dtypes differ. */
static inline void copy_row(void *to, int dst_dtype, const void *from, int src_dtype,
                            int64_t width, float *scratch) {
    if (dst_dtype == src_dtype) {
        memcpy(to, from, (size_t)width * element_size(src_dtype));
    } else {
        to_f32(from, src_dtype, (int)width, scratch);
        from_f32(scratch, (int)width, dst_dtype, to);
    }
}

#if defined(__AMX_BF16__)
static inline int amx_usable(void) {
    static int state = -1;  /* the kernel must grant the process the tile data state */
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
}

/* All eight tiles of 16 rows x 64 bytes. */
static inline void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int tile = 0; tile < 8; tile++) config.colsb[tile] = 64, config.rows[tile] = 16;
    _tile_loadconfig(&config);
}
#endif

#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
/* Rows [k, columns <= 16] of bf16 (row stride in elements) as B tiles: for each 32 rows,
 * [16 pairs of rows][16 columns][2], zero past k rows and past ``columns``. Each tile row
 * interleaves two source rows in one permutation. */
static inline void vnni_tiles(const uint16_t *src, int64_t stride, int k, int columns,
                              uint16_t *tiles) {
    const __mmask16 valid = (__mmask16)((1u << columns) - 1);
    __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                          40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                          1, 32, 0);
    const int pairs = (k + 31) / 32 * 16;
    for (int pair = 0; pair < pairs; pair++) {
        const int r = 2 * pair;
        __m256i even = r < k ? _mm256_maskz_loadu_epi16(valid, src + r * stride)
                             : _mm256_setzero_si256();
        __m256i odd = r + 1 < k ? _mm256_maskz_loadu_epi16(valid, src + (r + 1) * stride)
                                : _mm256_setzero_si256();
        _mm512_storeu_si512(tiles + pair * 32,
                            _mm512_permutex2var_epi16(_mm512_castsi256_si512(even), interleave,
                                                      _mm512_castsi256_si512(odd)));
    }
}
#endif

/* Where a request's dots go: logits[(h * nq + t) * ld + i] = row i . query row t, of head h
 * (ld >= n). */
struct rows {
    const char *base;
    const int64_t *ids;
    int64_t row_bytes, head_bytes;
    int n, h_kv, d;
    int64_t ld;
};

#if defined(__AVX512F__) || defined(__AVX2__)
/* Row i's successors DOTS_AHEAD (into L1) and DOTS_FAR (into L2) ahead, all heads, of `size`
 * bytes per element. */
static inline void prefetch_rows(const struct rows *r, int i, int i1, int size) {
    if (i + DOTS_AHEAD < i1) {
        const char *ahead = r->base + r->ids[i + DOTS_AHEAD] * r->row_bytes;
        for (int h = 0; h < r->h_kv; h++)
            for (int line = 0; line < r->d * size; line += 64)
                _mm_prefetch(ahead + h * r->head_bytes + line, _MM_HINT_T0);
    }
    if (i + DOTS_FAR < i1) {  /* into L2 a page's landmarks ahead: from memory */
        const char *ahead = r->base + r->ids[i + DOTS_FAR] * r->row_bytes;
        for (int h = 0; h < r->h_kv; h++)
            for (int line = 0; line < r->d * size; line += 64)
                _mm_prefetch(ahead + h * r->head_bytes + line, _MM_HINT_T1);
    }
}
#endif

#if defined(__AVX512F__)
/* The four vectors' sums, one per lane: transposing adds (a horizontal sum each would cost
 * twice the instructions). */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
    x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
    return _mm512_castps512_ps128(x);
}
#endif

#if defined(__AVX2__)
/* 8 bf16 as fp32: bf16 is fp32's upper half */
static inline __m256 bf16x8(const uint16_t *src) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}

/* sum4 on 8 lanes */
static inline __m128 sum4_ps8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

/* 2^t: 2^n x 2^f with n = round(t), f in [-1/2, 1/2], 2^f by its Taylor polynomial of degree 6
 * (relative error below 2e-7; coefficients highest first, evaluated by Horner's rule); t clamped
 * at -126, no denormals. */
static const float EXP2_TAYLOR[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                     2.4022651e-1f, 6.9314718e-1f, 1.f};

#if defined(__AVX512F__)
static inline __m512 exp2_ps(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[i]));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* 2^t as exp2_ps above, on 8 lanes: t clamped at -126, 2^n built in the exponent bits */
static inline __m256 exp2_ps8(__m256 t) {
    t = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_TAYLOR[i]));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512BF16__)
static inline __m512bh load_bf16(const uint16_t *src, int v, int nv, __mmask32 tail) {
    return (__m512bh)_mm512_maskz_loadu_epi16(v == nv - 1 ? tail : ~0u, src + 32 * v);
}

/* Rows [i0, i1), each over all its heads, by AVX512-BF16; nv = d / 32 rounded up, a constant
 * where inlined from bf16_dots (the row then stays in registers). */
static inline __attribute__((always_inline)) void bf16_dots_nv(
    const struct rows *r, const void *const *queries, int nq, float *logits, int i0, int i1,
    const int nv) {
    const __mmask32 tail = r->d % 32 ? (1u << r->d % 32) - 1 : ~0u;
    for (int i = i0; i < i1; i++) {
        prefetch_rows(r, i, i1, 2);
        for (int h = 0; h < r->h_kv; h++) {
            const uint16_t *row = (const uint16_t *)(r->base + r->ids[i] * r->row_bytes +
                                                     h * r->head_bytes);
            __m512bh rv[MAX_HEAD_DIM / 32];
            for (int v = 0; v < nv; v++) rv[v] = load_bf16(row, v, nv, tail);
            const void *const *qh = queries + h * nq;
            float *dots = logits + (int64_t)h * nq * r->ld + i;  /* query row t at t * ld */
            int t = 0;
            for (; t + 4 <= nq; t += 4) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int v = 0; v < nv; v++) {
                    a0 = _mm512_dpbf16_ps(a0, rv[v], load_bf16(qh[t], v, nv, tail));
                    a1 = _mm512_dpbf16_ps(a1, rv[v], load_bf16(qh[t + 1], v, nv, tail));
                    a2 = _mm512_dpbf16_ps(a2, rv[v], load_bf16(qh[t + 2], v, nv, tail));
                    a3 = _mm512_dpbf16_ps(a3, rv[v], load_bf16(qh[t + 3], v, nv, tail));
                }
                float four[4];
                _mm_storeu_ps(four, sum4(a0, a1, a2, a3));
                for (int u = 0; u < 4; u++) dots[(int64_t)(t + u) * r->ld] = four[u];
            }
            for (; t < nq; t++) {
                __m512 acc = _mm512_setzero_ps();
                for (int v = 0; v < nv; v++)
                    acc = _mm512_dpbf16_ps(acc, rv[v], load_bf16(qh[t], v, nv, tail));
                dots[(int64_t)t * r->ld] = _mm512_reduce_add_ps(acc);
            }
        }
    }
}

static inline void bf16_dots(const struct rows *r, const void *const *queries, int nq,
                             float *logits, int i0, int i1) {
    switch ((r->d + 31) / 32) {  /* the common head sizes, 64 and 128 */
    case 2: bf16_dots_nv(r, queries, nq, logits, i0, i1, 2); return;
    case 4: bf16_dots_nv(r, queries, nq, logits, i0, i1, 4); return;
    default: bf16_dots_nv(r, queries, nq, logits, i0, i1, (r->d + 31) / 32);
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* bf16_dots without AVX512-BF16: rows of fp32 (bf16 = 0) or bf16 (bf16 = 1, converted in
 * registers) against fp32 query rows qf [h_kv][nq][d], d a multiple of 8, four rows at a time. */
static inline __attribute__((always_inline)) void f32_dots8_as(
    const struct rows *r, const float *qf, int nq, float *logits, int i0, int i1, const int bf16) {
    const int d = r->d;
    for (int i = i0; i < i1; i++) {
        prefetch_rows(r, i, i1, bf16 ? 2 : 4);
        for (int h = 0; h < r->h_kv; h++) {
            const char *row = r->base + r->ids[i] * r->row_bytes + h * r->head_bytes;
            const float *qh = qf + (int64_t)h * nq * d;
            float *dots = logits + (int64_t)h * nq * r->ld + i;  /* query row t at t * ld */
#define KEY8(x) \
    (bf16 ? bf16x8((const uint16_t *)row + (x)) : _mm256_loadu_ps((const float *)row + (x)))
            int t = 0;
            for (; t + 4 <= nq; t += 4) {
                const float *q0 = qh + t * d;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int x = 0; x < d; x += 8) {
                    const __m256 k = KEY8(x);
                    a0 = _mm256_fmadd_ps(k, _mm256_loadu_ps(q0 + x), a0);
                    a1 = _mm256_fmadd_ps(k, _mm256_loadu_ps(q0 + d + x), a1);
                    a2 = _mm256_fmadd_ps(k, _mm256_loadu_ps(q0 + 2 * d + x), a2);
                    a3 = _mm256_fmadd_ps(k, _mm256_loadu_ps(q0 + 3 * d + x), a3);
                }
                float four[4];
                _mm_storeu_ps(four, sum4_ps8(a0, a1, a2, a3));
                for (int u = 0; u < 4; u++) dots[(int64_t)(t + u) * r->ld] = four[u];
            }
            for (; t < nq; t++) {
                __m256 acc = _mm256_setzero_ps();
                for (int x = 0; x < d; x += 8)
                    acc = _mm256_fmadd_ps(KEY8(x), _mm256_loadu_ps(qh + t * d + x), acc);
                dots[(int64_t)t * r->ld] = _mm_cvtss_f32(sum4_ps8(acc, acc, acc, acc));
            }
#undef KEY8
        }
    }
}

/* Whether f32_dots8 takes rows of dtype and head size d. */
static inline int dots8_fit(int dtype, int d) {
    return d % 8 == 0 && (dtype == BF16 || dtype == F32);
}

static inline void f32_dots8(const struct rows *r, int dtype, const float *qf, int nq,
                             float *logits, int i0, int i1) {
    if (dtype == BF16) f32_dots8_as(r, qf, nq, logits, i0, i1, 1);
    else f32_dots8_as(r, qf, nq, logits, i0, i1, 0);
}
#endif

/* One block of n scores of a query row in online softmax: pr (scaled, masked to NONE-like
 * finite values; `top` their max) becomes the block's weights, and the row's max *m, sum *l
 * and value sums acc[d] are rescaled to the new max. */
static inline void softmax_update(float *pr, int n, float top, float *m, float *l, float *acc,
                                  int d) {
    const float new_max = top > *m ? top : *m;
    const float rescale = expf(*m - new_max);
    float total = 0.f;
    for (int i = 0; i < n; i++) total += pr[i] = expf(pr[i] - new_max);
    *l = *l * rescale + total;
    *m = new_max;
    if (rescale != 1.f)
        for (int x = 0; x < d; x++) acc[x] *= rescale;
}

#if defined(__AVX512F__)
/* acc[r][x0, x0 + 16 nv) += sum_i p[r * n + i] * vf[i][x0, ...): the sums stay in registers
 * where nv is a constant (inlined). */
static inline __attribute__((always_inline)) void add_values_nv(
    float *acc, const float *p, const float *vf, int n, int nq, int d, int x0, const int nv) {
    for (int r = 0; r < nq; r++) {
        __m512 a[8];
        for (int v = 0; v < nv; v++) a[v] = _mm512_loadu_ps(acc + r * d + x0 + 16 * v);
        for (int i = 0; i < n; i++) {
            const __m512 pi = _mm512_set1_ps(p[r * n + i]);
            for (int v = 0; v < nv; v++)
                a[v] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(vf + i * d + x0 + 16 * v), a[v]);
        }
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(acc + r * d + x0 + 16 * v, a[v]);
    }
}
#endif

/* acc[r] += sum_i p[r * n + i] * vf[i], for the nq query rows; vf: n rows of d fp32. */
static inline void add_values(float *acc, const float *p, const float *vf, int n, int nq, int d) {
    int x0 = 0;
#if defined(__AVX512F__)
    for (; x0 + 128 <= d; x0 += 128) add_values_nv(acc, p, vf, n, nq, d, x0, 8);
    for (; x0 + 64 <= d; x0 += 64) add_values_nv(acc, p, vf, n, nq, d, x0, 4);
    for (; x0 + 16 <= d; x0 += 16) add_values_nv(acc, p, vf, n, nq, d, x0, 1);
#endif
    for (int r = 0; r < nq; r++)
        for (int i = 0; i < n; i++)
            for (int x = x0; x < d; x++) acc[r * d + x] += p[r * n + i] * vf[i * d + x];
}

/* Top-k by a min-heap of the best so far (ShadowKV's chunks, SpeCache's tokens). */
struct scored {
    float score;
    int index;
};

/* a before b: higher score, then lower index (the order of the selection) */
static inline int better(struct scored a, struct scored b) {
    return a.score > b.score || (a.score == b.score && a.index < b.index);
}

/* heap[0] is the worst kept: sift the root down */
static inline void sift_down(struct scored *heap, int n, int i) {
    for (;;) {
        int worst = i;
        const int left = 2 * i + 1, right = left + 1;
        if (left < n && better(heap[worst], heap[left])) worst = left;
        if (right < n && better(heap[worst], heap[right])) worst = right;
        if (worst == i) return;
        const struct scored t = heap[i];
        heap[i] = heap[worst], heap[worst] = t;
        i = worst;
    }
}

/* The `take` best of scores[0, n) into out, best first. */
static inline void top(const float *scores, int n, int take, struct scored *out) {
    if (take == 0) return;
    for (int i = 0; i < take; i++) out[i] = (struct scored){scores[i], i};
    for (int i = take / 2 - 1; i >= 0; i--) sift_down(out, take, i);
    for (int i = take; i < n; i++) {
        const struct scored s = {scores[i], i};
        if (better(s, out[0])) out[0] = s, sift_down(out, take, 0);
    }
    for (int end = take - 1; end > 0; end--) {  /* heap sort: the worst goes last */
        const struct scored t = out[0];
        out[0] = out[end], out[end] = t;
        sift_down(out, end, 0);
    }
}

/* Order-preserving map of a float to an unsigned key: a larger float, a larger key. */
static inline uint32_t float_key(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

/* The `take` best of scores[0, n) into ids, in no particular order (among equal scores the
 * lower index wins), by radix select on the scores' keys: three passes of 11, 11 and 10 bits,
 * each over the candidates left in the bin that holds the take-th best. No branch depends on a
 * heap's state, so this beats `top` once take is in the hundreds (TailorKV's 896 of 16K tokens,
 * 16 rows: its whole kernel took 0.86 ms, against 5.4 ms with `top`). keys, cand: scratch of
 * n each. */
static inline void top_set(const float *scores, int n, int take, uint32_t *keys, int32_t *cand,
                           int32_t *ids) {
    static const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    int32_t hist[1 << 11];
    int out = 0, need = take, m = n;
    for (int i = 0; i < n; i++) keys[i] = float_key(scores[i]), cand[i] = i;
    for (int level = 0; level < 3 && need > 0; level++) {
        const int shift = shifts[level], bins = 1 << widths[level];
        const uint32_t mask = (uint32_t)bins - 1;
        memset(hist, 0, sizeof(int32_t) * bins);
        for (int j = 0; j < m; j++) hist[keys[cand[j]] >> shift & mask]++;
        int bin = bins - 1, above = 0;
        while (above + hist[bin] < need) above += hist[bin--];
        int kept = 0;  /* in place: kept <= j */
        for (int j = 0; j < m; j++) {
            const uint32_t d = keys[cand[j]] >> shift & mask;
            if (d > (uint32_t)bin) ids[out++] = cand[j];
            else if (d == (uint32_t)bin) cand[kept++] = cand[j];
        }
        need -= above, m = kept;
        if (m == need || level == 2) {  /* the bin's all, or equal scores: the first ones */
            for (int j = 0; j < need; j++) ids[out++] = cand[j];
            need = 0;
        }
    }
}
