"""Triton kernels for MiniKV's H2O column sums of one prefill chunk, what CUDA runs instead of
the fp32 tiles of the reference (which write a [h_kv, G, 256, 2048] fp32 logit tile per step).

Reference and signature: vllm_shadowkv.core.heavy_hitters.chunk_column_sums_reference.
The chunk's n queries sit at positions [start, start + n) of a sequence of L = start + n keys.

One program per (KV head, block of keys). It owns its keys' sums, so no atomics: it walks the
query rows that see those keys (causal: rows at or after the key) of every query head in the
group, and adds exp(q.k * scale - lse_row) over them (as exp2, the LSE handed over in base 2).
Where the caller has no LSE, the engine's exact attention kernel (prefill_kernels.py) gives it
first, the keys standing in for the values (as heavy_hitters does on the CPU).

The [n, L] map is never written: each program holds one [BLOCK_Q, BLOCK_K] tile at a time.
16-bit inputs are widened to fp32 and multiplied as TF32, which holds their mantissas whole (exact
products, fp32 accumulation; Triton's interpreter mishandles bf16 operands of tl.dot); fp32 inputs
multiply as IEEE fp32.
"""

import torch
import triton
import triton.language as tl

from .prefill_kernels import LOG2E, paged_causal_attention, tile_sizes


@triton.jit
def _column_sums_kernel(
    q_ptr, k_ptr, lse2_ptr, out_ptr, s_qn, s_qh, s_qd, s_kn, s_kh, s_kd, s_lh, s_ln, s_oh, s_on,
    n, start, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.program_id(0)
    j0 = tl.program_id(1) * BLOCK_K
    offs_k = j0 + tl.arange(0, BLOCK_K)
    length = start + n
    k_mask = offs_k < length
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k = tl.load(k_ptr + offs_k[:, None] * s_kn + h * s_kh + offs_d[None, :] * s_kd,
                mask=k_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    precision: tl.constexpr = "ieee" if IEEE else "tf32"
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    # Row i sees key j when start + i >= j: the first row that sees any key of this block.
    first = tl.maximum(j0 - start, 0) // BLOCK_Q * BLOCK_Q
    for g in range(GROUP):
        hq = h * GROUP + g
        for i0 in range(first, n, BLOCK_Q):
            offs_q = i0 + tl.arange(0, BLOCK_Q)
            q_mask = offs_q < n
            q = tl.load(q_ptr + offs_q[:, None] * s_qn + hq * s_qh + offs_d[None, :] * s_qd,
                        mask=q_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            lse2 = tl.load(lse2_ptr + hq * s_lh + offs_q * s_ln, mask=q_mask, other=0.0)
            logits = tl.dot(q, tl.trans(k), input_precision=precision) * scale_log2
            seen = q_mask[:, None] & k_mask[None, :] & (offs_k[None, :] <= start + offs_q[:, None])
            p = tl.exp2(logits - lse2[:, None])
            acc += tl.sum(tl.where(seen, p, 0.0), axis=0)
    tl.store(out_ptr + h * s_oh + offs_k * s_on, acc, mask=k_mask)


def chunk_column_sums(q: torch.Tensor, k: torch.Tensor, scale: float,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
    n, h_q, head_dim = q.shape
    length, h_kv, _ = k.shape
    assert h_q % h_kv == 0 and length >= n and k.shape[2] == head_dim
    assert q.device == k.device and q.dtype == k.dtype
    group, start = h_q // h_kv, length - n
    out = torch.zeros(h_kv, length, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    if lse is None:  # the keys as one-token pages, standing in for the values too
        pages = k.as_strided((length, 1, 2, h_kv, head_dim), (k.stride(0), 0, 0, *k.stride()[1:]))
        tokens = torch.arange(length, device=k.device)
        _, lse = paged_causal_attention(q, pages, tokens, torch.zeros_like(tokens), scale)
    assert lse.shape == (h_kv, group, n), (lse.shape, (h_kv, group, n))
    rows = lse.float().reshape(h_q, n) * LOG2E  # the kernel works in base 2
    block, block_d = tile_sizes(head_dim)
    _column_sums_kernel[(h_kv, triton.cdiv(length, block))](
        q, k, rows, out, *q.stride(), *k.stride(), *rows.stride(), *out.stride(),
        n, start, scale * LOG2E, GROUP=group, HEAD_DIM=head_dim,
        IEEE=q.dtype == torch.float32, BLOCK_Q=block, BLOCK_K=block, BLOCK_D=block_d)
    return out
