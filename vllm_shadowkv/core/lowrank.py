"""Rank-r factorisation of pre-RoPE keys: A [tokens, r] shared by the KV heads, B [h_kv, r, d]."""

import torch

GRAM_BLOCK = 1024  # tokens per bf16 partial Gram
ORTHONORMAL_TOL = 1e-3  # fp32 eigenvectors further from orthonormal: computed in float64


def factorize_keys(keys_pre: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys_pre [T, h_kv, d] -> (A [T, r] fp32 (bf16 for bf16 keys_pre), B [h_kv, r, d] fp32),
    r = min(rank, h_kv*d).

    The paper takes an SVD of the [T, h_kv*d] key matrix. We take the eigendecomposition of its
    fp32 Gram matrix K^T K instead: one GEMM over the tall matrix plus an eigh of a small
    (h_kv*d)^2 matrix (1024^2 for Llama-3.1-8B) instead of an SVD of a 128K x 1024 matrix. The
    top-r eigenvectors Psi are K's top-r right singular vectors, so A = K Psi, B = Psi^T is the
    same rank-r optimum as U_r S_r V_r^T (Eckart-Young), and Psi is also the basis ShadowKV+
    needs to project generated keys (A row = k Psi). Squaring the condition number only blurs the
    discarded small directions. With r = h_kv*d, Psi is a full orthonormal basis: A B = K.

    The eigh runs in fp32 (half the time of float64: 70 against 145 ms at 1024^2 on the CPU,
    which became the larger part of the factorisation once the GEMMs ran in bf16), checked: keys
    often have a low intrinsic rank (most eigenvalues ~0), and fp32 eigh (MKL) was seen to return
    NaN eigenvectors or fail to converge on such matrices inside the engine; then, or if the
    top-r vectors are not orthonormal, it runs again in float64.

    bf16 keys_pre (the CPU path, where bf16 GEMMs are the faster ones) multiply as they are, with
    fp32 accumulation, and A comes out in bf16 (the pages' dtype): 3.4x faster than fp32 at 16K x
    1024 on AMX. The Gram is summed in fp32 over blocks of GRAM_BLOCK tokens, each block's product
    rounded to bf16 once (torch's CPU bf16 GEMM has no fp32 output): the rank-r basis then
    captures the keys as well as the fp32 Gram's (benchmarks/RESULTS.md).
    """
    num_tokens, num_heads, head_dim = keys_pre.shape
    low = keys_pre.dtype == torch.bfloat16
    flat = keys_pre.reshape(num_tokens, num_heads * head_dim)
    r = min(rank, num_heads * head_dim)
    if low:
        gram = sum((block.T @ block).float() for block in flat.split(GRAM_BLOCK))
    else:
        flat = flat.float()
        gram = flat.T @ flat
    psi = _top_eigenvectors(gram, r)  # [h_kv*d, r], largest first
    a = flat @ psi.to(flat.dtype)
    b = psi.T.reshape(r, num_heads, head_dim).transpose(0, 1).contiguous()
    return a, b


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
