/* TailorKV's token selection in an offloaded layer for a ragged batch, one call per layer and
 * step (native.py; the torch reference is critical_channels.select_tokens over
 * critical_channels.channel_scores_paged).
 *
 * For request b and KV head h: the signed sum of the group's query heads on each critical
 * channel; each prompt token's partial score over those channels, read where the host store
 * keeps the channel-major key copy (rows of `chunk` tokens of one channel); then the top
 * min(k, candidates) of the prompt's middle [sink, prompt_len - recent) by radix select (a
 * set: in no particular order), -1 after. */
#include <stdlib.h>

#include "cpu.h"

static inline float element(const void *base, int dtype, int64_t i) {
    float x;
    to_f32((const char *)base + i * (int64_t)element_size(dtype), dtype, 1, &x);
    return x;
}

/* acc[0, n) += a * src[0, n), src of dtype. */
static inline void add_scaled(float *acc, float a, const void *src, int dtype, int n) {
    if (dtype == BF16) {
        const uint16_t *s = src;
        for (int i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)s[i] << 16;
            float x;
            memcpy(&x, &bits, 4);
            acc[i] += a * x;
        }
    } else if (dtype == F16) {
        const _Float16 *s = src;
        for (int i = 0; i < n; i++) acc[i] += a * (float)s[i];
    } else {
        const float *s = src;
        for (int i = 0; i < n; i++) acc[i] += a * s[i];
    }
}

/* q: [B, h_q, d] of q_dtype, contiguous; channels: int32 [B, h_kv, d_s].
 * pool: the store's memory (dtype); request b's rows start at page page_start[b], whose first
 * element is pool + page_offset[page] (elements, possibly negative); a row holds `chunk`
 * tokens, page_rows rows per page, row (h * d + c) * ceil(prompt_len / chunk) + j. out: int32
 * [B, h_kv, k]. Returns 0; 1 if a scratch allocation failed. */
int channel_top_k(const void *q, int q_dtype, const int32_t *channels, int d_s,
                  const void *pool, int dtype, const int64_t *page_offset,
                  const int32_t *page_start, const int32_t *prompt_len, int batch, int h_q,
                  int h_kv, int d, int sink, int recent, int chunk, int64_t page_rows, int k,
                  int32_t *out) {
    int max_len = 0;
    for (int b = 0; b < batch; b++) max_len = prompt_len[b] > max_len ? prompt_len[b] : max_len;
    const size_t len = max_len ? max_len : 1;
    float *scores = malloc(sizeof(float) * len);
    uint32_t *keys = malloc(sizeof(uint32_t) * len);
    int32_t *cand = malloc(sizeof(int32_t) * len);
    const int status = !(scores && keys && cand);
    const int group = h_q / h_kv;
    const size_t elem = element_size(dtype);
    for (int b = 0; b < batch && !status; b++)
        for (int h = 0; h < h_kv; h++) {
            const int n = prompt_len[b], lo = sink, hi = n - recent;
            const int take = hi - lo < k ? (hi > lo ? hi - lo : 0) : k;
            int32_t *ids = out + ((int64_t)b * h_kv + h) * k;
            for (int i = take; i < k; i++) ids[i] = -1;
            if (take == 0) continue;
            const int64_t rows_per_channel = (n + chunk - 1) / chunk;
            const int32_t *ch = channels + ((int64_t)b * h_kv + h) * d_s;
            for (int i = lo; i < hi; i++) scores[i] = 0.f;
            for (int c = 0; c < d_s; c++) {
                float qc = 0.f;  /* the group's query heads, summed in order */
                for (int j = 0; j < group; j++)
                    qc += element(q, q_dtype, ((int64_t)b * h_q + h * group + j) * d + ch[c]);
                const int64_t row0 = ((int64_t)h * d + ch[c]) * rows_per_channel;
                for (int64_t j = lo / chunk; j * chunk < hi; j++) {
                    const int64_t row = row0 + j, t0 = j * chunk;
                    const int64_t first = t0 > lo ? t0 : lo;
                    const int64_t last = t0 + chunk < hi ? t0 + chunk : hi;
                    const char *src = (const char *)pool +
                        (page_offset[page_start[b] + row / page_rows] +
                         row % page_rows * chunk + (first - t0)) * (int64_t)elem;
                    add_scaled(scores + first, qc, src, dtype, (int)(last - first));
                }
            }
            top_set(scores + lo, hi - lo, take, keys, cand, ids);
            for (int i = 0; i < take; i++) ids[i] += lo;
        }
    free(scores), free(keys), free(cand);
    return status;
}
