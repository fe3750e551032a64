"""Keep the decode steps' freed host memory mapped in the process (glibc malloc).

A sparse decode step on the CPU allocates a few MiB of step tensors per layer (the slots read out
of the pages, the landmark logits, the rebuilt keys) and frees them when it ends. glibc maps
blocks above its mmap threshold afresh and trims freed heap tops back to the OS, so each step
page-faults its tensors in again: 10 ms of a 36 ms layer step at 128K (benchmarks/RESULTS.md).
A fixed mmap threshold at glibc's largest (32 MiB) and a trim threshold of 1 GiB keep those pages
for the next step, as tcmalloc or jemalloc (which vLLM's CPU guide preloads) do. Applied once
per worker process by the engine's attention impl; ``SHADOWKV_HOST_MALLOC=0`` leaves malloc as
it is.
"""

from __future__ import annotations

import ctypes
import functools
import os

ENV = "SHADOWKV_HOST_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Set the process's malloc thresholds; False where the setting is off or libc is not glibc
    (the call then changes nothing)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:  # the process's own symbols: libc is loaded (find_library would run ldconfig)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and
                mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
