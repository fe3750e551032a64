/* ShadowKV's key rebuild for a ragged batch, one call per layer and step (native.py; the torch
 * reference is reconstruct.rebuild_keys): each missed slot's chunk of c keys is
 * RoPE(A rows x B[b, h]) at the tokens' positions, written where the slot lies (the engine's
 * pages, or a [B, h_kv, k * c, d] tensor).
 *
 * A rows are gathered 16 at a time (whatever chunk they come from) into a zero-padded buffer,
 * and with bf16 A and B, B[b, h] is laid out as AMX B tiles once per (b, h): with AMX each
 * 16 x 16 block of keys is one tile product per 32 of the rank; with AVX512-BF16 each 4 keys x
 * 64 columns are 16 registers of sums, one dot of two rank elements per register and pair.
 * Otherwise B is converted to fp32 once per (b, h), and 4 keys x 64 columns (AVX-512; 16 with
 * AVX2) at a time are summed over the rank in registers (each B row read once for the 4 keys).
 * The products are summed in fp32 and rotated in fp32, as the reference does. */
#include <stdlib.h>

#include "cpu.h"
#include "sparse_step.h"

struct rebuild {
    const char *a; int a_dtype; int64_t a_row_bytes;
    const int64_t *a_rows; const int32_t *a_positions; const int32_t *a_start;
    const char *b; int b_dtype; int rank, d;
    const char *cos_sin; int cos_sin_dtype, rotary_dim, neox;
    char *out; int out_dtype; int64_t out_row_bytes;
    const int64_t *slot_index; /* [B, h_kv, k, c] or NULL: out is [B, h_kv, k * c, d] */
    int h_kv, k, c;
};

/* One key row: RoPE in place on fp32 x at `position`, then written in the output dtype. */
static void rope_and_write(const struct rebuild *p, float *x, int position, void *dst) {
    const int half = p->rotary_dim / 2;
    const size_t size = element_size(p->cos_sin_dtype);
    float cos[256], sin[256];  /* rotary_dim <= 512 (native.py checks) */
    to_f32(p->cos_sin + (int64_t)position * p->rotary_dim * size, p->cos_sin_dtype, half, cos);
    to_f32(p->cos_sin + ((int64_t)position * p->rotary_dim + half) * size, p->cos_sin_dtype,
           half, sin);
    if (p->neox) {
        for (int i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * cos[i] - x2 * sin[i];
            x[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            const float x1 = x[2 * i], x2 = x[2 * i + 1];
            x[2 * i] = x1 * cos[i] - x2 * sin[i];
            x[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
        }
    }
    from_f32(x, p->d, p->out_dtype, dst);
}

/* Where token t of slot s of (b, h) goes. */
static void *destination(const struct rebuild *p, int b, int h, int s, int t) {
    const int64_t slot = ((int64_t)b * p->h_kv + h) * p->k + s;
    if (p->slot_index) return p->out + p->slot_index[slot * p->c + t] * p->out_row_bytes;
    return p->out + (slot * p->c + t) * p->d * (int64_t)element_size(p->out_dtype);
}

/* The misses of (b, h) as a list of (pool row, destination), token by token. */
struct token { int64_t pool_row; void *dst; };

static int tokens_of(const struct rebuild *p, const int32_t *slot_chunks,
                     const int32_t *miss_slots, int count, int b, int h, struct token *out) {
    int n = 0;
    for (int m = 0; m < count; m++) {
        const int s = miss_slots[m], chunk = slot_chunks[s];
        for (int t = 0; t < p->c; t++) {
            out[n].pool_row = p->a_start[b] + (int64_t)chunk * p->c + t;
            out[n++].dst = destination(p, b, h, s, t);
        }
    }
    return n;
}

#define KEY_TOKENS 4   /* keys summed together, sharing each row of B they read */
#define KEY_COLUMNS 64 /* columns of those keys in registers at once (16 vectors of 16) */

/* keys[t][e0, e0 + w) = sum_j rows[t][j] * bf[j][e0, ...) for the KEY_TOKENS rows; w a constant
 * where inlined. With AVX-512 the sums stay in 4 x w / 16 registers, with AVX2 in 8 for w = 16
 * (gcc's vectorised loop kept them in memory: a load and a store per product). */
static inline __attribute__((always_inline)) void f32_block(const float *rows, int rank,
                                                           const float *bf, int d, int e0,
                                                           float *keys, const int w) {
#if defined(__AVX512F__)
    if (w % 16 == 0) {
        __m512 acc[KEY_TOKENS][KEY_COLUMNS / 16];
        for (int t = 0; t < KEY_TOKENS; t++)
            for (int e = 0; e < w / 16; e++) acc[t][e] = _mm512_setzero_ps();
        for (int j = 0; j < rank; j++) {
            __m512 bv[KEY_COLUMNS / 16];
            for (int e = 0; e < w / 16; e++)
                bv[e] = _mm512_loadu_ps(bf + (int64_t)j * d + e0 + 16 * e);
            for (int t = 0; t < KEY_TOKENS; t++) {
                const __m512 a = _mm512_set1_ps(rows[t * rank + j]);
                for (int e = 0; e < w / 16; e++) acc[t][e] = _mm512_fmadd_ps(a, bv[e], acc[t][e]);
            }
        }
        for (int t = 0; t < KEY_TOKENS; t++)
            for (int e = 0; e < w / 16; e++)
                _mm512_storeu_ps(keys + (int64_t)t * d + e0 + 16 * e, acc[t][e]);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (w == 16) {  /* 16 registers: 4 keys x 2 vectors of sums, B's 2, the broadcast */
        __m256 acc[KEY_TOKENS][2];
        for (int t = 0; t < KEY_TOKENS; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int j = 0; j < rank; j++) {
            const float *bj = bf + (int64_t)j * d + e0;
            const __m256 b0 = _mm256_loadu_ps(bj), b1 = _mm256_loadu_ps(bj + 8);
            for (int t = 0; t < KEY_TOKENS; t++) {
                const __m256 a = _mm256_broadcast_ss(rows + t * rank + j);
                acc[t][0] = _mm256_fmadd_ps(a, b0, acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(a, b1, acc[t][1]);
            }
        }
        for (int t = 0; t < KEY_TOKENS; t++) {
            _mm256_storeu_ps(keys + (int64_t)t * d + e0, acc[t][0]);
            _mm256_storeu_ps(keys + (int64_t)t * d + e0 + 8, acc[t][1]);
        }
        return;
    }
#endif
    float acc[KEY_TOKENS][KEY_COLUMNS] = {{0}};
    for (int j = 0; j < rank; j++) {
        const float *bj = bf + (int64_t)j * d + e0;
        for (int t = 0; t < KEY_TOKENS; t++) {
            const float a = rows[t * rank + j];
            for (int e = 0; e < w; e++) acc[t][e] += a * bj[e];
        }
    }
    for (int t = 0; t < KEY_TOKENS; t++) memcpy(keys + (int64_t)t * d + e0, acc[t], w * 4);
}

static void f32_keys(const struct rebuild *p, const struct token *tokens, int n, const float *bf,
                     float *rows, float *keys) {
    for (int i0 = 0; i0 < n; i0 += KEY_TOKENS) {
        const int m = n - i0 < KEY_TOKENS ? n - i0 : KEY_TOKENS;
        memset(rows, 0, sizeof(float) * KEY_TOKENS * p->rank);
        for (int t = 0; t < m; t++)
            to_f32(p->a + p->a_rows[tokens[i0 + t].pool_row] * p->a_row_bytes, p->a_dtype,
                   p->rank, rows + t * p->rank);
        for (int i = i0 + KEY_TOKENS; i < i0 + 3 * KEY_TOKENS && i < n; i++)  /* scattered rows */
            for (int64_t line = 0; line < p->rank * (int64_t)element_size(p->a_dtype); line += 64)
                __builtin_prefetch(p->a + p->a_rows[tokens[i].pool_row] * p->a_row_bytes + line);
        int e0 = 0;
#if defined(__AVX512F__)
        for (; e0 + KEY_COLUMNS <= p->d; e0 += KEY_COLUMNS)
            f32_block(rows, p->rank, bf, p->d, e0, keys, KEY_COLUMNS);
#endif
        for (; e0 + 16 <= p->d; e0 += 16) f32_block(rows, p->rank, bf, p->d, e0, keys, 16);
        if (e0 < p->d) f32_block(rows, p->rank, bf, p->d, e0, keys, p->d - e0);
        for (int t = 0; t < m; t++)
            rope_and_write(p, keys + (int64_t)t * p->d, p->a_positions[tokens[i0 + t].pool_row],
                           tokens[i0 + t].dst);
    }
}

#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
/* The next 16 tokens' A rows (bf16) into rows [16][kb * 32], zero past the rank and past n; the
 * 16 after them prefetched. Returns how many were copied. */
static int gather_bf16_rows(const struct rebuild *p, const struct token *tokens, int i0, int n,
                            int kb, uint16_t *rows) {
    const int m = n - i0 < 16 ? n - i0 : 16;
    memset(rows, 0, (size_t)16 * kb * 64);
    for (int i = 0; i < m; i++)
        memcpy(rows + i * kb * 32, p->a + p->a_rows[tokens[i0 + i].pool_row] * p->a_row_bytes,
               (size_t)p->rank * 2);
    for (int i = i0 + 16; i < i0 + 32 && i < n; i++)
        for (int line = 0; line < p->rank * 2; line += 64)
            _mm_prefetch(p->a + p->a_rows[tokens[i].pool_row] * p->a_row_bytes + line,
                         _MM_HINT_T0);
    return m;
}
#endif

#if defined(__AVX512BF16__)
/* 4 keys (rows [4][kb * 32]) x `nbs` (<= 4, constant where inlined) blocks of 16 columns from
 * column block nb0, over B's tiles (vnni_tiles): per pair of rank elements, a key's pair
 * broadcast and one dot with each block's pair row. */
static inline __attribute__((always_inline)) void bf16_block(const uint16_t *rows, int kb,
                                                            const uint16_t *tiles, int nb0,
                                                            float *keys, int d, const int nbs) {
    __m512 acc[4][4];
    for (int t = 0; t < 4; t++)
        for (int e = 0; e < nbs; e++) acc[t][e] = _mm512_setzero_ps();
    const int32_t *pairs = (const int32_t *)rows;  /* pair P of key t: pairs[t * kb * 16 + P] */
    for (int j = 0; j < kb; j++)
        for (int q = 0; q < 16; q++) {
            __m512bh bv[4];
            for (int e = 0; e < nbs; e++)
                bv[e] = (__m512bh)_mm512_loadu_si512(
                    tiles + ((int64_t)(nb0 + e) * kb + j) * 512 + q * 32);
            for (int t = 0; t < 4; t++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pairs[t * kb * 16 + j * 16 + q]);
                for (int e = 0; e < nbs; e++) acc[t][e] = _mm512_dpbf16_ps(acc[t][e], a, bv[e]);
            }
        }
    for (int t = 0; t < 4; t++)
        for (int e = 0; e < nbs; e++)
            _mm512_storeu_ps(keys + (int64_t)t * d + (nb0 + e) * 16, acc[t][e]);
}

static void bf16_keys(const struct rebuild *p, const struct token *tokens, int n,
                      const uint16_t *tiles, uint16_t *rows, float *keys) {
    const int kb = (p->rank + 31) / 32, blocks = p->d / 16;
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int m = gather_bf16_rows(p, tokens, i0, n, kb, rows);
        for (int t0 = 0; t0 < m; t0 += 4) {  /* rows past m are zeros: their keys unused */
            const uint16_t *four = rows + t0 * kb * 32;
            float *out = keys + (int64_t)t0 * p->d;
            int nb = 0;
            for (; nb + 4 <= blocks; nb += 4) bf16_block(four, kb, tiles, nb, out, p->d, 4);
            for (; nb < blocks; nb++) bf16_block(four, kb, tiles, nb, out, p->d, 1);
        }
        for (int i = 0; i < m; i++)
            rope_and_write(p, keys + (int64_t)i * p->d, p->a_positions[tokens[i0 + i].pool_row],
                           tokens[i0 + i].dst);
    }
}
#endif

#if defined(__AMX_BF16__)
/* 16 tokens at a time: their A rows into a [16][rank padded to 32] buffer, then per 16
 * columns of d one C tile over the rank's B tiles. */
static void amx_keys(const struct rebuild *p, const struct token *tokens, int n,
                     const uint16_t *tiles, uint16_t *rows, float *keys) {
    const int kb = (p->rank + 31) / 32;
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int m = gather_bf16_rows(p, tokens, i0, n, kb, rows);
        /* two column blocks at a time: two independent chains of tile products */
        for (int nb = 0; nb < p->d / 16; nb += 2) {
            const int two = nb + 1 < p->d / 16;
            _tile_zero(0);
            _tile_zero(1);
            for (int j = 0; j < kb; j++) {
                _tile_loadd(2, rows + j * 32, kb * 64);
                _tile_loadd(3, tiles + ((int64_t)nb * kb + j) * 512, 64);
                _tile_dpbf16ps(0, 2, 3);
                if (two) {
                    _tile_loadd(4, tiles + ((int64_t)(nb + 1) * kb + j) * 512, 64);
                    _tile_dpbf16ps(1, 2, 4);
                }
            }
            _tile_stored(0, keys + nb * 16, (int64_t)p->d * 4);
            if (two) _tile_stored(1, keys + (nb + 1) * 16, (int64_t)p->d * 4);
        }
        for (int i = 0; i < m; i++)
            rope_and_write(p, keys + (int64_t)i * p->d, p->a_positions[tokens[i0 + i].pool_row],
                           tokens[i0 + i].dst);
    }
}
#endif

#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
/* bf16 A and B: B[b, h] (bmat) as [d / 16][kb] tiles, then the keys by AMX or AVX512-BF16. */
static void tiled_keys(const struct rebuild *p, int amx, const uint16_t *bmat,
                       const struct token *tokens, int n, uint16_t *tiles, uint16_t *rows,
                       float *keys) {
    const int kb = (p->rank + 31) / 32;
    for (int nb = 0; nb < p->d / 16; nb++)  /* B's 16 columns nb as [kb] tiles */
        vnni_tiles(bmat + nb * 16, p->d, p->rank, 16, tiles + (int64_t)nb * kb * 512);
#if defined(__AMX_BF16__)
    if (amx) {
        amx_keys(p, tokens, n, tiles, rows, keys);
        return;
    }
#endif
#if defined(__AVX512BF16__)
    bf16_keys(p, tokens, n, tiles, rows, keys);
#endif
    (void)amx;
}
#endif

/* slot_chunks, miss_slots: [B, h_kv, k] int32; miss_count [B, h_kv] int32; b: [B, h_kv, rank,
 * d] contiguous; cos_sin: [positions, rotary_dim] contiguous. */
void rebuild_keys(const void *a, int a_dtype, int64_t a_row_stride, const int64_t *a_rows,
                  const int32_t *a_positions, const int32_t *a_start, const void *b,
                  int b_dtype, int rank, const int32_t *slot_chunks, const int32_t *miss_slots,
                  const int32_t *miss_count, int batch, int h_kv, int k, int c,
                  const void *cos_sin, int cos_sin_dtype, int rotary_dim, int neox, void *out,
                  int out_dtype,
                  int64_t out_row_stride, const int64_t *slot_index, int d) {
    const struct rebuild p = {a, a_dtype, a_row_stride * (int64_t)element_size(a_dtype), a_rows,
                              a_positions, a_start, b, b_dtype, rank, d, cos_sin,
                              cos_sin_dtype, rotary_dim, neox, out, out_dtype,
                              out_row_stride * (int64_t)element_size(out_dtype), slot_index,
                              h_kv, k, c};
    const int kb = (rank + 31) / 32;
    /* bf16 A and B go through B's tiles: by AMX where the process may use it, else AVX512-BF16 */
    int tiled = 0, amx = 0;
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
    tiled = a_dtype == BF16 && b_dtype == BF16 && d % 16 == 0;
#endif
#if defined(__AMX_BF16__)
    amx = tiled && amx_usable();
#endif
#if !defined(__AVX512BF16__)
    tiled = amx;  /* no dot products: AMX or nothing */
#endif
    /* (request, KV head) pairs across the threads, each with its own scratch (and tile
     * configuration: per thread); each writes only its own slots */
#pragma omp parallel if (batch * h_kv > 1)
    {
#if defined(__AMX_BF16__)
        if (amx) amx_configure();
#endif
        struct token *tokens = malloc(sizeof(struct token) * k * c);
        float *keys = malloc(sizeof(float) * 16 * d);
        float *row = malloc(sizeof(float) * KEY_TOKENS * rank);
        void *bbuf = malloc(tiled ? (size_t)d / 16 * kb * 1024 : sizeof(float) * rank * d);
        uint16_t *rows = malloc((size_t)16 * kb * 64);
#pragma omp for schedule(dynamic)
        for (int64_t bh = 0; bh < (int64_t)batch * h_kv; bh++) {
            if (miss_count[bh] == 0) continue;
            const int bi = (int)(bh / h_kv), h = (int)(bh % h_kv);
            const int n = tokens_of(&p, slot_chunks + bh * k, miss_slots + bh * k,
                                    miss_count[bh], bi, h, tokens);
            const char *bmat = (const char *)b + bh * rank * d * element_size(b_dtype);
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
            if (tiled) {
                tiled_keys(&p, amx, (const uint16_t *)bmat, tokens, n, bbuf, rows, keys);
                continue;
            }
#endif
            for (int j = 0; j < rank; j++)
                to_f32(bmat + (int64_t)j * d * element_size(b_dtype), b_dtype, d,
                       (float *)bbuf + (int64_t)j * d);
            f32_keys(&p, tokens, n, bbuf, row, keys);
        }
#if defined(__AMX_BF16__)
        if (amx) _tile_release();
#endif
        free(tokens), free(keys), free(row), free(bbuf), free(rows);
    }
}
