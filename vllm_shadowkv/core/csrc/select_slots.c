/* ShadowKV's chunk selection and slot assignment for a ragged batch, one call per layer and step
 * (native.py; the torch reference is select.select_chunks followed by select.assign_slots).
 *
 * For request b and KV head h: the top min(k, lm_count[b]) landmarks by score (a min-heap of
 * the best so far: one comparison for most landmarks), in order of score; a selected chunk
 * already in a slot stays there (found by binary search among the sorted residents), the
 * misses take the freed slots, lowest first, in order of score, and freed slots left over are
 * emptied (-1). */
#include <stdlib.h>

#include "cpu.h"

static int by_chunk(const void *a, const void *b) {
    const int x = ((const int32_t *)a)[0], y = ((const int32_t *)b)[0];
    return (x > y) - (x < y);
}

/* scores: fp32 [B, h_kv, max_count]; landmark_chunks: int32 [NL, h_kv]; lm_start, lm_count:
 * int32 [B]. slot_chunks: int32 [B, h_kv, k], updated in place; miss_slots: int32 [B, h_kv, k]
 * (the slots to fill first, -1 after); miss_count: int32 [B, h_kv]. Returns 0; 1 if a scratch
 * allocation failed. */
int select_slots(const float *scores, int max_count, const int32_t *landmark_chunks,
                 const int32_t *lm_start, const int32_t *lm_count, int batch, int h_kv, int k,
                 int32_t *slot_chunks, int32_t *miss_slots, int32_t *miss_count) {
    struct scored *best = malloc(sizeof(struct scored) * (k ? k : 1));
    int32_t *resident = malloc(sizeof(int32_t) * 2 * (k ? k : 1));  /* (chunk, slot) pairs */
    int32_t *missed = malloc(sizeof(int32_t) * (k ? k : 1));
    char *keep = malloc(k ? k : 1);
    const int status = !(best && resident && missed && keep);
    for (int b = 0; b < batch && !status; b++)
        for (int h = 0; h < h_kv; h++) {
            const int64_t row = (int64_t)b * h_kv + h;
            const int take = lm_count[b] < k ? lm_count[b] : k;
            int32_t *slots = slot_chunks + row * k, *fill = miss_slots + row * k;
            top(scores + row * max_count, lm_count[b], take, best);
            for (int j = 0; j < k; j++) resident[2 * j] = slots[j], resident[2 * j + 1] = j;
            qsort(resident, k, 2 * sizeof(int32_t), by_chunk);
            for (int j = 0; j < k; j++) keep[j] = 0;
            int misses = 0;
            for (int i = 0; i < take; i++) {
                const int32_t chunk =
                    landmark_chunks[((int64_t)lm_start[b] + best[i].index) * h_kv + h];
                int lo = 0, hi = k;  /* the first resident >= chunk */
                while (lo < hi) {
                    const int mid = (lo + hi) / 2;
                    if (resident[2 * mid] < chunk) lo = mid + 1; else hi = mid;
                }
                if (lo < k && resident[2 * lo] == chunk) keep[resident[2 * lo + 1]] = 1;
                else missed[misses++] = chunk;
            }
            int filled = 0;
            for (int j = 0; j < k; j++) {
                if (keep[j]) continue;
                if (filled < misses) fill[filled] = j, slots[j] = missed[filled++];
                else slots[j] = -1;
            }
            for (int j = misses; j < k; j++) fill[j] = -1;
            miss_count[row] = misses;
        }
    free(best), free(resident), free(missed), free(keep);
    return status;
}

/* The step's misses in (b, h, miss) order: the KV head, chunk and flat slot id (over
 * [B, h_kv, k]) of each, int64, and each request's count. Returns their number. */
int64_t list_misses(const int32_t *slot_chunks, const int32_t *miss_slots,
                    const int32_t *miss_count, int batch, int h_kv, int k, int64_t *heads,
                    int64_t *chunks, int64_t *filled, int64_t *per_request) {
    int64_t n = 0;
    for (int b = 0; b < batch; b++) {
        const int64_t first = n;
        for (int h = 0; h < h_kv; h++) {
            const int64_t row = (int64_t)b * h_kv + h;
            for (int m = 0; m < miss_count[row]; m++) {
                const int32_t slot = miss_slots[row * k + m];
                heads[n] = h, chunks[n] = slot_chunks[row * k + slot];
                filled[n++] = row * k + slot;
            }
        }
        per_request[b] = n - first;
    }
    return n;
}
