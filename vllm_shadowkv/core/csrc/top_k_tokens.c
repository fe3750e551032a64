/* SpeCache's top-k for a ragged batch, one call per layer (native.py; the torch reference is
 * mixed_attention.top_k_tokens): per KV head, the k quantized tokens its query heads attend
 * most, by the probabilities of their whole attention rows summed over the group.
 *
 * Per query head: the row's LSE over its logits, merged with the LSE of the row's other keys;
 * then each token's probability, summed over the group; then a min-heap keeps the best k.
 * A logit of -inf is a token the row does not have. It is recognised by its bits, because
 * -ffast-math assumes there are no infinities. */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"

static inline int minus_inf(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return bits == 0xFF800000u;
}

/* log(e^a + e^b), either of them possibly -inf (then the other; both: -inf). */
static float log_add_exp(float a, float b) {
    if (minus_inf(a)) return b;
    if (minus_inf(b)) return a;
    const float top = a > b ? a : b;
    return top + logf(expf(a - top) + expf(b - top));
}

/* The row's log-sum-exp over its width logits (-inf: none). */
static float row_lse(const float *row, int64_t width) {
    float top = -INFINITY;
    for (int64_t w = 0; w < width; w++) top = row[w] > top ? row[w] : top;
    if (minus_inf(top)) return top;
    float sum = 0.f;
    for (int64_t w = 0; w < width; w++) sum += expf(row[w] - top);  /* e^-inf = 0 */
    return top + logf(sum);
}

/* logits: fp32 [B, h_q, width] contiguous; other_lse: fp32 [B, h_q]; out: int32 [B, h_kv, k],
 * the chosen token ids (-1 where fewer than k tokens exist). Returns 0; 1 if a scratch
 * allocation failed. */
int top_k_tokens(const float *logits, int64_t width, const float *other_lse, int batch,
                 int h_q, int h_kv, int k, int32_t *out) {
    const int group = h_q / h_kv, take = width < k ? (int)width : k;
    float *scores = malloc(sizeof(float) * (width ? width : 1));
    struct scored *best = malloc(sizeof(struct scored) * (take ? take : 1));
    const int status = !(scores && best);
    for (int b = 0; b < batch && !status; b++)
        for (int h = 0; h < h_kv; h++) {
            const int64_t head0 = (int64_t)b * h_q + h * group;
            for (int64_t w = 0; w < width; w++) scores[w] = 0.f;
            for (int j = 0; j < group; j++) {
                const float *row = logits + (head0 + j) * width;
                float lse = log_add_exp(row_lse(row, width), other_lse[head0 + j]);
                if (minus_inf(lse)) lse = 0.f;  /* a row with no key at all */
                for (int64_t w = 0; w < width; w++) scores[w] += expf(row[w] - lse);
            }
            const float *first = logits + head0 * width;
            for (int64_t w = 0; w < width; w++)  /* a valid token can underflow to 0 */
                if (minus_inf(first[w])) scores[w] = -1.f;
            top(scores, (int)width, take, best);
            int32_t *ids = out + ((int64_t)b * h_kv + h) * k;
            for (int i = 0; i < k; i++)
                ids[i] = i < take && best[i].score >= 0 ? best[i].index : -1;
        }
    free(scores), free(best);
    return status;
}
