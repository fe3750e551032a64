/* A vector of LANES fp32 lanes, the width the including kernel set (AVX-512's 16 or AVX2's 8),
 * and its mask: the operations the kernels write once for both ISAs. */
#pragma once
#include "cpu.h"

#if LANES == 16
typedef __m512 lanes;
typedef __mmask16 lane_mask;
#define lanes_load _mm512_loadu_ps
#define lanes_store _mm512_storeu_ps
#define lanes_set1 _mm512_set1_ps
#define lanes_zero _mm512_setzero_ps
#define lanes_add _mm512_add_ps
#define lanes_sub _mm512_sub_ps
#define lanes_mul _mm512_mul_ps
#define lanes_fmadd _mm512_fmadd_ps
#define lanes_fmsub _mm512_fmsub_ps
#define lanes_exp2 exp2_ps
#define lanes_keep _mm512_maskz_mov_ps /* (mask, x): x where the mask is set, else 0 */
#define lanes_max_where(top, mask, x) _mm512_mask_max_ps(top, mask, top, x)
#define lanes_max_of _mm512_reduce_max_ps
#define lanes_sum_of _mm512_reduce_add_ps

/* the first n lanes (none for n <= 0) */
static inline lane_mask first_lanes(int n) {
    return n >= 16 ? 0xFFFF : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
}

static inline void store_first_lanes(float *p, int n, lanes x) {
    _mm512_mask_storeu_ps(p, first_lanes(n), x);
}
#elif LANES == 8
typedef __m256 lanes;
typedef __m256 lane_mask; /* all bits set in a lane that is in */
#define lanes_load _mm256_loadu_ps
#define lanes_store _mm256_storeu_ps
#define lanes_set1 _mm256_set1_ps
#define lanes_zero _mm256_setzero_ps
#define lanes_add _mm256_add_ps
#define lanes_sub _mm256_sub_ps
#define lanes_mul _mm256_mul_ps
#define lanes_fmadd _mm256_fmadd_ps
#define lanes_fmsub _mm256_fmsub_ps
#define lanes_exp2 exp2_ps8
#define lanes_keep _mm256_and_ps
#define lanes_max_where(top, mask, x) _mm256_max_ps(top, _mm256_blendv_ps(top, x, mask))

static inline float lanes_max_of(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float lanes_sum_of(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline lane_mask first_lanes(int n) {
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

static inline void store_first_lanes(float *p, int n, lanes x) {
    _mm256_maskstore_ps(p, _mm256_castps_si256(first_lanes(n)), x);
}
#endif
