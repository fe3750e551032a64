"""How many parts to split a kernel's loop into (flash-decoding), shared by the kernels that
split: few rows over a long context leave most of a GPU idle otherwise."""

import torch
import triton


def split_count(programs: int, max_splits: int, device: torch.device, per_sm: int) -> int:
    """Splits that bring ``programs`` (the launch's count without splitting) up to ``per_sm``
    programs per multiprocessor on CUDA (8 programs elsewhere: the interpreter's tests), at
    least 1 and at most ``max_splits``."""
    target = per_sm * torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 8
    return max(1, min(max_splits, triton.cdiv(target, programs)))
