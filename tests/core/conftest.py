"""Kernel tests run the Triton kernels on the CPU through the interpreter.

Triton picks interpreted vs compiled when a kernel is decorated, so the kernel modules are
(re)imported here with TRITON_INTERPRET=1 set only for that moment: the variable never reaches
other test directories or the processes they spawn. With CUDA present the kernels compile.
"""

import importlib
import os
import sys

import pytest
import torch

KERNEL_MODULES = ("vllm_shadowkv.triton_kernels.select_kernels",
                  "vllm_shadowkv.triton_kernels.rebuild_kernels",
                  "vllm_shadowkv.triton_kernels.channel_kernels",
                  "vllm_shadowkv.triton_kernels.prefill_kernels",
                  "vllm_shadowkv.triton_kernels.heavy_hitter_kernels")


def _import_interpreted():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        # Triton imports gluon lazily at the first launch and asserts interpret mode there.
        importlib.import_module("triton.experimental.gluon")
        for name in KERNEL_MODULES:
            module = sys.modules.get(name)
            importlib.reload(module) if module else importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not torch.cuda.is_available():
    _import_interpreted()


@pytest.fixture
def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def interpreted():
    """For tests that run the Triton kernels on CPU tensors (``ops.force_triton()``): only the
    interpreter takes those. With CUDA present the kernels compile for the GPU instead, and
    the tests on ``kernel_device`` and the CUDA decode tests cover them."""
    if torch.cuda.is_available():
        pytest.skip("Triton kernels on CPU tensors need the interpreter (not used with CUDA)")
