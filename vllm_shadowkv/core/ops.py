"""The one dispatch point between the torch references and the Triton kernels.

CUDA tensors go to Triton; anything else to torch. `force_triton()` sends CPU tensors to the
kernels too, which works only when they were imported under TRITON_INTERPRET=1 (tests).
"""

import contextlib
import importlib.util

import torch

from . import reconstruct, select

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_force = False


@contextlib.contextmanager
def force_triton(enabled: bool = True):
    global _force
    previous, _force = _force, enabled
    try:
        yield
    finally:
        _force = previous


def _use_triton(t: torch.Tensor) -> bool:
    return _HAS_TRITON and (t.is_cuda or _force)


def _kernels(name: str):
    return importlib.import_module(f"vllm_shadowkv.triton_kernels.{name}")


def landmark_scores(q, landmarks, lm_start, lm_count, max_count, scale):
    impl = _kernels("select_kernels") if _use_triton(q) else select
    return impl.landmark_scores(q, landmarks, lm_start, lm_count, max_count, scale)


def select_chunks(scores, landmark_chunks, lm_start, lm_count, k):
    impl = _kernels("select_kernels") if _use_triton(scores) else select
    return impl.select_chunks(scores, landmark_chunks, lm_start, lm_count, k)


def rebuild_keys(a, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, rope, slot_k):
    impl = _kernels("rebuild_kernels") if _use_triton(slot_k) else reconstruct
    impl.rebuild_keys(a, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, rope,
                      slot_k)


def scatter_values(staging, staging_start, miss_slots, miss_count, slot_v):
    impl = _kernels("rebuild_kernels") if _use_triton(slot_v) else reconstruct
    impl.scatter_values(staging, staging_start, miss_slots, miss_count, slot_v)
