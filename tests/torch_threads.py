"""Code run on n torch threads: the C kernels take torch's OpenMP threads (core/native.py)."""

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
