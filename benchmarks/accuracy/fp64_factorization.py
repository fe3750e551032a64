"""DIAGNOSTIC ONLY, not the shipped backend: a worker extension that makes the engine's key
factorisation take its eigendecomposition in float64.

Why: ``vllm_shadowkv.core.lowrank.factorize_keys`` runs ``torch.linalg.eigh`` on the fp32 Gram
matrix of the pre-RoPE keys. On the retrieval fixture (layer 2's keys have rank ~17 of 256, so
~230 eigenvalues are ~0) MKL's fp32 eigh intermittently returns NaN eigenpairs (NaN attention
output, greedy decoding then emits token 0) or raises "linalg.eigh: The algorithm failed to
converge" (the engine dies), depending on the prompt and the worker's thread count. float64
eigh and SVD of the same matrices are fine. This extension swaps in a float64 eigh so the
accuracy of the *method* can be measured until the backend is fixed; tables produced with it
are labelled as such in RESULTS.md.

    PYTHONPATH=benchmarks/accuracy VLLM_CPU_KVCACHE_SPACE=2 python benchmarks/accuracy.py \\
        --shadowkv --engine-args '{"enable_prefix_caching": false,
                                   "worker_extension_cls": "fp64_factorization.Fp64Factorization"}'
"""

from __future__ import annotations

import torch

from vllm_shadowkv.core import compress
from vllm_shadowkv.introspect import ShadowKVWorkerExtension


def factorize_keys_fp64(keys_pre: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowrank.factorize_keys`` with the Gram matrix and its eigh in float64."""
    num_tokens, num_heads, head_dim = keys_pre.shape
    flat = keys_pre.reshape(num_tokens, num_heads * head_dim).double()
    r = min(rank, num_heads * head_dim)
    _, eigvecs = torch.linalg.eigh(flat.T @ flat)
    psi = eigvecs[:, -r:].flip(-1)
    a = (flat @ psi).float()
    b = psi.T.reshape(r, num_heads, head_dim).transpose(0, 1).contiguous().float()
    return a, b


compress.factorize_keys = factorize_keys_fp64  # imported by name in compress_prompt's module


class Fp64Factorization(ShadowKVWorkerExtension):
    """The introspection methods (shadowkv_stats, ...) plus the patch above, in every worker."""

    def shadowkv_fp64_factorization(self) -> bool:
        return compress.factorize_keys is factorize_keys_fp64
