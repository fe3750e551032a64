/* What the C kernels share: dtype codes (native.DTYPES), conversions, and AMX set-up. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline size_t element_size(int dtype) { return dtype == F32 ? 4 : 2; }

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
