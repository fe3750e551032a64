/* What the prefill kernels share (prefill_attention.c, column_sums.c's column_sums_lse), so
 * that each has one driver for both ISAs:
 * - one KV head's keys and values packed per block of KEYS keys (pack_keys, pack_values) and the
 *   block's S = Q K^T (block_scores, in micro-tiles of ROW_TILE query rows);
 * - the products' inputs (`operand`: query rows and softmax weights) and the width of the
 *   softmax's vectors (lanes.h).
 * With AVX512-BF16 the inputs stay bf16, packed into the dot product's pair layouts, on 16
 * lanes; on AVX2 CPUs the same in fp32 on 8 lanes: bf16, fp16 or fp32 inputs (an fp32 model,
 * which runs its linear layers faster there), keys and values converted once. */
#pragma once
#include "cpu.h"

#define KEYS 128 /* keys per block */

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#define PREFILL_TILES /* this build has the kernels */
#endif

#if defined(__AVX512BF16__)
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#endif
#include "lanes.h"

#if defined(__AVX512BF16__)
#define ROW_TILE 8 /* query rows per S micro-tile (8 x 32 keys: 16 accumulators) */
#define PACK 2     /* bf16 values per packed word: a pair */
#define OPERAND_DTYPES (1 << BF16) /* the dtypes of the inputs it takes (cpu.h's codes) */
typedef uint16_t operand; /* bf16 */
typedef uint32_t packed;

/* softmax weights, rounded to bf16 as FlashAttention rounds P */
static inline void store_weights(uint16_t *p, lanes w) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(w));
}

static inline void load_operands(uint16_t *row, const uint16_t *src, int dtype, int d) {
    (void)dtype; /* BF16 */
    memcpy(row, src, sizeof(uint16_t) * d);
}

/* One key block of one KV head, keys key0 .. key0 + KEYS (zero past s_len), in the dot
 * product's pair layout for S = Q K^T: [KEYS / 16][d / 2][16 keys][2] (a pair of channels of 16
 * keys per vector, gathered). Words are pairs of bf16; k: the head's first key, k_stride
 * elements between keys. */
static inline void pack_keys(const uint16_t *k, int dtype, int64_t k_stride, int s_len, int d,
                             int key0, uint32_t *kp) {
    (void)dtype; /* BF16 */
    const int pairs = d / 2, n = s_len - key0 < KEYS ? s_len - key0 : KEYS;
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)(k_stride * 2))); /* the 16 keys' byte offsets */
    for (int group = 0; group < KEYS / 16; group++) {
        const int left = n - 16 * group;
        const __mmask16 valid = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const char *first = (const char *)(k + (int64_t)(key0 + 16 * group) * k_stride);
        uint32_t *dst = kp + (int64_t)group * pairs * 16;
        for (int p = 0; p < pairs; p++)
            _mm512_storeu_si512(dst + p * 16, valid ? _mm512_mask_i32gather_epi32(
                _mm512_setzero_si512(), valid, rows, first + 4 * p, 1) : _mm512_setzero_si512());
    }
}

/* The same block's values for O += P V: [d / 16][KEYS / 2][16 channels][2] (a pair of keys of
 * 16 channels, interleaved by cpu.h's vnni_tiles). */
static inline void pack_values(const uint16_t *v, int dtype, int64_t v_stride, int s_len, int d,
                               int key0, uint32_t *vp) {
    (void)dtype; /* BF16 */
    const int n = s_len - key0 < KEYS ? s_len - key0 : KEYS;
    for (int c = 0; c < d / 16; c++) {
        uint16_t *dst = (uint16_t *)(vp + (int64_t)c * KEYS / 2 * 16);
        if (n < KEYS) memset(dst, 0, sizeof(uint16_t) * KEYS * 16);
        vnni_tiles(v + (int64_t)key0 * v_stride + 16 * c, v_stride, n, 16, dst);
    }
}

/* s[r][0, 32) = rows r0..r0+7 of q (bf16 rows of d) . the 32 keys of kp's groups kg, kg + 1. */
static inline void s_tile(const uint16_t *q, int d, const uint32_t *kp, float *s, int ld) {
    const int pairs = d / 2;
    __m512 acc[ROW_TILE][2];
    for (int r = 0; r < ROW_TILE; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t *k0 = kp, *k1 = kp + pairs * 16;
    for (int p = 0; p < pairs; p++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + p * 16);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
        for (int r = 0; r < ROW_TILE; r++) {
            const __m512bh a =
                (__m512bh)_mm512_set1_epi32(((const int32_t *)(q + (int64_t)r * d))[p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
    for (int r = 0; r < ROW_TILE; r++) {
        _mm512_storeu_ps(s + r * ld, acc[r][0]);
        _mm512_storeu_ps(s + r * ld + 16, acc[r][1]);
    }
}

/* s[r][0, keys) (KEYS apart) = q rows 0..rows-1 (a multiple of ROW_TILE) . the block's keys
 * (kp: its pack_keys), a row tile's keys at a time */
static inline void block_scores(const uint16_t *q, int d, int rows, const uint32_t *kp, int keys,
                                float *s) {
    for (int r0 = 0; r0 < rows; r0 += ROW_TILE)
        for (int kg = 0; kg < KEYS / 16 && kg * 16 < keys; kg += 2)
            s_tile(q + (int64_t)r0 * d, d, kp + (int64_t)kg * 16 * d / 2, s + r0 * KEYS + kg * 16,
                   KEYS);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#define ROW_TILE 6 /* query rows per S micro-tile (6 x 16 keys: 12 accumulators) */
#define PACK 1
#define OPERAND_DTYPES (1 << BF16 | 1 << F16 | 1 << F32)
typedef float operand;
typedef float packed;

static inline void store_weights(float *p, lanes w) { _mm256_storeu_ps(p, w); }

static inline void load_operands(float *row, const void *src, int dtype, int d) {
    to_f32(src, dtype, d, row);
}

/* the head's keys key0 .. key0 + KEYS (zero past s_len) -> kp [KEYS / 8][d][8] */
static inline void pack_keys(const void *k, int dtype, int64_t k_stride, int s_len, int d,
                             int key0, float *kp) {
    for (int j = 0; j < KEYS; j++) {
        float *dst = kp + (int64_t)(j / 8) * d * 8 + j % 8;
        if (key0 + j < s_len) {
            float row[MAX_HEAD_DIM];
            to_f32(element_at(k, (int64_t)(key0 + j) * k_stride, dtype), dtype, d, row);
            for (int x = 0; x < d; x++) dst[x * 8] = row[x];
        } else {
            for (int x = 0; x < d; x++) dst[x * 8] = 0.f;
        }
    }
}

/* the head's values key0 .. key0 + KEYS (zero past s_len) -> vp in slices of 32 channels (the
 * last one 16 where d is an odd multiple of 16), each [KEYS][its width]: a PV tile reads one
 * run of memory */
static inline void pack_values(const void *v, int dtype, int64_t v_stride, int s_len, int d,
                               int key0, float *vp) {
    for (int x0 = 0; x0 < d; x0 += 32) {
        const int width = d - x0 < 32 ? d - x0 : 32;
        float *slice = vp + (int64_t)KEYS * x0;
        for (int j = 0; j < KEYS; j++) {
            float *dst = slice + j * width;
            if (key0 + j < s_len)
                to_f32(element_at(v, (int64_t)(key0 + j) * v_stride + x0, dtype), dtype, width,
                       dst);
            else
                memset(dst, 0, sizeof(float) * width);
        }
    }
}

/* s[r][0, 16) = rows 0..5 of q (fp32 rows of d) . the 16 keys of kp's two groups. The sums are
 * named variables: held in an array, gcc stored all twelve to the stack on every channel. */
static inline void s_tile(const float *q, int d, const float *kp, float *s, int ld) {
#define ROW_SUMS(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps()
    ROW_SUMS(0); ROW_SUMS(1); ROW_SUMS(2); ROW_SUMS(3); ROW_SUMS(4); ROW_SUMS(5);
#undef ROW_SUMS
    const float *k0 = kp, *k1 = kp + d * 8;
    for (int x = 0; x < d; x++) {
        const __m256 b0 = _mm256_loadu_ps(k0 + x * 8), b1 = _mm256_loadu_ps(k1 + x * 8);
#define ROW(r)                                                    \
    do {                                                          \
        const __m256 a = _mm256_broadcast_ss(q + (r) * d + x);    \
        a##r##0 = _mm256_fmadd_ps(a, b0, a##r##0);                \
        a##r##1 = _mm256_fmadd_ps(a, b1, a##r##1);                \
    } while (0)
        ROW(0); ROW(1); ROW(2); ROW(3); ROW(4); ROW(5);
#undef ROW
    }
#define STORE(r) \
    _mm256_storeu_ps(s + (r) * ld, a##r##0), _mm256_storeu_ps(s + (r) * ld + 8, a##r##1)
    STORE(0); STORE(1); STORE(2); STORE(3); STORE(4); STORE(5);
#undef STORE
}

/* block_scores above, keys outer: a tile's 16 keys (8 KiB at d = 128) stay in L1 while every
 * row tile passes */
static inline void block_scores(const float *q, int d, int rows, const float *kp, int keys,
                                float *s) {
    for (int kt = 0; kt < KEYS / 16 && kt * 16 < keys; kt++)
        for (int r0 = 0; r0 < rows; r0 += ROW_TILE)
            s_tile(q + (int64_t)r0 * d, d, kp + (int64_t)kt * 16 * d, s + r0 * KEYS + kt * 16,
                   KEYS);
}
#endif
