/* MiniKV's H2O column sums of one prefill chunk on AMX tiles (native.py; the torch reference is
 * heavy_hitters.chunk_column_sums_reference): for each KV head, the softmax probabilities of
 * its group's query rows (causal), summed over the rows, for every key so far.
 *
 * The logits are never stored beyond one 16 x 16 tile. Per panel of query rows two passes run
 * over the keys: the first sums each row's exp(logit - m), m a logit of the row (its own key's
 * or the first key's, whichever is larger), so the sum is at least 1 and, in fp32, only
 * overflows if some logit lies more than about 88 above m (a row whose sum exceeds LARGE is
 * summed again, centred higher); the second adds each row's probabilities exp(logit - lse)
 * into the keys' sums. Each tile is one AMX product per 32 channels (bf16 inputs, fp32 sums):
 * the keys are laid out as B tiles once per head, and a block of keys' tiles stays in tile
 * registers while every row block of the panel passes under them.
 *
 * Where the chunk's attention ran in C (prefill_attention.c) it gave each row's LSE, and
 * column_sums_lse needs only the second pass, on bf16_tiles.h's S tiles (AVX512-BF16 dot
 * products, no AMX tiles, or fp32 FMAs on AVX2). */
#include <stdlib.h>

#include "bf16_tiles.h"

#if defined(__AMX_BF16__)
#define PANEL 1024      /* query rows per panel: their bf16 rows stay in L2 */
#define OVERFLOW 80.f   /* the centre's move when a sum overflowed: exp(80) is finite */
#define LARGE 1e30f     /* a row sum above this is summed again, centred higher */

/* e^x (0 far below, through cpu.h's exp2_ps) */
static inline __m512 exp16(__m512 x) {
    return exp2_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)));
}

struct chunk {
    const uint16_t *q, *k;
    int64_t k_stride;  /* elements between tokens' keys */
    int h_q, h_kv, group, d, kb, n, start;
    float scale;
};

/* Keys [0, visible) of head h as B tiles: per block of 16 keys and 32 channels, [16 channel
 * pairs][16 keys][2], zero past the keys and channels. */
static void key_tiles(const struct chunk *c, int h, int visible, uint16_t *tiles) {
    for (int b = 0; b < (visible + 15) / 16; b++)
        for (int j = 0; j < c->kb; j++) {
            uint16_t *tile = tiles + ((int64_t)b * c->kb + j) * 512;
            memset(tile, 0, 1024);
            for (int key = 0; key < 16 && 16 * b + key < visible; key++) {
                const uint16_t *row = c->k + (int64_t)(16 * b + key) * c->k_stride + h * c->d;
                for (int x = 32 * j; x < 32 * j + 32 && x < c->d; x++)
                    tile[(x - 32 * j) / 2 * 32 + 2 * key + x % 2] = row[x];
            }
        }
}

static float dot(const uint16_t *a, const uint16_t *b, int d) {
    float a32[MAX_HEAD_DIM], b32[MAX_HEAD_DIM], sum = 0.f;
    to_f32(a, BF16, d, a32);
    to_f32(b, BF16, d, b32);
    for (int x = 0; x < d; x++) sum += a32[x] * b32[x];
    return sum;
}

/* One tile of 16 rows x 16 keys into out (fp32, unscaled): the rows' A tiles (row stride
 * kb * 64 bytes) against the key block's B tiles, already in tiles 4 + j. */
static inline void logit_tile(const uint16_t *rows, int kb, float *out) {
    _tile_zero(2);
    _tile_loadd(0, rows, kb * 64);
    _tile_dpbf16ps(2, 0, 4);
    if (kb > 1) {
        _tile_loadd(1, rows + 32, kb * 64);
        _tile_dpbf16ps(2, 1, 5);
    }
    if (kb > 2) {
        _tile_loadd(0, rows + 64, kb * 64);
        _tile_dpbf16ps(2, 0, 6);
    }
    if (kb > 3) {
        _tile_loadd(1, rows + 96, kb * 64);
        _tile_dpbf16ps(2, 1, 7);
    }
    _tile_stored(2, out, 64);
}

static inline void load_key_tiles(const uint16_t *tiles, int kb) {
    _tile_loadd(4, tiles, 64);
    if (kb > 1) _tile_loadd(5, tiles + 512, 64);
    if (kb > 2) _tile_loadd(6, tiles + 1024, 64);
    if (kb > 3) _tile_loadd(7, tiles + 1536, 64);
}

/* The panel's rows [0, rows): (token, group member) pairs from panel row p0, as A rows. */
struct panel {
    uint16_t *a;       /* [rows padded to 16][kb * 32] bf16, zero padded */
    int *position;     /* each row's position: it sees keys [0, position] */
    float *centre;     /* m: scaled logits are summed as exp(logit - m) */
    float *sums;       /* [rows][16] lane-wise sums of pass 1 */
    int rows;
};

/* Pass 1 (lse NULL): each row's lane-wise sums of exp(scaled logit - centre). Pass 2:
 * total[keys] += exp(scaled logit - lse), summed over the rows. */
static void sweep(const struct chunk *c, const struct panel *p, const uint16_t *tiles,
                  const float *lse, float *total, int length) {
    float tile[256];
    const int last = p->position[p->rows - 1];  /* rows are in position order */
    for (int b = 0; 16 * b <= last; b++) {
        load_key_tiles(tiles + (int64_t)b * c->kb * 512, c->kb);
        __m512 column = _mm512_setzero_ps();
        for (int r0 = 0; r0 < p->rows; r0 += 16) {
            const int rows = p->rows - r0 < 16 ? p->rows - r0 : 16;
            if (p->position[r0 + rows - 1] < 16 * b) continue;  /* sees none of these keys */
            logit_tile(p->a + (int64_t)r0 * c->kb * 32, c->kb, tile);
            for (int i = 0; i < rows; i++) {
                const int r = r0 + i, seen = p->position[r] - 16 * b + 1;
                if (seen <= 0) continue;
                const __mmask16 visible = seen >= 16 ? 0xFFFF : (__mmask16)((1u << seen) - 1);
                const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(tile + 16 * i),
                                               _mm512_set1_ps(c->scale));
                if (!lse) {
                    const __m512 e = _mm512_maskz_mov_ps(
                        visible, exp16(_mm512_sub_ps(x, _mm512_set1_ps(p->centre[r]))));
                    _mm512_storeu_ps(p->sums + 16 * r,
                                     _mm512_add_ps(_mm512_loadu_ps(p->sums + 16 * r), e));
                } else {
                    column = _mm512_add_ps(column, _mm512_maskz_mov_ps(
                        visible, exp16(_mm512_sub_ps(x, _mm512_set1_ps(lse[r])))));
                }
            }
        }
        if (lse) {
            const int keys = length - 16 * b;
            const __mmask16 in = keys >= 16 ? 0xFFFF : (__mmask16)((1u << keys) - 1);
            _mm512_mask_storeu_ps(total + 16 * b, in,
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(in, total + 16 * b),
                                                column));
        }
    }
}

/* Fills the panel with the head's rows [p0, p0 + rows) (row t * group + g: token t, query head
 * h * group + g) and their centres. */
static void fill_panel(const struct chunk *c, int h, int p0, struct panel *p) {
    memset(p->a, 0, (size_t)(p->rows + 15) / 16 * 16 * c->kb * 64);
    for (int i = 0; i < p->rows; i++) {
        const int t = (p0 + i) / c->group, head = h * c->group + (p0 + i) % c->group;
        const uint16_t *q = c->q + ((int64_t)t * c->h_q + head) * c->d;
        memcpy(p->a + (int64_t)i * c->kb * 32, q, (size_t)c->d * 2);
        p->position[i] = c->start + t;
        const uint16_t *own = c->k + (int64_t)p->position[i] * c->k_stride + h * c->d;
        const uint16_t *first = c->k + h * c->d;
        const float a = dot(q, own, c->d), b = dot(q, first, c->d);
        p->centre[i] = (a > b ? a : b) * c->scale;
    }
}
#endif

/* q: [n, h_q, d] bf16 contiguous, at positions [length - n, length); k: [length, h_kv, d] bf16,
 * tokens k_stride elements apart, each token's heads contiguous; total: fp32 [h_kv, length],
 * zeroed by the caller. Returns 0; 1 without AMX or for d > 128, 2 if a scratch allocation
 * failed. */
int column_sums(const void *q, const void *k, int64_t k_stride, int n, int h_q, int h_kv,
                int d, int length, float scale, float *total) {
#if defined(__AMX_BF16__)
    if (d > 128 || !amx_usable()) return 1;
    const int kb = (d + 31) / 32, group = h_q / h_kv;
    const struct chunk c = {q, k, k_stride, h_q, h_kv, group, d, kb, n, length - n, scale};
    const int blocks = (length + 15) / 16;
    uint16_t *tiles = malloc((size_t)blocks * kb * 1024);
    struct panel p = {malloc((size_t)PANEL * kb * 64), malloc(sizeof(int) * PANEL),
                      malloc(sizeof(float) * PANEL), malloc(sizeof(float) * PANEL * 16), 0};
    float *lse = malloc(sizeof(float) * PANEL);
    int status = tiles && p.a && p.position && p.centre && p.sums && lse ? 0 : 2;
    if (!status) amx_configure();
    for (int h = 0; h < h_kv && !status; h++) {
        key_tiles(&c, h, length, tiles);
        for (int p0 = 0; p0 < n * group; p0 += PANEL) {
            p.rows = n * group - p0 < PANEL ? n * group - p0 : PANEL;
            fill_panel(&c, h, p0, &p);
            for (int again = 1; again;) {
                for (int i = 0; i < 16 * p.rows; i++) p.sums[i] = 0.f;
                sweep(&c, &p, tiles, NULL, NULL, length);
                again = 0;
                for (int i = 0; i < p.rows; i++) {
                    const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(p.sums + 16 * i));
                    if (sum > LARGE) {  /* a logit far above the centre: move the centre up */
                        p.centre[i] += sum > 3e38f ? OVERFLOW : logf(sum);
                        again = 1;
                    }
                    lse[i] = p.centre[i] + logf(sum);
                }
            }
            sweep(&c, &p, tiles, lse, total + (int64_t)h * length, length);
        }
    }
    if (!status) _tile_release();
    free(tiles), free(p.a), free(p.position), free(p.centre), free(p.sums);
    free(lse);
    return status;
#else
    (void)q, (void)k, (void)k_stride, (void)n, (void)h_q, (void)h_kv, (void)d, (void)length;
    (void)scale, (void)total;
    return 1;
#endif
}

/* The chunk's column sums given each query row's LSE, one pass: total[h][j] = the sum over the
 * group's query rows r (token t at position length - n + t, seeing keys j <= it) of
 * exp(q_r . k_j scale - lse_r). q: [n, h_q, d] (token stride q_stride, heads d apart); k:
 * [length, h_kv, d] (token stride k_stride); lse: [h_q, n] natural log; total: [h_kv, length]
 * fp32, written; q and k of dtype. Returns 0; 1 where this build lacks the kernel or takes no
 * dtype inputs (prefill_attention_dtypes) or d is not a multiple of 16 up to MAX_HEAD_DIM; 2 if
 * a scratch allocation failed. */
int column_sums_lse(const void *q, int64_t q_stride, const void *k, int64_t k_stride, int dtype,
                    int n, int length, int h_q, int h_kv, int d, float scale, const float *lse,
                    float *total) {
#if defined(PREFILL_TILES)
    if (!(OPERAND_DTYPES >> dtype & 1) || d % 16 || d > MAX_HEAD_DIM || h_q % h_kv || length < n)
        return 1;
    const int g = h_q / h_kv, offset = length - n, rows = n * g;
    const int rows_pad = (rows + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
    const int key_blocks = (length + KEYS - 1) / KEYS;
    const float c = scale * 1.44269504f; /* logits and LSE in log2 units */
    operand *qp = aligned_alloc(64, sizeof(operand) * rows_pad * d);
    float *lse2 = malloc(sizeof(float) * rows_pad);
    int status = !(qp && lse2);
    for (int h = 0; h < h_kv && !status; h++) {
        /* the head's rows, r = t g + j (query head h g + j), as prefill_attention orders them */
        for (int r = 0; r < rows_pad; r++) {
            operand *row = qp + (int64_t)r * d;
            if (r < rows)
                load_operands(
                    row, element_at(q, (int64_t)(r / g) * q_stride + (h * g + r % g) * d, dtype),
                    dtype, d);
            else
                memset(row, 0, sizeof(operand) * d);
            lse2[r] = r < rows ? lse[(int64_t)(h * g + r % g) * n + r / g] * 1.44269504f : 0.f;
        }
#pragma omp parallel reduction(| : status) if (key_blocks > 1)
        {
            packed *kp = aligned_alloc(64, sizeof(packed) * KEYS * d / PACK);
            float *sb = aligned_alloc(64, sizeof(float) * ROW_TILE * KEYS);
            status = !(kp && sb);
#pragma omp for schedule(dynamic)
            for (int kb = 0; kb < key_blocks; kb++) {
                if (status) continue;
                const int key0 = kb * KEYS, keys = length - key0 < KEYS ? length - key0 : KEYS;
                pack_keys(element_at(k, (int64_t)h * d, dtype), dtype, k_stride, length, d, key0,
                          kp);
                lanes column[KEYS / LANES];
                for (int v = 0; v < KEYS / LANES; v++) column[v] = lanes_zero();
                /* the first row that sees a key of the block: token key0 - offset */
                const int first = key0 > offset ? (key0 - offset) * g / ROW_TILE * ROW_TILE : 0;
                for (int r0 = first; r0 < rows; r0 += ROW_TILE) {
                    block_scores(qp + (int64_t)r0 * d, d, ROW_TILE, kp, keys, sb);
                    for (int r = r0; r < r0 + ROW_TILE && r < rows; r++) {
                        int seen = offset + r / g + 1 - key0; /* keys of the block it sees */
                        seen = seen < keys ? seen : keys;
                        const float *sr = sb + (r - r0) * KEYS;
                        for (int v = 0; v < KEYS / LANES && LANES * v < seen; v++) {
                            const lanes t = lanes_fmsub(lanes_load(sr + LANES * v), lanes_set1(c),
                                                        lanes_set1(lse2[r]));
                            const lanes e = lanes_exp2(t);
                            column[v] = lanes_add(column[v],
                                                  lanes_keep(first_lanes(seen - LANES * v), e));
                        }
                    }
                }
                float *out = total + (int64_t)h * length + key0;
                for (int v = 0; v < KEYS / LANES && LANES * v < keys; v++)
                    store_first_lanes(out + LANES * v, keys - LANES * v, column[v]);
            }
            free(kp), free(sb);
        }
    }
    free(qp), free(lse2);
    return status ? 2 : 0;
#else
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)dtype, (void)n, (void)length,
        (void)h_q, (void)h_kv, (void)d, (void)scale, (void)lse, (void)total;
    return 1;
#endif
}
