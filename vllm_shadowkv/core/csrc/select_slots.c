/* ShadowKV's chunk selection and slot assignment for a ragged batch, one call per layer and step
 * (native.py; the torch reference is select.select_chunks followed by select.assign_slots).
 *
 * For request b and KV head h: the top min(k, lm_count[b], slot_count[b]) landmarks by score
 * (slot_count: the slots request b owns, the rest of its row of k being padding; NULL: k; a
 * min-heap of
 * the best so far: one comparison for most landmarks), in order of score; a selected chunk
 * already in a slot stays there (found by binary search among the sorted residents), the
 * misses take the freed slots, lowest first, in order of score, and freed slots left over are
 * emptied (-1). `assign_slots` is that assignment alone, for SpeCache's and TailorKV's tokens
 * (the torch reference is select.assign_slots). */
#include <stdlib.h>

#include "cpu.h"
#include "sparse_step.h"

static int by_chunk(const void *a, const void *b) {
    const int x = ((const int32_t *)a)[0], y = ((const int32_t *)b)[0];
    return (x > y) - (x < y);
}

/* Scratch for the slot assignment of one row of k slots. */
struct assignment {
    int32_t *resident;  /* (chunk, slot) pairs, sorted by chunk */
    int32_t *missed;
    char *keep;
};

static int alloc_assignment(struct assignment *a, int k) {
    a->resident = malloc(sizeof(int32_t) * 2 * (k ? k : 1));
    a->missed = malloc(sizeof(int32_t) * (k ? k : 1));
    a->keep = malloc(k ? k : 1);
    return !(a->resident && a->missed && a->keep);
}

static void free_assignment(struct assignment *a) {
    free(a->resident), free(a->missed), free(a->keep);
}

/* One row of k slots (slots: the resident chunk of each, -1 empty, updated) takes the n
 * wanted chunks (-1 entries skipped): a wanted chunk already resident stays in its slot (found
 * by binary search), the misses take the freed slots, lowest first, in wanted order, and freed
 * slots left over are emptied. fill: the slots to fill, -1 after. Returns the misses. */
static int assign_row(const int32_t *wanted, int n, int32_t *slots, int32_t *fill, int k,
                      const struct assignment *a) {
    for (int j = 0; j < k; j++) a->resident[2 * j] = slots[j], a->resident[2 * j + 1] = j;
    qsort(a->resident, k, 2 * sizeof(int32_t), by_chunk);
    for (int j = 0; j < k; j++) a->keep[j] = 0;
    int misses = 0;
    for (int i = 0; i < n; i++) {
        const int32_t chunk = wanted[i];
        if (chunk < 0) continue;
        int lo = 0, hi = k;  /* the first resident >= chunk */
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (a->resident[2 * mid] < chunk) lo = mid + 1; else hi = mid;
        }
        if (lo < k && a->resident[2 * lo] == chunk) a->keep[a->resident[2 * lo + 1]] = 1;
        else a->missed[misses++] = chunk;
    }
    int filled = 0;
    for (int j = 0; j < k; j++) {
        if (a->keep[j]) continue;
        if (filled < misses) fill[filled] = j, slots[j] = a->missed[filled++];
        else slots[j] = -1;
    }
    for (int j = misses; j < k; j++) fill[j] = -1;
    return misses;
}

/* scores: fp32 [B, h_kv, max_count]; landmark_chunks: int32 [NL, h_kv]; lm_start, lm_count,
 * slot_count (or NULL): int32 [B]. Misses take the lowest free slots, so a request's padding
 * slots (>= slot_count[b], empty) are never filled. slot_chunks: int32 [B, h_kv, k], updated
 * in place; miss_slots: int32 [B, h_kv, k] (the slots to fill first, -1 after); miss_count:
 * int32 [B, h_kv]. Returns 0; 1 if a scratch allocation failed. */
int select_slots(const float *scores, int max_count, const int32_t *landmark_chunks,
                 const int32_t *lm_start, const int32_t *lm_count, const int32_t *slot_count,
                 int batch, int h_kv, int k, int32_t *slot_chunks, int32_t *miss_slots,
                 int32_t *miss_count) {
    int status = 0;
    /* (request, KV head) rows across the threads, each with its own scratch */
#pragma omp parallel reduction(| : status) if (batch * h_kv > 1)
    {
        struct scored *best = malloc(sizeof(struct scored) * (k ? k : 1));
        int32_t *wanted = malloc(sizeof(int32_t) * (k ? k : 1));
        struct assignment a;
        status = alloc_assignment(&a, k) || !(best && wanted);
#pragma omp for schedule(dynamic, 4)
        for (int64_t row = 0; row < (int64_t)batch * h_kv; row++) {
            if (status) continue;
            const int b = (int)(row / h_kv), h = (int)(row % h_kv);
            const int own = slot_count && slot_count[b] < k ? slot_count[b] : k;
            const int take = lm_count[b] < own ? lm_count[b] : own;
            top(scores + row * max_count, lm_count[b], take, best);
            for (int i = 0; i < take; i++)
                wanted[i] = landmark_chunks[((int64_t)lm_start[b] + best[i].index) * h_kv + h];
            miss_count[row] = assign_row(wanted, take, slot_chunks + row * k,
                                         miss_slots + row * k, k, &a);
        }
        free(best), free(wanted), free_assignment(&a);
    }
    return status;
}

/* select.assign_slots for rows of k slots: held (int32 [rows, k], updated in place to the new
 * slots) takes wanted (int32 [rows, k], -1 = none); miss_slots, miss_count as select_slots'.
 * Returns 0; 1 if a scratch allocation failed. */
int assign_slots(int32_t *held, const int32_t *wanted, int64_t rows, int k, int32_t *miss_slots,
                 int32_t *miss_count) {
    struct assignment a;
    const int status = alloc_assignment(&a, k);
    for (int64_t row = 0; row < rows && !status; row++)
        miss_count[row] = assign_row(wanted + row * k, k, held + row * k, miss_slots + row * k,
                                     k, &a);
    free_assignment(&a);
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
