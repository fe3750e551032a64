/* Row scatter/gather: dst[index[i]] = src[src_index[i]] (src[i] without src_index), converted to
 * dst's dtype (native.py; the torch reference is reconstruct.copy_rows). The writes of the
 * decode step's slots and pages, and the value fetch from the host store: rows of a few hundred
 * bytes to a few KiB at scattered places, so the next rows are prefetched while one is copied. */
#include <stdlib.h>

#include "cpu.h"

void copy_rows(void *dst, int dst_dtype, int64_t dst_stride, const int64_t *index, int64_t n,
               const void *src, int src_dtype, int64_t src_stride, const int64_t *src_index,
               int64_t width) {
    const size_t dst_size = element_size(dst_dtype), src_size = element_size(src_dtype);
    const int64_t src_bytes = src_stride * (int64_t)src_size,
                  dst_bytes = dst_stride * (int64_t)dst_size;
    float *row = dst_dtype == src_dtype ? NULL : malloc(sizeof(float) * width);
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            const int64_t ahead = src_index ? src_index[i + PREFETCH_AHEAD] : i + PREFETCH_AHEAD;
            const char *next = (const char *)src + ahead * src_bytes;
            for (int64_t line = 0; line < width * (int64_t)src_size; line += 64)
                __builtin_prefetch(next + line);
        }
        const char *from = (const char *)src + (src_index ? src_index[i] : i) * src_bytes;
        char *to = (char *)dst + index[i] * dst_bytes;
        copy_row(to, dst_dtype, from, src_dtype, width, row);
    }
    free(row);
}
