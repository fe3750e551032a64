/* The value store's gather for several keys at once (native.py; the torch reference is
 * CpuValueStore.gather_many's torch path): each wanted row (head, chunk) of its key is found
 * through the key's page table and copied, converted to dst's dtype, to its destination rows.
 * All rows are checked before any is copied, so a bad request changes nothing. */
#include <stdlib.h>

#include "cpu.h"
#include "sparse_step.h"

struct tables {
    const int64_t *page_offsets;  /* element offset of each page from the pool's first element */
    const int64_t *first_page, *num_heads, *num_rows, *counts;  /* per key */
    int n_keys;
    int64_t page_rows, row_numel;
};

/* The element offset of a key's row (head, chunk) into *offset (negative where the page lies
 * below the pool's first); 0 if the key holds no such row. */
static inline int row_offset(const struct tables *t, int key, int64_t head, int64_t chunk,
                             int64_t *offset) {
    if (head < 0 || head >= t->num_heads[key] || chunk < 0 || chunk >= t->num_rows[key])
        return 0;
    const int64_t row = head * t->num_rows[key] + chunk;
    *offset = t->page_offsets[t->first_page[key] + row / t->page_rows] +
              row % t->page_rows * t->row_numel;
    return 1;
}

/* pool: the store's first extent (src_dtype); page_offsets, first_page, num_heads, num_rows,
 * counts: int64 (key i owns the next counts[i] wanted rows). heads, chunks: int64 [n]. Each
 * stored row is `split` destination rows of row_numel / split elements: wanted row i, part j
 * goes to dst row dst_rows[i * split + j] (i * split + j without dst_rows), dst_stride elements
 * apart, dst_len of them. Returns 0, 1 + the first wanted row that its key does not hold
 * (nothing copied), -2 if a destination row is outside dst (nothing copied), or -1 if a
 * scratch allocation failed. */
int64_t gather_store_rows(void *dst, int dst_dtype, int64_t dst_stride, int64_t dst_len,
                          const int64_t *dst_rows, int split, const void *pool, int src_dtype,
                          const int64_t *page_offsets, const int64_t *first_page,
                          const int64_t *num_heads, const int64_t *num_rows,
                          const int64_t *counts, int n_keys,
                          int64_t page_rows, int64_t row_numel, const int64_t *heads,
                          const int64_t *chunks, int64_t n) {
    const struct tables t = {page_offsets, first_page, num_heads, num_rows, counts, n_keys,
                             page_rows, row_numel};
    int64_t *offsets = malloc(sizeof(int64_t) * (n ? n : 1));
    if (!offsets) return -1;
    for (int64_t i = 0, key = 0, end = n_keys ? counts[0] : 0; i < n; i++) {
        while (i >= end && key + 1 < n_keys) end += counts[++key];
        if (i >= end || !row_offset(&t, (int)key, heads[i], chunks[i], offsets + i)) {
            free(offsets);
            return i + 1;
        }
    }
    for (int64_t i = 0; dst_rows && i < n * split; i++)
        if (dst_rows[i] < 0 || dst_rows[i] >= dst_len) {
            free(offsets);
            return -2;
        }
    if (!dst_rows && n * split > dst_len) {
        free(offsets);
        return -2;
    }
    const size_t src_size = element_size(src_dtype);
    const int64_t width = row_numel / split,
                  dst_bytes = dst_stride * (int64_t)element_size(dst_dtype);
    int failed = 0;
    /* runs of rows across the threads (each destination row is filled once: the slots) */
#pragma omp parallel reduction(| : failed) if (n >= 64)
    {
        float *scratch = dst_dtype == src_dtype ? NULL : malloc(sizeof(float) * width);
        failed = dst_dtype != src_dtype && !scratch;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (failed) continue;
            if (i + PREFETCH_AHEAD < n) {
                const char *next = (const char *)pool + offsets[i + PREFETCH_AHEAD] * src_size;
                for (int64_t line = 0; line < row_numel * (int64_t)src_size; line += 64)
                    __builtin_prefetch(next + line);
            }
            const char *from = (const char *)pool + offsets[i] * src_size;
            for (int j = 0; j < split; j++) {
                const int64_t to = dst_rows ? dst_rows[i * split + j] : i * split + j;
                copy_row((char *)dst + to * dst_bytes, dst_dtype, from + j * width * src_size,
                         src_dtype, width, scratch);
            }
        }
        free(scratch);
    }
    free(offsets);
    return failed ? -1 : 0;
}
