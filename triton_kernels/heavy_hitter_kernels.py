"""Triton kernels for MiniKV's H2O column sums of one prefill chunk, what CUDA runs instead of
the fp32 tiles of the reference (which write a [h_kv, G, 256, 2048] fp32 logit tile per step).

Reference and signature: vllm_shadowkv.core.heavy_hitters.chunk_column_sums_reference.
The chunk's n queries sit at positions [start, start + n) of a sequence of L = start + n keys.

* ``_row_lse_kernel`` (only when the caller has no LSE): one program per (query head, block of
  query rows), an online log-sum-exp over the keys each row sees.
* ``_column_sums_kernel``: one program per (KV head, block of keys). It owns its keys' sums, so
  no atomics: it walks the query rows that see those keys (causal: rows at or after the key) of
  every query head in the group, and adds exp(q.k * scale - lse_row) over them.

The [n, L] map is never written: each program holds one [BLOCK_Q, BLOCK_K] tile at a time.
16-bit inputs are widened to fp32 and multiplied as TF32, which holds their mantissas whole (exact
products, fp32 accumulation; Triton's interpreter mishandles bf16 operands of tl.dot); fp32 inputs
multiply as IEEE fp32.
"""

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _row_lse_kernel(
    q_ptr, k_ptr, lse_ptr, s_qn, s_qh, s_qd, s_kn, s_kh, s_kd, s_lh, s_ln,
    n, start, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    hq = tl.program_id(0)
    offs_q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = offs_q < n
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    h = hq // GROUP
    q = tl.load(q_ptr + offs_q[:, None] * s_qn + hq * s_qh + offs_d[None, :] * s_qd,
                mask=q_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    precision: tl.constexpr = "ieee" if IEEE else "tf32"
    row_max = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_Q], dtype=tl.float32)
    q_pos = start + offs_q
    # Keys up to the block's last row (causal); rows past n see nothing beyond their limit.
    last_key = start + tl.minimum((tl.program_id(1) + 1) * BLOCK_Q, n)
    for j0 in range(0, last_key, BLOCK_K):
        offs_k = j0 + tl.arange(0, BLOCK_K)
        k = tl.load(k_ptr + offs_k[:, None] * s_kn + h * s_kh + offs_d[None, :] * s_kd,
                    mask=(offs_k < last_key)[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision=precision) * scale_log2
        logits = tl.where(offs_k[None, :] <= q_pos[:, None], logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp2(row_max - safe_max) \
            + tl.sum(tl.exp2(logits - safe_max[:, None]), axis=1)
        row_max = new_max
    lse = (row_max + tl.log2(row_sum)) / 1.4426950408889634  # natural log
    tl.store(lse_ptr + hq * s_lh + offs_q * s_ln, lse, mask=q_mask)


@triton.jit
def _column_sums_kernel(
    q_ptr, k_ptr, lse_ptr, out_ptr, s_qn, s_qh, s_qd, s_kn, s_kh, s_kd, s_lh, s_ln, s_oh, s_on,
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
            lse = tl.load(lse_ptr + hq * s_lh + offs_q * s_ln, mask=q_mask, other=0.0)
            logits = tl.dot(q, tl.trans(k), input_precision=precision) * scale_log2
            seen = q_mask[:, None] & k_mask[None, :] & (offs_k[None, :] <= start + offs_q[:, None])
            p = tl.exp2(logits - (lse * 1.4426950408889634)[:, None])
            acc += tl.sum(tl.where(seen, p, 0.0), axis=0)
    tl.store(out_ptr + h * s_oh + offs_k * s_on, acc, mask=k_mask)


def _blocks(head_dim: int) -> tuple[int, int, int]:
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    tile = 64 if block_d <= 128 else 32  # keeps q, k and the logit tile in registers
    return tile, tile, block_d


def chunk_column_sums(q: torch.Tensor, k: torch.Tensor, scale: float,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
    n, h_q, head_dim = q.shape
    length, h_kv, _ = k.shape
    assert h_q % h_kv == 0 and length >= n and k.shape[2] == head_dim
    assert q.device == k.device and q.dtype == k.dtype
    group, start = h_q // h_kv, length - n
    block_q, block_k, block_d = _blocks(head_dim)
    meta = dict(GROUP=group, HEAD_DIM=head_dim, IEEE=q.dtype == torch.float32,
                BLOCK_Q=block_q, BLOCK_K=block_k, BLOCK_D=block_d)
    out = torch.zeros(h_kv, length, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    if lse is None:
        rows = torch.empty(h_q, n, dtype=torch.float32, device=q.device)
        _row_lse_kernel[(h_q, triton.cdiv(n, block_q))](
            q, k, rows, *q.stride(), *k.stride(), *rows.stride(), n, start, scale * _LOG2E,
            **meta)
    else:
        assert lse.shape == (h_kv, group, n), (lse.shape, (h_kv, group, n))
        rows = lse.float().reshape(h_q, n)
    _column_sums_kernel[(h_kv, triton.cdiv(length, block_k))](
        q, k, rows, out, *q.stride(), *k.stride(), *rows.stride(), *out.stride(),
        n, start, scale * _LOG2E, **meta)
    return out
