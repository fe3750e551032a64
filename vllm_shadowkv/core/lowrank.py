"""Rank-r factorisation of pre-RoPE keys: A [tokens, r] shared by the KV heads, B [h_kv, r, d]."""

from contextlib import contextmanager
from functools import cache

import torch

ORTHONORMAL_TOL = 1e-3  # fp32 eigenvectors further from orthonormal: computed in float64
MIN_BLOCKED_WIDTH = 256  # narrower Grams (SmolLM2: 192) take microseconds either way


def factorize_keys(keys_pre: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys_pre [T, h_kv, d] -> (A [T, r] fp32, B [h_kv, r, d] fp32), r = min(rank, h_kv*d).

    The paper takes an SVD of the [T, h_kv*d] key matrix. We take the eigendecomposition of its
    fp32 Gram matrix K^T K instead: one GEMM over the tall matrix plus an eigh of a small
    (h_kv*d)^2 matrix (1024^2 for Llama-3.1-8B) instead of an SVD of a 128K x 1024 matrix. The
    top-r eigenvectors Psi are K's top-r right singular vectors, so A = K Psi, B = Psi^T is the
    same rank-r optimum as U_r S_r V_r^T (Eckart-Young), and Psi is also the basis ShadowKV+
    needs to project generated keys (A row = k Psi). Squaring the condition number only blurs the
    discarded small directions. With r = h_kv*d, Psi is a full orthonormal basis: A B = K.

    The eigh runs in fp32 (half the time of float64: 70 against 145 ms at 1024^2 on the CPU),
    checked: keys often have a low intrinsic rank (most eigenvalues ~0), and fp32 eigh (MKL) was
    seen to return NaN eigenvectors or fail to converge on such matrices inside the engine; then,
    or if the top-r vectors are not orthonormal, it runs again in float64.

    On a CPU with bf16 dot products (AVX512-BF16, AMX) the two GEMMs run in oneDNN's bf16 mode
    for fp32 matrices (bf16 products, fp32 sums): 1.6x faster at 16K x 1024 on AVX512-BF16, within
    about twice the fp32 GEMM's error against float64 (measured on random 300-4096 x 32-512
    matrices), and the rank-r error stays the optimum (tests/core/test_compress.py). torch's plain
    bf16 GEMM is not used: it rounds its product to bf16, and a Gram summed from such products
    (in fp32, over blocks of 1,024 tokens) moved the basis enough that the demo's constructed
    model lost three of its four needle values (benchmarks/RESULTS.md).
    """
    num_tokens, num_heads, head_dim = keys_pre.shape
    flat = keys_pre.reshape(num_tokens, num_heads * head_dim).float()
    r = min(rank, num_heads * head_dim)
    with _fp32_products_as_bf16(flat.device):
        gram = _gram(flat)
    psi = _top_eigenvectors(gram, r)  # [h_kv*d, r], largest first
    with _fp32_products_as_bf16(flat.device):
        a = flat @ psi
    b = psi.T.reshape(r, num_heads, head_dim).transpose(0, 1).contiguous()
    return a, b


def _gram(flat: torch.Tensor, pieces: int = 4) -> torch.Tensor:
    """flat^T flat. On the CPU, where the GEMM's FLOPs bound it, only the blocks on and above the
    diagonal are multiplied (the rest mirrored): 10 of 16 blocks, 1.4x faster at 16K x 1024 in
    fp32 on a Zen 3, where it gave the same bits as one product (benchmarks/RESULTS.md, "The
    prompt end's Gram")."""
    if flat.device.type != "cpu" or flat.shape[1] < MIN_BLOCKED_WIDTH:
        return flat.T @ flat
    width = flat.shape[1]
    gram = flat.new_empty(width, width)
    starts = [width * i // pieces for i in range(pieces + 1)]
    for lo, hi in zip(starts, starts[1:]):
        rows = flat[:, lo:hi].T @ flat[:, lo:]  # [hi - lo, width - lo]
        gram[lo:hi, lo:] = rows
        gram[hi:, lo:hi] = rows[:, hi - lo:].T
    return gram


def _top_eigenvectors(gram: torch.Tensor, r: int) -> torch.Tensor:
    """The r eigenvectors of the largest eigenvalues of symmetric ``gram`` (fp32), largest first:
    fp32 eigh where it gives finite orthonormal vectors, float64 otherwise."""
    try:
        psi = torch.linalg.eigh(gram).eigenvectors[:, -r:]  # ascending eigenvalues
        error = (psi.T @ psi - torch.eye(r, device=psi.device)).abs().max()
        if bool(error < ORTHONORMAL_TOL):  # (NaN compares False)
            return psi.flip(-1)
    except torch.linalg.LinAlgError:  # did not converge
        pass
    return torch.linalg.eigh(gram.double()).eigenvectors[:, -r:].flip(-1).float()


@cache
def _cpu_has_bf16_dot_products() -> bool:
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's own ISA checks
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


@contextmanager
def _fp32_products_as_bf16(device: torch.device):
    """fp32 matrix products as bf16 products with fp32 sums, here only (the setting is global)."""
    if device.type != "cpu" or not _cpu_has_bf16_dot_products():
        yield
        return
    settings = torch.backends.mkldnn.matmul
    before, settings.fp32_precision = settings.fp32_precision, "bf16"
    try:
        yield
    finally:
        settings.fp32_precision = before
