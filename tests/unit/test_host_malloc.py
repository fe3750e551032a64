"""The malloc thresholds the engine sets (backend/host_malloc.py), read back through glibc's
``mallinfo2`` in a fresh interpreter each (the setting is process-wide): a step-sized tensor comes
from the heap, not a fresh mapping, and freeing it leaves the heap's pages in the process."""

import ctypes
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, torch
from vllm_shadowkv.backend.host_malloc import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
applied = keep_freed_memory()
mapped = libc.mallinfo2().hblkhd
held = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]  # a step's tensors
mapped, heap = libc.mallinfo2().hblkhd - mapped, libc.mallinfo2().arena
del held
print(applied, mapped >> 20, (heap - libc.mallinfo2().arena) >> 20)
"""


def _probe(setting: str) -> tuple[bool, int, int]:
    """(applied, MiB of the step's tensors mapped afresh, MiB of heap given back on free)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, env={**os.environ, "SHADOWKV_HOST_MALLOC": setting})
    applied, mapped, trimmed = out.stdout.split()
    return applied == "True", int(mapped), int(trimmed)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc >= 2.33")
def test_step_tensors_stay_in_the_heap_after_they_are_freed():
    assert _probe("1") == (True, 0, 0)
    applied, mapped, _ = _probe("0")
    assert not applied and mapped >= 24  # glibc's defaults map each afresh (then unmap it)
