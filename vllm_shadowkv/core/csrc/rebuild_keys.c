/* ShadowKV's key rebuild for a ragged batch, one call per layer and step (native.py; the torch
 * reference is reconstruct.rebuild_keys): each missed slot's chunk of c keys is
 * RoPE(A rows x B[b, h]) at the tokens' positions, written where the slot lies (the engine's
 * pages, or a [B, h_kv, k * c, d] tensor).
 *
 * A rows are gathered 16 at a time (whatever chunk they come from) into a zero-padded buffer;
 * with bf16 A and B and AMX, B[b, h] is laid out as B tiles once per (b, h) and each 16 x 16
 * block of keys is one tile product per 32 of the rank; otherwise B is converted to fp32 once
 * per (b, h) and each key row is a sum of B's rows scaled by the A row (vectorised over d).
 * The products are summed in fp32 and rotated in fp32, as the reference does. */
#include <stdlib.h>

#include "cpu.h"

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

static void f32_keys(const struct rebuild *p, const struct token *tokens, int n, const float *bf,
                     float *row, float *key) {
    for (int i = 0; i < n; i++) {
        const int64_t a_row = p->a_rows[tokens[i].pool_row];
        to_f32(p->a + a_row * p->a_row_bytes, p->a_dtype, p->rank, row);
        memset(key, 0, sizeof(float) * p->d);
        for (int j = 0; j < p->rank; j++)
            for (int e = 0; e < p->d; e++) key[e] += row[j] * bf[(int64_t)j * p->d + e];
        rope_and_write(p, key, p->a_positions[tokens[i].pool_row], tokens[i].dst);
    }
}

#if defined(__AMX_BF16__)
/* 16 tokens at a time: their A rows into a [16][rank padded to 32] buffer, then per 16
 * columns of d one C tile over the rank's B tiles. */
static void amx_keys(const struct rebuild *p, const struct token *tokens, int n,
                     const uint16_t *tiles, uint16_t *rows, float *keys) {
    const int kb = (p->rank + 31) / 32;
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int m = n - i0 < 16 ? n - i0 : 16;
        memset(rows, 0, (size_t)16 * kb * 64);
        for (int i = 0; i < m; i++)
            memcpy(rows + i * kb * 32, p->a + p->a_rows[tokens[i0 + i].pool_row] * p->a_row_bytes,
                   (size_t)p->rank * 2);
        for (int i = i0 + 16; i < i0 + 32 && i < n; i++)  /* the next block's rows, meanwhile */
            for (int line = 0; line < p->rank * 2; line += 64)
                _mm_prefetch(p->a + p->a_rows[tokens[i].pool_row] * p->a_row_bytes + line,
                             _MM_HINT_T0);
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
    int amx = 0;
#if defined(__AMX_BF16__)
    amx = a_dtype == BF16 && b_dtype == BF16 && d % 16 == 0 && amx_usable();
    if (amx) amx_configure();
#endif
    struct token *tokens = malloc(sizeof(struct token) * k * c);
    float *keys = malloc(sizeof(float) * 16 * d), *row = malloc(sizeof(float) * rank);
    void *bbuf = malloc(amx ? (size_t)d / 16 * kb * 1024 : sizeof(float) * rank * d);
    uint16_t *rows = malloc((size_t)16 * kb * 64);
    for (int bi = 0; bi < batch; bi++)
        for (int h = 0; h < h_kv; h++) {
            const int64_t bh = (int64_t)bi * h_kv + h;
            if (miss_count[bh] == 0) continue;
            const int n = tokens_of(&p, slot_chunks + bh * k, miss_slots + bh * k,
                                    miss_count[bh], bi, h, tokens);
            const char *bmat = (const char *)b + bh * rank * d * element_size(b_dtype);
#if defined(__AMX_BF16__)
            if (amx) {
                for (int nb = 0; nb < d / 16; nb++)  /* B's 16 columns nb as [kb] tiles */
                    vnni_tiles((const uint16_t *)bmat + nb * 16, d, rank, 16,
                               (uint16_t *)bbuf + (int64_t)nb * kb * 512);
                amx_keys(&p, tokens, n, bbuf, rows, keys);
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
