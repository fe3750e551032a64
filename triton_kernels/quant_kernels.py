"""Triton attention over KIVI-quantized token groups: unpack, dequantize, QK^T, online softmax
and PV fused, so the dequantized cache never reaches memory.

Reference and signature: vllm_shadowkv.core.quant_attention.quant_attention; layouts in
vllm_shadowkv.core.kivi. One program per (request, KV head, block of query rows, split of the
group table): its rows are all the GQA group's query heads times the query tokens, so each
group's K/V is read once per KV head and never expanded. Splits (flash-decoding) keep the GPU
busy at small batch; their partial results are merged by LSE. With ``logits_row`` the programs
also store that query row's logits (SpeCache's top-k from the same pass: the keys read and
dequantized once per step).

quant_logits (reference: vllm_shadowkv.core.mixed_attention.quant_logits) is the QK^T half
alone, for SpeCache's top-k: one program per (request, KV head, table entry).
"""

import torch
import triton
import triton.language as tl

from vllm_shadowkv.core.attention import merge_stacked
from vllm_shadowkv.core.kivi import KiviFormat, QuantizedGroups
from vllm_shadowkv.core.quant_attention import longest

from .splits import split_count

_MIN_DOT = 16  # tl.dot needs every dimension >= 16
_MAX_ROWS = 64  # query rows per program
# Launch settings, an H200's best (benchmarks/bench_quant_attention.py --sweep). A loop step
# takes whole token groups, at least MIN_GROUPS_PER_STEP, several only where the group is a
# power of two: the loop is bound by the latency of its dependent loads (table entry, then the
# group), not by bandwidth.
TOKENS_PER_STEP = 128
MIN_GROUPS_PER_STEP = 2
NUM_WARPS = 4
PROGRAMS_PER_SM = 8
# 16-bit queries on CUDA: the dequantized tiles and P in their dtype for the dots, fp32
# accumulation, as FlashAttention does (1.2-1.3x faster than tf32 dots on fp32 tiles on an
# H200). Triton's CPU interpreter mishandles bf16 operands of tl.dot: fp32 there.
DOT_16BIT = True


@triton.jit
def _dequant_tile(code_rows, scale_rows, zero_rows, t_mask, g_mask, offs_d, d_mask, s_w, s_pd,
                  PARAM_PER_TOKEN: tl.constexpr, PARAM_CHANNELS: tl.constexpr,
                  PARAM_BLOCKS: tl.constexpr, BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # [BLOCK_T, BLOCK_D] fp32 tile of GROUPS token groups of one KV head, BLOCK_T // GROUPS
    # token rows each. code_rows [BLOCK_T]: each token's first code word; channel c's code is
    # at word c // per_word, bits (c % per_word) * BITS. Keys: scale_rows/zero_rows [GROUPS],
    # each group's [channels] row, spread over its tokens. Values: [BLOCK_T], each token's
    # [channel groups] row. Scale and zero share their strides. Each word, scale and zero is
    # loaded once and spread over its channels in registers: a load per channel made the
    # kernel bound by L1 requests (92 % of L1, 1.5 % of DRAM on an H200).
    per_word: tl.constexpr = 32 // BITS
    offs_w = tl.arange(0, BLOCK_D // per_word)
    words = tl.load(code_rows[:, None] + offs_w[None, :] * s_w,
                    mask=t_mask[:, None] & (offs_w < HEAD_DIM // per_word)[None, :], other=0)
    shifts = tl.arange(0, per_word) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, [BLOCK_T, BLOCK_D]).to(tl.float32)
    if not PARAM_PER_TOKEN:  # keys: one [channels] row per group
        at = offs_d[None, :] * s_pd
        mask = g_mask[:, None] & d_mask[None, :]
        shape: tl.constexpr = [GROUPS, BLOCK_T // GROUPS, BLOCK_D]
        scale = tl.load(scale_rows[:, None] + at, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_rows[:, None] + at, mask=mask, other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], shape), [BLOCK_T, BLOCK_D])
        zero = tl.reshape(tl.broadcast_to(zero[:, None, :], shape), [BLOCK_T, BLOCK_D])
        return codes * scale + zero
    elif PARAM_BLOCKS:  # values, channel groups tiling BLOCK_D: [tokens, groups] spread
        offs_p = tl.arange(0, BLOCK_D // PARAM_CHANNELS)
        at = offs_p[None, :] * s_pd
        mask = t_mask[:, None] & (offs_p < HEAD_DIM // PARAM_CHANNELS)[None, :]
        shape: tl.constexpr = [BLOCK_T, BLOCK_D // PARAM_CHANNELS, PARAM_CHANNELS]
        scale = tl.load(scale_rows[:, None] + at, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_rows[:, None] + at, mask=mask, other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], shape), [BLOCK_T, BLOCK_D])
        zero = tl.reshape(tl.broadcast_to(zero[:, :, None], shape), [BLOCK_T, BLOCK_D])
        return codes * scale + zero
    else:  # values, any other channel group: one load per channel
        at = (offs_d // PARAM_CHANNELS)[None, :] * s_pd
        mask = t_mask[:, None] & d_mask[None, :]
        scale = tl.load(scale_rows[:, None] + at, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_rows[:, None] + at, mask=mask, other=0.0).to(tl.float32)
        return codes * scale + zero


@triton.jit
def _quant_attention_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, count_ptr,
    out_ptr, lse_ptr, logits_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kcn, s_kch, s_kct, s_kcw, s_kpn, s_kph, s_kpd,
    s_vcn, s_vch, s_vct, s_vcw, s_vpn, s_vph, s_vpt, s_vpd,
    s_tb, s_tj, s_lb, s_lh, groups_per_split, scale,
    H_KV: tl.constexpr, GROUP: tl.constexpr, S_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    TOKENS: tl.constexpr, VALUE_GROUP: tl.constexpr, VALUE_BLOCKS: tl.constexpr,
    BITS: tl.constexpr, IEEE: tl.constexpr, DOT_16BIT: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    LOGITS_ROW: tl.constexpr,  # -1: no logits stored
):
    pid_bh = tl.program_id(0)
    row_blk = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    rows: tl.constexpr = GROUP * S_Q
    offs_r = row_blk * BLOCK_R + tl.arange(0, BLOCK_R)  # row r = query head (r // S_Q), token
    r_mask = offs_r < rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # A loop step takes GROUPS table entries, BLOCK_T // GROUPS token rows each.
    offs_g = tl.arange(0, GROUPS)
    offs_t = tl.arange(0, BLOCK_T)
    slot = offs_t // (BLOCK_T // GROUPS)
    token = offs_t % (BLOCK_T // GROUPS)

    head = h * GROUP + offs_r // S_Q
    q = tl.load(q_ptr + b * s_qb + (offs_r % S_Q)[:, None] * s_qs + head[:, None] * s_qh
                + offs_d[None, :] * s_qd, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if not DOT_16BIT:  # else FlashAttention's precision: 16-bit tiles, fp32 accumulation
        q = q.to(tl.float32)
    precision: tl.constexpr = "ieee" if IEEE else "tf32"

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    count = tl.load(count_ptr + b)
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, count)
    table = table_ptr + b * s_tb
    for j in range(first, last, GROUPS):
        g_mask = j + offs_g < last
        t_mask = (token < TOKENS) & (j + slot < last)
        gid = tl.load(table + (j + offs_g) * s_tj, mask=g_mask, other=0).to(tl.int64)
        gid_t = tl.load(table + (j + slot) * s_tj, mask=t_mask, other=0).to(tl.int64)
        k_param = gid * s_kpn + h * s_kph
        k = _dequant_tile(kc_ptr + gid_t * s_kcn + h * s_kch + token * s_kct,
                          ks_ptr + k_param, kz_ptr + k_param, t_mask, g_mask, offs_d, d_mask,
                          s_kcw, s_kpd, False, 1, False, BITS, HEAD_DIM, GROUPS, BLOCK_T,
                          BLOCK_D)
        if DOT_16BIT:
            k = k.to(q.dtype)
        logits = tl.dot(q, tl.trans(k), input_precision=precision) * scale  # [R, T]
        if LOGITS_ROW >= 0:
            row_mask = r_mask & (offs_r % S_Q == LOGITS_ROW)
            tl.store(logits_ptr + b * s_lb + head[:, None] * s_lh
                     + ((j + slot) * TOKENS + token)[None, :], logits,
                     mask=row_mask[:, None] & t_mask[None, :])
        logits = tl.where(t_mask[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))  # finite: entry j has a token
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        v_param = gid_t * s_vpn + h * s_vph + token * s_vpt
        v = _dequant_tile(vc_ptr + gid_t * s_vcn + h * s_vch + token * s_vct,
                          vs_ptr + v_param, vz_ptr + v_param, t_mask, g_mask, offs_d, d_mask,
                          s_vcw, s_vpd, True, VALUE_GROUP, VALUE_BLOCKS, BITS, HEAD_DIM,
                          GROUPS, BLOCK_T, BLOCK_D)
        if DOT_16BIT:
            p, v = p.to(q.dtype), v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=precision)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    # Partial results [B, h_kv, n_splits, rows, d]; an empty split gives out 0, lse -inf.
    l_safe = tl.maximum(l_i, 1e-30)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.log(l_safe), float("-inf"))
    slot_out = (pid_bh * n_splits + split).to(tl.int64) * rows + offs_r
    tl.store(out_ptr + slot_out[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=r_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + slot_out, lse, mask=r_mask)


@triton.jit
def _quant_logits_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, table_ptr, count_ptr, out_ptr,
    s_qb, s_qh, s_qd, s_kcn, s_kch, s_kct, s_kcw, s_kpn, s_kph, s_kpd, s_tb, s_tj,
    s_ob, s_oh, scale,
    H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
    BITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (request, KV head, table entry): the group's query heads against the
    # entry's dequantized keys; entries past the request's count are written -inf.
    pid_bh = tl.program_id(0)
    j = tl.program_id(1)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < TOKENS
    out = (out_ptr + b * s_ob + (h * GROUP + offs_r)[:, None] * s_oh
           + (j * TOKENS + offs_t)[None, :])
    out_mask = r_mask[:, None] & t_mask[None, :]
    if j >= tl.load(count_ptr + b):
        tl.store(out, tl.full([BLOCK_R, BLOCK_T], float("-inf"), dtype=tl.float32),
                 mask=out_mask)
    else:
        q = tl.load(q_ptr + b * s_qb + (h * GROUP + offs_r)[:, None] * s_qh
                    + offs_d[None, :] * s_qd, mask=r_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        gid = tl.load(table_ptr + b * s_tb + j * s_tj).to(tl.int64)
        one = tl.arange(0, 1)  # the tile's single group
        k_param = gid * s_kpn + h * s_kph + one
        k = _dequant_tile(kc_ptr + gid * s_kcn + h * s_kch + offs_t * s_kct,
                          ks_ptr + k_param, kz_ptr + k_param, t_mask, one == 0, offs_d,
                          d_mask, s_kcw, s_kpd, False, 1, False, BITS, HEAD_DIM, 1, BLOCK_T,
                          BLOCK_D)
        precision: tl.constexpr = "ieee" if IEEE else "tf32"
        logits = tl.dot(q, tl.trans(k), input_precision=precision) * scale  # [R, T]
        tl.store(out, logits, mask=out_mask)


def groups_per_step(group: int, tokens_per_step: int, min_groups: int) -> int:
    """Token groups a loop step of the attention kernel takes: ``tokens_per_step`` worth, at
    least ``min_groups``; one where the group is not a power of two (its tile is padded)."""
    if group != max(_MIN_DOT, triton.next_power_of_2(group)):
        return 1
    return max(min_groups, tokens_per_step // group)


def quant_attention(q, groups, group_table, group_count, fmt: KiviFormat, scale,
                    logits_row=None, most_groups=None):
    batch, s_q, h_q, head_dim = q.shape
    kc, ks, kz, vc, vs, vz = groups
    n_pool, h_kv, tokens, words = kc.shape
    assert isinstance(groups, QuantizedGroups) and h_q % h_kv == 0
    assert head_dim == fmt.head_dim and tokens == fmt.group and words == fmt.words_per_token
    assert ks.shape == kz.shape == (n_pool, h_kv, head_dim) and vc.shape == kc.shape
    assert vs.shape == vz.shape == (n_pool, h_kv, tokens, head_dim // fmt.value_group)
    assert ks.stride() == kz.stride() and vs.stride() == vz.stride()
    assert group_table.dim() == 2 and group_table.shape[0] == batch
    assert group_count.shape == (batch,) and group_count.is_contiguous()
    assert group_table.dtype == group_count.dtype == kc.dtype == vc.dtype == torch.int32
    assert all(t.device == q.device for t in (*groups, group_table, group_count))
    group = h_q // h_kv
    rows = group * s_q
    max_groups = group_table.shape[1]
    group_tokens = max(_MIN_DOT, triton.next_power_of_2(tokens))  # one group's token rows
    n_groups = groups_per_step(tokens, TOKENS_PER_STEP, MIN_GROUPS_PER_STEP)
    steps = triton.cdiv(max_groups, n_groups)
    n_splits = split_count(batch * h_kv, steps, q.device, PROGRAMS_PER_SM)  # >= 1 step each
    block_r = max(_MIN_DOT, min(_MAX_ROWS, triton.next_power_of_2(rows)))
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    part_out = torch.empty(batch, h_kv, n_splits, rows, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(batch, h_kv, n_splits, rows, dtype=torch.float32, device=q.device)
    if logits_row is not None:
        assert 0 <= logits_row < s_q
        # The contract's width (the longest request's tokens): read from the device (a host
        # wait) unless the caller knows it; the tokens past a request's count stay -inf.
        width = longest(group_count, most_groups)
        logits = torch.full((batch, h_q, width * tokens), float("-inf"), dtype=torch.float32,
                            device=q.device)
    else:
        logits = part_lse  # never written: LOGITS_ROW = -1
    grid = (batch * h_kv, triton.cdiv(rows, block_r), n_splits)
    _quant_attention_kernel[grid](
        q, kc, ks, kz, vc, vs, vz, group_table, group_count, part_out, part_lse, logits,
        *q.stride(), *kc.stride(), *ks.stride(), *vc.stride(), *vs.stride(),
        *group_table.stride(), *logits.stride()[:2],
        triton.cdiv(steps, n_splits) * n_groups, scale,
        H_KV=h_kv, GROUP=group, S_Q=s_q, HEAD_DIM=head_dim, TOKENS=tokens,
        VALUE_GROUP=fmt.value_group, VALUE_BLOCKS=block_d % fmt.value_group == 0
        and fmt.value_group == triton.next_power_of_2(fmt.value_group),
        BITS=fmt.bits, IEEE=q.dtype == torch.float32,
        DOT_16BIT=DOT_16BIT and q.is_cuda and q.dtype != torch.float32, GROUPS=n_groups,
        BLOCK_R=block_r, BLOCK_T=n_groups * group_tokens, BLOCK_D=block_d,
        LOGITS_ROW=-1 if logits_row is None else logits_row, num_warps=NUM_WARPS)
    out, lse = merge_stacked(part_out.movedim(2, 0), part_lse.movedim(2, 0))
    # [B, h_kv, group, s_q, ...] -> [B, s_q, h_q, ...]
    out = out.view(batch, h_kv, group, s_q, head_dim).permute(0, 3, 1, 2, 4)
    lse = lse.view(batch, h_kv, group, s_q).permute(0, 3, 1, 2)
    out, lse = out.reshape(batch, s_q, h_q, head_dim).to(q.dtype), lse.reshape(batch, s_q, h_q)
    return (out, lse) if logits_row is None else (out, lse, logits)


def quant_logits(q, groups, group_table, group_count, fmt: KiviFormat, scale,
                 most_groups=None):
    batch, h_q, head_dim = q.shape
    kc, ks, kz = groups.key_codes, groups.key_scale, groups.key_zero
    n_pool, h_kv, tokens, words = kc.shape
    assert h_q % h_kv == 0 and head_dim == fmt.head_dim and tokens == fmt.group
    assert words == fmt.words_per_token and ks.shape == kz.shape == (n_pool, h_kv, head_dim)
    assert ks.stride() == kz.stride() and group_table.shape[0] == batch
    assert group_count.shape == (batch,) and group_count.is_contiguous()
    assert group_table.dtype == group_count.dtype == kc.dtype == torch.int32
    # The contract's width (the longest request's tokens), as quant_attention takes it; the
    # logits of a step are then one launch.
    width = longest(group_count, most_groups)
    out = torch.empty(batch, h_q, width * tokens, dtype=torch.float32, device=q.device)
    if width == 0:
        return out
    group = h_q // h_kv
    _quant_logits_kernel[(batch * h_kv, width)](
        q, kc, ks, kz, group_table, group_count, out,
        *q.stride(), *kc.stride(), *ks.stride(), *group_table.stride(), *out.stride()[:2], scale,
        H_KV=h_kv, GROUP=group, HEAD_DIM=head_dim, TOKENS=tokens, BITS=fmt.bits,
        IEEE=q.dtype == torch.float32, BLOCK_R=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_T=max(_MIN_DOT, triton.next_power_of_2(tokens)),
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)))
    return out
