"""Triton kernel for TailorKV's partial scores over the critical channels, reading the
channel-major key copy where the host store keeps it.

On CUDA the store's pages are pinned host memory: the kernel loads them through the unified
address space (zero-copy, as the paper's GPU gathers do), so choosing the channels, reading their
rows and scoring never wait for the host. Each load is one contiguous run of ``CHUNK`` tokens of
one channel.

Reference and signature: vllm_shadowkv.core.critical_channels.channel_scores_paged.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _channel_scores_paged_kernel(
    q_ptr, pool_ptr, page_offset_ptr, page_start_ptr, channels_ptr, prompt_len_ptr, out_ptr,
    stride_qb, stride_qh, stride_qd, stride_cb, stride_ch, stride_cc,
    stride_ob, stride_oh, stride_on,
    sink, recent, max_len, head_dim, page_rows,
    H_KV: tl.constexpr, GROUP: tl.constexpr, D_S: tl.constexpr, BLOCK_C: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One chunk of tokens of one (request, KV head): the d_s channel rows holding it against
    # the group-summed query at those channels.
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    n = tl.load(prompt_len_ptr + b)
    hi = tl.minimum(n - recent, max_len)
    offs_n = blk * CHUNK + tl.arange(0, CHUNK)
    in_window = (offs_n >= sink) & (offs_n < hi)
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < D_S
    ch = tl.load(channels_ptr + b * stride_cb + h * stride_ch + offs_c * stride_cc,
                 mask=c_mask, other=0).to(tl.int64)
    q_crit = tl.zeros([BLOCK_C], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        q_crit += tl.load(q_ptr + b * stride_qb + (h * GROUP + g) * stride_qh + ch * stride_qd,
                          mask=c_mask, other=0.0).to(tl.float32)
    # Row of (h, channel, this chunk) in the request's key copy, then its page and place.
    chunks = (n + CHUNK - 1) // CHUNK
    row = (h.to(tl.int64) * head_dim + ch) * chunks + blk
    # The channels to read, none past the prompt or the window (a vector compare: the
    # interpreter rejects masks combined with a scalar condition).
    read = offs_c < tl.where((blk < chunks) & (blk * CHUNK < hi), D_S, 0)
    page = tl.load(page_start_ptr + b).to(tl.int64) + row // page_rows
    base = tl.load(page_offset_ptr + page, mask=read, other=0) + (row % page_rows) * CHUNK
    keys = tl.load(pool_ptr + base[:, None] + tl.arange(0, CHUNK)[None, :],
                   mask=read[:, None] & in_window[None, :], other=0.0).to(tl.float32)
    score = tl.sum(keys * q_crit[:, None], axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_n * stride_on,
             tl.where(in_window, score, float("-inf")), mask=offs_n < max_len)


def channel_scores_paged(q, pool, page_offset, page_start, channels, prompt_len, sink, recent,
                         max_len, chunk, page_rows):
    batch, h_q, head_dim = q.shape
    h_kv, d_s = channels.shape[1:]
    assert pool.dim() == 1 and h_q % h_kv == 0 and chunk == triton.next_power_of_2(chunk)
    assert channels.shape == (batch, h_kv, d_s) and channels.dtype == torch.int32
    assert page_start.shape == prompt_len.shape == (batch,)
    assert page_start.dtype == prompt_len.dtype == torch.int32
    assert page_offset.dtype == torch.int64
    assert q.device == page_offset.device == channels.device == page_start.device \
        == prompt_len.device
    out = torch.empty(batch, h_kv, max_len, dtype=torch.float32, device=q.device)
    if max_len == 0 or batch == 0:
        return out
    grid = (batch * h_kv, triton.cdiv(max_len, chunk))
    _channel_scores_paged_kernel[grid](
        q, pool, page_offset, page_start, channels, prompt_len, out,
        *q.stride(), *channels.stride(), *out.stride(),
        sink, recent, max_len, head_dim, page_rows,
        H_KV=h_kv, GROUP=h_q // h_kv, D_S=d_s, BLOCK_C=triton.next_power_of_2(d_s),
        CHUNK=chunk)
    return out
