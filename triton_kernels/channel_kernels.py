"""Triton kernel for TailorKV's partial scores over the critical channels of channel-major keys.

Reference and signature: vllm_shadowkv.core.critical_channels.channel_scores.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _channel_scores_kernel(
    q_ptr, keys_ptr, channels_ptr, key_start_ptr, prompt_len_ptr, out_ptr,
    stride_qb, stride_qh, stride_qd, stride_kh, stride_kd, stride_kn,
    stride_cb, stride_ch, stride_cc, stride_ob, stride_oh, stride_on,
    sink, recent, max_len,
    H_KV: tl.constexpr, GROUP: tl.constexpr, D_S: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # One block of tokens of one (request, KV head): d_s channel rows of the keys (contiguous
    # along the tokens) against the group-summed query at those channels.
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    start = tl.load(key_start_ptr + b).to(tl.int64)
    hi = tl.minimum(tl.load(prompt_len_ptr + b) - recent, max_len)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_window = (offs_n >= sink) & (offs_n < hi)
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < D_S
    ch = tl.load(channels_ptr + b * stride_cb + h * stride_ch + offs_c * stride_cc,
                 mask=c_mask, other=0).to(tl.int64)
    q_crit = tl.zeros([BLOCK_C], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        q_crit += tl.load(q_ptr + b * stride_qb + (h * GROUP + g) * stride_qh + ch * stride_qd,
                          mask=c_mask, other=0.0).to(tl.float32)
    keys = tl.load(keys_ptr + h.to(tl.int64) * stride_kh + ch[:, None] * stride_kd
                   + (start + offs_n)[None, :] * stride_kn,
                   mask=c_mask[:, None] & in_window[None, :], other=0.0).to(tl.float32)
    score = tl.sum(keys * q_crit[:, None], axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_n * stride_on,
             tl.where(in_window, score, float("-inf")), mask=offs_n < max_len)


def channel_scores(q, keys_cm, channels, key_start, prompt_len, sink, recent, max_len):
    batch, h_q, head_dim = q.shape
    h_kv = keys_cm.shape[0]
    d_s = channels.shape[-1]
    assert keys_cm.dim() == 3 and keys_cm.shape[1] == head_dim and h_q % h_kv == 0
    assert channels.shape == (batch, h_kv, d_s) and channels.dtype == torch.int32
    assert key_start.shape == prompt_len.shape == (batch,)
    assert key_start.dtype == prompt_len.dtype == torch.int32
    assert q.device == keys_cm.device == channels.device == key_start.device == prompt_len.device
    out = torch.empty(batch, h_kv, max_len, dtype=torch.float32, device=q.device)
    if max_len == 0 or batch == 0:
        return out
    block_n = 256
    grid = (batch * h_kv, triton.cdiv(max_len, block_n))
    _channel_scores_kernel[grid](
        q, keys_cm, channels, key_start, prompt_len, out,
        *q.stride(), *keys_cm.stride(), *channels.stride(), *out.stride(),
        sink, recent, max_len,
        H_KV=h_kv, GROUP=h_q // h_kv, D_S=d_s, BLOCK_N=block_n,
        BLOCK_C=triton.next_power_of_2(d_s))
    return out
