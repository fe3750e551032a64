"""Triton kernel for the engine's exact attention on CUDA: a request's last q positions attend its
s tokens causally, K/V read in place from the exact pages (no gathered copy, no [q, s] mask),
fp32 online softmax, and each row's LSE returned (what MiniKV's column sums normalise by).

Reference and signature: vllm_shadowkv.core.attention.paged_causal_attention_reference.
One program per (query head, block of query rows, split of the keys), flash-attention style: it
walks the key blocks its rows see, each token's page and slot from ``blocks``/``slots`` (one row
of the block table resolved per token, as vLLM's paged kernels read their block table). A
prefill is one split; a few rows over a long context (a decode step) are split over the keys
(flash-decoding) and the parts merged by LSE: one decode row per query head alone was 32
programs on an H200's 132 SMs (2.4x slower than SDPA over the gathered tokens at 128K).
On CUDA, 16-bit inputs multiply in their own dtype with fp32 accumulation (P in the inputs'
dtype, as FlashAttention does); under Triton's CPU interpreter, which mishandles bf16 operands
of tl.dot, they are widened to fp32 first (TF32 holds 16-bit mantissas whole).
"""

import torch
import triton
import triton.language as tl

from vllm_shadowkv.core.attention import merge_stacked

from .splits import split_count

LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# Keys per split at least: a short context is fast on one split, and splitting it adds the
# merge's few launches to a step that is host-bound on a GPU (not yet timed: a first choice).
_MIN_SPLIT_KEYS = 1024


@triton.jit
def _paged_causal_kernel(
    q_ptr, kv_ptr, blocks_ptr, slots_ptr, out_ptr, lse_ptr,
    s_qn, s_qh, s_qd, s_kvb, s_kvs, s_kvp, s_kvh, s_kvd, s_os, s_on, s_oh, s_od, s_ls, s_lh,
    s_ln, n, seq_len, keys_per_split, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    hq = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    h = hq // GROUP
    q = tl.load(q_ptr + offs_m[:, None] * s_qn + hq * s_qh + offs_d[None, :] * s_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    precision: tl.constexpr = "ieee" if IEEE else "tf32"
    q_pos = seq_len - n + offs_m
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last_key = seq_len - n + tl.minimum((tl.program_id(1) + 1) * BLOCK_M, n)  # causal limit
    split = tl.program_id(2)
    first_key = split * keys_per_split
    last_key = tl.minimum(last_key, first_key + keys_per_split)
    for j0 in range(first_key, last_key, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < last_key
        page = tl.load(blocks_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
        row = page * s_kvb + slot * s_kvs + h * s_kvh
        tile_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + row[:, None] + offs_d[None, :] * s_kvd, mask=tile_mask, other=0.0)
        v = tl.load(kv_ptr + row[:, None] + s_kvp + offs_d[None, :] * s_kvd, mask=tile_mask,
                    other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision=precision) * scale_log2
        logits = tl.where(offs_n[None, :] <= q_pos[:, None], logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp2(row_max - safe_max)
        p = tl.exp2(logits - safe_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=precision)
        row_max = new_max
    # A split whose keys all lie past a row's causal limit gives it out 0 and lse -inf.
    out = acc / tl.maximum(row_sum, 1e-30)[:, None]
    tl.store(out_ptr + split * s_os + offs_m[:, None] * s_on + hq * s_oh + offs_d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    lse = tl.where(row_sum > 0.0, (row_max + tl.log2(row_sum)) / 1.4426950408889634,
                   float("-inf"))  # natural log
    tl.store(lse_ptr + split * s_ls + hq * s_lh + offs_m * s_ln, lse, mask=m_mask)


def tile_sizes(head_dim: int) -> tuple[int, int]:
    """(rows and keys per tile, padded head_dim): q, k and the logit tile stay in registers."""
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    return (64 if block_d <= 128 else 32), block_d


def paged_causal_attention(query: torch.Tensor, kv: torch.Tensor, blocks: torch.Tensor,
                           slots: torch.Tensor, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    q_len, h_q, head_dim = query.shape
    assert kv.dim() == 5 and kv.shape[2] == 2 and kv.shape[4] == head_dim, kv.shape
    h_kv, s_len = kv.shape[3], blocks.shape[0]
    assert h_q % h_kv == 0 and slots.shape == blocks.shape and s_len >= q_len
    assert query.device == kv.device == blocks.device == slots.device
    q = query if query.dtype == kv.dtype else query.to(kv.dtype)  # e.g. a bf16 cache, fp16 model
    if q_len == 0:
        return torch.empty_like(query), torch.empty(h_kv, h_q // h_kv, 0, device=query.device)
    block, block_d = tile_sizes(head_dim)
    row_blocks = triton.cdiv(q_len, block)
    n_splits, per_split = _key_splits(h_q * row_blocks, s_len, block, query.device)
    if n_splits == 1:
        out = torch.empty_like(query)
        lse = torch.empty(h_q, q_len, dtype=torch.float32, device=query.device)
        out_strides, lse_strides = (0, *out.stride()), (0, *lse.stride())
    else:  # fp32 partial results per split, merged by LSE below
        out = torch.empty(n_splits, q_len, h_q, head_dim, dtype=torch.float32,
                          device=query.device)
        lse = torch.empty(n_splits, q_len, h_q, dtype=torch.float32, device=query.device)
        out_strides = out.stride()
        lse_strides = (lse.stride(0), lse.stride(2), lse.stride(1))
    _paged_causal_kernel[(h_q, row_blocks, n_splits)](
        q, kv, blocks, slots, out, lse,
        *q.stride(), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4),
        *out_strides, *lse_strides, q_len, s_len, per_split, scale * LOG2E,
        GROUP=h_q // h_kv, HEAD_DIM=head_dim, WIDEN=not q.is_cuda,
        IEEE=q.dtype == torch.float32, BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d)
    if n_splits > 1:
        out, lse = merge_stacked(out, lse)
        out, lse = out.to(query.dtype), lse.T
    return out, lse.reshape(h_kv, h_q // h_kv, q_len)


def _key_splits(programs: int, s_len: int, block: int, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split) of the context (flash-decoding) where the query rows alone give
    the device too few programs: one decode row per query head is 32 programs on 132 SMs. A
    prefill chunk of 64 rows or more fills the device and stays one split."""
    n_splits = split_count(programs, triton.cdiv(s_len, _MIN_SPLIT_KEYS), device, per_sm=4)
    per_split = triton.cdiv(triton.cdiv(s_len, n_splits), block) * block
    return triton.cdiv(s_len, per_split), per_split
