/* Attention over KIVI-quantized token groups (MiniKV, TailorKV's quantized layers, SpeCache's
 * low-bit pass) for a ragged batch, one call per layer (native.py; the torch reference is
 * quant_attention.quant_attention).
 *
 * Row b of the group table owns its first count[b] pool groups; each KV head's query heads
 * and the step's tokens are the query rows of that head, so each group is unpacked once for
 * all of them. Per group: the keys are scored, folded into an online softmax, then the values
 * added: with AVX-512 each 16 channels of a key or value (with AVX2, 8) are unpacked and
 * dequantized in a register (a broadcast word, a shift per lane) and used by four query rows at
 * once (AVX2 scores a key's codes against the query rows times the key scales, and adds the rows'
 * dot with the zeros); otherwise through a G x d fp32 tile. The dequantized cache never exists
 * beyond one group, and there is no score matrix. Sums and dequantization in fp32, as the
 * reference. */
#include <stdlib.h>

#include "cpu.h"

#define NONE (-1e30f) /* a finite "no score": -ffast-math assumes no infinities */

#if defined(__AVX512F__)
#define LANES 16
#define lane_codes codes16 /* a token's codes of LANES channels as fp32 (below) */
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define lane_codes codes8
#endif
#include "lanes.h"

/* A pool field: base, and the byte strides between pool entries and between KV heads. */
struct field { const char *base; int64_t entry, head; };

static inline const char *at(const struct field *f, int64_t entry, int head) {
    return f->base + entry * f->entry + head * f->head;
}

struct format {
    int bits, group, d, value_group, words, param_dtype;
#if defined(LANES)
    int vectors; /* d / LANES where the vector path runs (d % LANES == 0), else 0 */
#endif
#if defined(__AVX512F__)
    /* per 16 channels v: the first word, each lane's word after it and its shift */
    int first_word[MAX_HEAD_DIM / 16];
    __m512i lane_word[MAX_HEAD_DIM / 16], lane_shift[MAX_HEAD_DIM / 16];
#elif defined(__AVX2__) && defined(__FMA__)
    /* per 8 channels v: their word (8 codes of at most 4 bits fit one) and each lane's shift */
    int first_word[MAX_HEAD_DIM / 8];
    __m256i lane_shift[MAX_HEAD_DIM / 8];
#endif
};

static void set_up(struct format *f) {
#if defined(LANES)
    const int per_word = 32 / f->bits;
    f->vectors = f->d % LANES == 0 ? f->d / LANES : 0;
#endif
#if defined(__AVX512F__)
    for (int v = 0; v < f->vectors; v++) {
        int32_t word[16], shift[16];
        f->first_word[v] = 16 * v / per_word;
        for (int i = 0; i < 16; i++) {
            const int c = 16 * v + i;
            word[i] = c / per_word - f->first_word[v];
            shift[i] = c % per_word * f->bits;
        }
        f->lane_word[v] = _mm512_loadu_si512(word);
        f->lane_shift[v] = _mm512_loadu_si512(shift);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (int v = 0; v < f->vectors; v++) {
        int32_t shift[8];
        f->first_word[v] = 8 * v / per_word;
        for (int i = 0; i < 8; i++) shift[i] = (8 * v + i) % per_word * f->bits;
        f->lane_shift[v] = _mm256_loadu_si256((const __m256i *)shift);
    }
#endif
}

/* qs = each query row times the group's key scales, qz = each row . its key zeros: then
 * q . key = qs . codes + qz, and a key is never dequantized. */
static inline void scale_queries(const float *qf, int rows, int d, const float *k_scale,
                                 const float *k_zero, float *qs, float *qz) {
    for (int r = 0; r < rows; r++) {
        float dot = 0.f;
        for (int c = 0; c < d; c++) {
            qs[r * d + c] = qf[r * d + c] * k_scale[c];
            dot += qf[r * d + c] * k_zero[c];
        }
        qz[r] = dot;
    }
}

#if defined(__AVX512F__)
/* Channels [16 v, 16 v + 16) of a token's codes as fp32: one word broadcast at 1 and 2 bits,
 * two words permuted into the lanes at 4. */
static inline __m512 codes16(const struct format *f, const int32_t *words, int v) {
    const __m512i spread =
        f->bits == 4
            ? _mm512_permutexvar_epi32(f->lane_word[v],
                                       _mm512_maskz_loadu_epi32(0x3, words + f->first_word[v]))
            : _mm512_set1_epi32(words[f->first_word[v]]);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(spread, f->lane_shift[v]),
                                           _mm512_set1_epi32((1 << f->bits) - 1));
    return _mm512_cvtepi32_ps(codes);
}

/* p[r * n + i] = scale * (query row r . key i) for the group's n keys, each dequantized in
 * registers (d <= 256) and used by the rows four at a time; qf and p hold nq rounded up to 4
 * rows. */
static void group_scores(const struct format *f, const int32_t *codes, const float *k_scale,
                         const float *k_zero, const float *qf, int nq, float scale, float *p) {
    const int nv = f->vectors, d = f->d, n = f->group;
    for (int i = 0; i < n; i++) {
        const int32_t *words = codes + (int64_t)i * f->words;
        __m512 k[16];
        for (int v = 0; v < nv; v++)
            k[v] = _mm512_fmadd_ps(codes16(f, words, v), _mm512_loadu_ps(k_scale + 16 * v),
                                   _mm512_loadu_ps(k_zero + 16 * v));
        for (int r = 0; r < nq; r += 4) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int v = 0; v < nv; v++) {
                a0 = _mm512_fmadd_ps(k[v], _mm512_loadu_ps(qf + r * d + 16 * v), a0);
                a1 = _mm512_fmadd_ps(k[v], _mm512_loadu_ps(qf + (r + 1) * d + 16 * v), a1);
                a2 = _mm512_fmadd_ps(k[v], _mm512_loadu_ps(qf + (r + 2) * d + 16 * v), a2);
                a3 = _mm512_fmadd_ps(k[v], _mm512_loadu_ps(qf + (r + 3) * d + 16 * v), a3);
            }
            float four[4];
            _mm_storeu_ps(four, sum4(a0, a1, a2, a3));
            for (int u = 0; u < 4; u++) p[(r + u) * n + i] = four[u] * scale;
        }
    }
}

/* The same at 1 bit, with no unpacking. A key channel is its zero, or zero + scale where its
 * bit is set, so q . k = q . zero + the sum of q * scale over the set bits: each 16 channels'
 * bits mask the additions of the row's scaled query (qs, rows x d) to the row's q . zero (qz). */
static void group_scores_1bit(const struct format *f, const int32_t *codes, const float *qs,
                              const float *qz, int nq, float scale, float *p) {
    const int nv = f->vectors, d = f->d, n = f->group;
    for (int i = 0; i < n; i++) {
        const int32_t *words = codes + (int64_t)i * f->words;
        for (int r = 0; r < nq; r += 4) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int v = 0; v < nv; v++) {  /* channels [16 v, 16 v + 16): half a word */
                const __mmask16 m = (__mmask16)((uint32_t)words[v / 2] >> (16 * (v % 2)));
                a0 = _mm512_mask_add_ps(a0, m, a0, _mm512_loadu_ps(qs + r * d + 16 * v));
                a1 = _mm512_mask_add_ps(a1, m, a1, _mm512_loadu_ps(qs + (r + 1) * d + 16 * v));
                a2 = _mm512_mask_add_ps(a2, m, a2, _mm512_loadu_ps(qs + (r + 2) * d + 16 * v));
                a3 = _mm512_mask_add_ps(a3, m, a3, _mm512_loadu_ps(qs + (r + 3) * d + 16 * v));
            }
            float four[4];
            _mm_storeu_ps(four, sum4(a0, a1, a2, a3));
            for (int u = 0; u < 4; u++) p[(r + u) * n + i] = (four[u] + qz[r + u]) * scale;
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
/* Channels [8 v, 8 v + 8) of a token's codes as fp32: one word broadcast, a shift per lane. */
static inline __m256 codes8(const struct format *f, const int32_t *words, int v) {
    const __m256i spread = _mm256_srlv_epi32(_mm256_set1_epi32(words[f->first_word[v]]),
                                             f->lane_shift[v]);
    return _mm256_cvtepi32_ps(_mm256_and_si256(spread, _mm256_set1_epi32((1 << f->bits) - 1)));
}

/* p[r * n + i] = scale * (query row r . key i) = scale * (qs_r . codes_i + qz_r) for the
 * group's n keys, four rows at a time (qs, qz: scale_queries; rows rounded up to 4). */
static void group_scores8(const struct format *f, const int32_t *codes, const float *qs,
                          const float *qz, int nq, float scale, float *p) {
    const int nv = f->vectors, d = f->d, n = f->group;
    for (int i = 0; i < n; i++) {
        const int32_t *words = codes + (int64_t)i * f->words;
        for (int r = 0; r < nq; r += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int v = 0; v < nv; v++) {
                const __m256 k = codes8(f, words, v);
                a0 = _mm256_fmadd_ps(k, _mm256_loadu_ps(qs + r * d + 8 * v), a0);
                a1 = _mm256_fmadd_ps(k, _mm256_loadu_ps(qs + (r + 1) * d + 8 * v), a1);
                a2 = _mm256_fmadd_ps(k, _mm256_loadu_ps(qs + (r + 2) * d + 8 * v), a2);
                a3 = _mm256_fmadd_ps(k, _mm256_loadu_ps(qs + (r + 3) * d + 8 * v), a3);
            }
            float four[4];
            _mm_storeu_ps(four, sum4_ps8(a0, a1, a2, a3));
            for (int u = 0; u < 4; u++) p[(r + u) * n + i] = (four[u] + qz[r + u]) * scale;
        }
    }
}

#endif

#if defined(LANES)

/* acc[r] += sum_i p[r * n + i] * value i, each LANES channels of a value dequantized in a
 * register once per four rows (value_group a multiple of LANES: one scale per vector). */
static void group_add_values(const struct format *f, const int32_t *codes, const float *v_scale,
                             const float *v_zero, const float *p, int nq, float *acc) {
    const int d = f->d, n = f->group, per_token = d / f->value_group;
    for (int v = 0; v < f->vectors; v++) {
        const int at = LANES * v / f->value_group;
        for (int r = 0; r < nq; r += 4) {
            float *out = acc + r * d + LANES * v;
            lanes a0 = lanes_load(out), a1 = lanes_load(out + d),
                   a2 = lanes_load(out + 2 * d), a3 = lanes_load(out + 3 * d);
            for (int i = 0; i < n; i++) {
                const lanes x = lanes_fmadd(
                    lane_codes(f, codes + (int64_t)i * f->words, v),
                    lanes_set1(v_scale[i * per_token + at]),
                    lanes_set1(v_zero[i * per_token + at]));
                a0 = lanes_fmadd(lanes_set1(p[r * n + i]), x, a0);
                a1 = lanes_fmadd(lanes_set1(p[(r + 1) * n + i]), x, a1);
                a2 = lanes_fmadd(lanes_set1(p[(r + 2) * n + i]), x, a2);
                a3 = lanes_fmadd(lanes_set1(p[(r + 3) * n + i]), x, a3);
            }
            lanes_store(out, a0), lanes_store(out + d, a1);
            lanes_store(out + 2 * d, a2), lanes_store(out + 3 * d, a3);
        }
    }
}
#endif

/* out[c] = code of channel c, for the n words of one token (codes packed along channels,
 * code i of a word at bits [i * bits, (i + 1) * bits)). */
static void unpack(const int32_t *words, int n, float *out, int bits) {
    const int per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    for (int w = 0; w < n; w++)
        for (int i = 0; i < per_word; i++)
            out[w * per_word + i] = (float)(((uint32_t)words[w] >> (i * bits)) & mask);
}

/* Brings a group's six fields towards the cache while the one before is computed. */
static void prefetch_group(const struct format *f, const struct field *fields, int64_t entry,
                           int head) {
    const int64_t ps = element_size(f->param_dtype), codes = (int64_t)f->group * f->words * 4;
    const int64_t sizes[6] = {codes, f->d * ps, f->d * ps, codes,
                              f->group * (f->d / f->value_group) * ps,
                              f->group * (f->d / f->value_group) * ps};
    for (int i = 0; i < 6; i++)
        for (int64_t line = 0; line < sizes[i]; line += 64)
            __builtin_prefetch(at(&fields[i], entry, head) + line);
}

/* The keys of one group as fp32 [group][d]: per channel scale and zero. */
static void group_keys(const struct format *f, const int32_t *codes, const float *scale,
                       const float *zero, float *keys) {
    for (int t = 0; t < f->group; t++) {
        float *row = keys + (int64_t)t * f->d;
        unpack(codes + (int64_t)t * f->words, f->words, row, f->bits);
        for (int c = 0; c < f->d; c++) row[c] = row[c] * scale[c] + zero[c];
    }
}

/* The values of one group as fp32 [group][d]: per token, a scale and zero per value_group
 * channels. */
static void group_values(const struct format *f, const int32_t *codes, const float *scale,
                         const float *zero, float *values) {
    const int per_token = f->d / f->value_group;
    for (int t = 0; t < f->group; t++) {
        float *row = values + (int64_t)t * f->d;
        const float *s = scale + t * per_token, *z = zero + t * per_token;
        unpack(codes + (int64_t)t * f->words, f->words, row, f->bits);
        for (int c = 0; c < f->d; c++)
            row[c] = row[c] * s[c / f->value_group] + z[c / f->value_group];
    }
}

/* p[r * n + i] = scale * (query row r . key i), for nq rows over n keys of d fp32. */
static void scores(const float *qf, int nq, const float *keys, int n, int d, float scale,
                   float *p) {
    for (int r = 0; r < nq; r++)
        for (int i = 0; i < n; i++) {
            float dot = 0.f;
            for (int x = 0; x < d; x++) dot += qf[r * d + x] * keys[i * d + x];
            p[r * n + i] = dot * scale;
        }
}

/* q: [B, s_q, h_q, d] contiguous. fields: key codes, key scale, key zero, value codes, value
 * scale, value zero, each [n_pool, h_kv, ...] with unit strides inside an entry's head;
 * strides: their (entry, head) byte strides. table: int32 [B, table_stride], count: int32 [B].
 * With logits (fp32 [B, h_q, logits_width], filled with -inf by the caller) query token
 * logits_row's scaled logits are written there, token t of table entry j at j * group + t.
 * out: [B, s_q, h_q, d] of out_dtype; lse: fp32 [B, s_q, h_q] (-inf without groups); with
 * out NULL only the logits are computed (neither softmax nor values).
 * Returns 0; 1 if d or h_q * s_q is over its maximum or a scratch allocation failed; 2 if a
 * table entry is outside the pool's n_pool groups, or a request's groups overflow a logits row
 * (checked before anything is read or written). */
int quant_attention(const void *q, int q_dtype, int batch, int s_q, int h_q, int d,
                    const void *const *bases, const int64_t *strides, int64_t n_pool,
                    int param_dtype, int h_kv,
                    int bits, int group, int value_group, const int32_t *table,
                    int64_t table_stride, const int32_t *count, float scale, int logits_row,
                    float *logits, int64_t logits_width, void *out, int out_dtype,
                    float *lse) {
    const int g = h_q / h_kv, nq = s_q * g;
    if (d > MAX_HEAD_DIM || nq > MAX_QUERY_ROWS) return 1;
    for (int b = 0; b < batch; b++) {
        if (logits && (int64_t)count[b] * group > logits_width) return 2;
        for (int e = 0; e < count[b]; e++)
            if (table[b * table_stride + e] < 0 || table[b * table_stride + e] >= n_pool) return 2;
    }
    struct format f = {.bits = bits, .group = group, .d = d, .value_group = value_group,
                       .words = d / (32 / bits), .param_dtype = param_dtype};
    set_up(&f);
    struct field fields[6];
    for (int i = 0; i < 6; i++)
        fields[i] = (struct field){bases[i], strides[2 * i], strides[2 * i + 1]};
    const size_t q_bytes = element_size(q_dtype), o_bytes = element_size(out_dtype);
    int vector_keys = 0, vector_values = 0;
#if defined(LANES)
    vector_values = f.vectors && value_group % LANES == 0;
#endif
#if defined(__AVX512F__)
    vector_keys = f.vectors && d <= 256;  /* a key's vectors fit in registers */
#elif defined(__AVX2__) && defined(__FMA__)
    vector_keys = f.vectors != 0;
#endif
    /* rows padded to a multiple of 4 (zero queries and weights) for the vector paths */
    const int rows = (nq + 3) / 4 * 4, per_token = d / value_group;
    int status = 0;
    /* (request, KV head) pairs across the threads, each with its own scratch */
#pragma omp parallel reduction(| : status) if (batch * h_kv > 1)
    {
        float *qf = calloc((size_t)rows * d, sizeof(float)),
              *acc = malloc(sizeof(float) * rows * d), *kv = malloc(sizeof(float) * group * d),
              *p = calloc((size_t)rows * group, sizeof(float)),
              *params = malloc(sizeof(float) * 2 * (d + group * per_token)),
              *m = malloc(sizeof(float) * nq), *l_sum = malloc(sizeof(float) * nq),
              *qs = malloc(sizeof(float) * rows * (d + 1)), *qz = qs + (int64_t)rows * d;
        status = !(qf && acc && kv && p && params && m && l_sum && qs);
        float *k_scale = params, *k_zero = k_scale + d, *v_scale = k_zero + d,
              *v_zero = v_scale + group * per_token;
#pragma omp for schedule(dynamic)
        for (int64_t bh = 0; bh < (int64_t)batch * h_kv; bh++) {
            if (status) continue;
            const int b = (int)(bh / h_kv), h = (int)(bh % h_kv);
            /* query row t * g + j: token t, group member j (query head h * g + j) */
            for (int t = 0; t < s_q; t++)
                for (int j = 0; j < g; j++) {
                    const int64_t row = ((int64_t)b * s_q + t) * h_q + h * g + j;
                    to_f32((const char *)q + row * d * q_bytes, q_dtype, d,
                           qf + (t * g + j) * d);
                }
            for (int r = 0; r < nq; r++) m[r] = NONE, l_sum[r] = 0.f;
            for (int64_t x = 0; x < (int64_t)rows * d; x++) acc[x] = 0.f;
            for (int e = 0; e < count[b]; e++) {
                const int64_t entry = table[b * table_stride + e];
                if (e + 1 < count[b])
                    prefetch_group(&f, fields, table[b * table_stride + e + 1], h);
                const int32_t *k_codes = (const int32_t *)at(&fields[0], entry, h),
                              *v_codes = (const int32_t *)at(&fields[3], entry, h);
                to_f32(at(&fields[1], entry, h), param_dtype, d, k_scale);
                to_f32(at(&fields[2], entry, h), param_dtype, d, k_zero);
#if defined(__AVX512F__)
                if (vector_keys && bits == 1) {
                    scale_queries(qf, rows, d, k_scale, k_zero, qs, qz);
                    group_scores_1bit(&f, k_codes, qs, qz, rows, scale, p);
                } else if (vector_keys)
                    group_scores(&f, k_codes, k_scale, k_zero, qf, rows, scale, p);
#elif defined(__AVX2__) && defined(__FMA__)
                if (vector_keys) {
                    scale_queries(qf, rows, d, k_scale, k_zero, qs, qz);
                    group_scores8(&f, k_codes, qs, qz, rows, scale, p);
                }
#endif
                if (!vector_keys) {
                    group_keys(&f, k_codes, k_scale, k_zero, kv);
                    scores(qf, nq, kv, group, d, scale, p);
                }
                if (logits)
                    for (int j = 0; j < g; j++)
                        memcpy(logits + ((int64_t)b * h_q + h * g + j) * logits_width +
                                   (int64_t)e * group,
                               p + (logits_row * g + j) * group, sizeof(float) * group);
                if (!out) continue;  /* the logits alone */
                for (int r = 0; r < nq; r++) {
                    float top = NONE;
                    for (int i = 0; i < group; i++)
                        top = p[r * group + i] > top ? p[r * group + i] : top;
                    softmax_update(p + r * group, group, top, m + r, l_sum + r, acc + r * d, d);
                }
                for (int i = nq * group; i < rows * group; i++) p[i] = 0.f;  /* padding */
                to_f32(at(&fields[4], entry, h), param_dtype, group * per_token, v_scale);
                to_f32(at(&fields[5], entry, h), param_dtype, group * per_token, v_zero);
#if defined(LANES)
                if (vector_values)
                    group_add_values(&f, v_codes, v_scale, v_zero, p, rows, acc);
#endif
                if (!vector_values) {
                    group_values(&f, v_codes, v_scale, v_zero, kv);
                    add_values(acc, p, kv, group, nq, d);
                }
            }
            for (int r = 0; r < nq && out; r++) {
                const int64_t row = ((int64_t)b * s_q + r / g) * h_q + h * g + r % g;
                const float inv = l_sum[r] > 0.f ? 1.f / l_sum[r] : 0.f;
                for (int x = 0; x < d; x++) acc[r * d + x] *= inv;
                from_f32(acc + r * d, d, out_dtype, (char *)out + row * d * o_bytes);
                lse[row] = l_sum[r] > 0.f ? m[r] + logf(l_sum[r]) : -INFINITY;
            }
        }
        free(qf), free(acc), free(kv), free(p), free(params), free(m), free(l_sum), free(qs);
    }
    return status;
}
