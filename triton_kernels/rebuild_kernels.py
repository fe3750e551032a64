"""Triton kernels that fill the slots of missed chunks: fused gather of A rows + A·B + RoPE into
the key slots, and the copy of gathered value rows from a staging buffer into the value slots.

Reference and signatures: vllm_shadowkv.core.reconstruct.rebuild_keys / scatter_values.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rebuild_keys_kernel(
    a_ptr, a_rows_ptr, a_pos_ptr, a_start_ptr, b_ptr, slot_chunks_ptr, miss_slots_ptr,
    miss_count_ptr,
    cos_sin_ptr, out_ptr,
    stride_at, stride_ar, stride_aw, stride_ap,
    stride_bb, stride_bh, stride_br, stride_bd,
    stride_cb, stride_ch, stride_ck, stride_mb, stride_mh, stride_mk, stride_nb, stride_nh,
    stride_cp, stride_cd, stride_ob, stride_oh, stride_ot, stride_od,
    RANK: tl.constexpr, H_KV: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr, NEOX: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_T token rows of the missed chunks of one (request, KV head). Each output
    # column j needs its RoPE partner column too, so the A·B product is also taken against B's
    # columns permuted to the partners; out = x*cos + sign*x_partner*sin.
    pid_bh = tl.program_id(0)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    count = tl.load(miss_count_ptr + b * stride_nb + h * stride_nh)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    miss = offs_t // CHUNK
    j = offs_t % CHUNK
    t_mask = miss < count
    slot = tl.load(miss_slots_ptr + b * stride_mb + h * stride_mh + miss * stride_mk,
                   mask=t_mask, other=0)
    chunk = tl.load(slot_chunks_ptr + b * stride_cb + h * stride_ch + slot * stride_ck,
                    mask=t_mask, other=0)
    row = tl.load(a_start_ptr + b).to(tl.int64) + chunk.to(tl.int64) * CHUNK + j
    pos = tl.load(a_pos_ptr + row * stride_ap, mask=t_mask, other=0).to(tl.int64)
    a_row = tl.load(a_rows_ptr + row * stride_aw, mask=t_mask, other=0)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    half: tl.constexpr = ROT_DIM // 2
    rot = offs_d < ROT_DIM
    if NEOX:
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        freq = tl.where(first, offs_d, offs_d - half)
    else:
        first = (offs_d % 2) == 0
        partner = offs_d ^ 1
        freq = offs_d // 2
    partner = tl.where(rot, partner, offs_d)
    sign = tl.where(first, -1.0, 1.0)

    b_base = b_ptr + b * stride_bb + h * stride_bh
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    acc_partner = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    # bf16/fp16 tiles are widened to fp32 and multiplied as tf32: exact for 8-bit mantissas, on
    # tensor cores; fp32 inputs keep full precision (ieee).
    precision: tl.constexpr = "ieee" if IEEE else "tf32"
    for r0 in tl.static_range(0, RANK, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK
        a_tile = tl.load(a_ptr + a_row[:, None] * stride_at + offs_r[None, :] * stride_ar,
                         mask=t_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        w_mask = r_mask[:, None] & d_mask[None, :]
        b_tile = tl.load(b_base + offs_r[:, None] * stride_br + offs_d[None, :] * stride_bd,
                         mask=w_mask, other=0.0).to(tl.float32)
        b_partner = tl.load(b_base + offs_r[:, None] * stride_br + partner[None, :] * stride_bd,
                            mask=w_mask, other=0.0).to(tl.float32)
        acc += tl.dot(a_tile, b_tile, input_precision=precision)
        acc_partner += tl.dot(a_tile, b_partner, input_precision=precision)

    cs_mask = t_mask[:, None] & rot[None, :]
    cs_row = cos_sin_ptr + pos[:, None] * stride_cp
    cos = tl.load(cs_row + freq[None, :] * stride_cd, mask=cs_mask, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + (half + freq)[None, :] * stride_cd, mask=cs_mask, other=0.0).to(tl.float32)
    keys = acc * cos + sign[None, :] * acc_partner * sin
    dest = slot.to(tl.int64) * CHUNK + j
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dest[:, None] * stride_ot
             + offs_d[None, :] * stride_od,
             keys.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & d_mask[None, :])


def rebuild_keys(a, a_rows, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, rope,
                 slot_k):
    batch, h_kv, k = slot_chunks.shape
    rank, head_dim = b.shape[2], b.shape[3]
    chunk = slot_k.shape[2] // k
    assert a.dim() == 2 and a.shape[1] == rank and a_positions.shape == a_rows.shape
    assert a_rows.dtype == torch.int64 and a_rows.dim() == 1
    assert b.shape[:2] == (batch, h_kv) and a_start.shape == (batch,)
    assert slot_k.shape == (batch, h_kv, k * chunk, head_dim) and a.dtype == b.dtype
    assert miss_slots.shape == slot_chunks.shape and miss_count.shape == (batch, h_kv)
    assert all(t.dtype == torch.int32 for t in (a_positions, a_start, slot_chunks, miss_slots,
                                                 miss_count))
    assert rope.rotary_dim <= head_dim
    cos_sin = rope.cos_sin_cache
    block_t = 64
    grid = (batch * h_kv, triton.cdiv(k * chunk, block_t))
    _rebuild_keys_kernel[grid](
        a, a_rows, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, cos_sin, slot_k,
        *a.stride(), *a_rows.stride(), *a_positions.stride(), *b.stride(), *slot_chunks.stride(),
        *miss_slots.stride(), *miss_count.stride(), *cos_sin.stride(), *slot_k.stride(),
        RANK=rank, H_KV=h_kv, CHUNK=chunk, HEAD_DIM=head_dim, ROT_DIM=rope.rotary_dim,
        NEOX=rope.is_neox_style, IEEE=a.dtype == torch.float32,
        BLOCK_T=block_t, BLOCK_R=32, BLOCK_D=max(16, triton.next_power_of_2(head_dim)))


@triton.jit
def _scatter_values_kernel(
    staging_ptr, staging_start_ptr, miss_slots_ptr, miss_count_ptr, out_ptr,
    stride_sm, stride_sc, stride_sd, stride_tb, stride_th, stride_mb, stride_mh, stride_mk,
    stride_nb, stride_nh, stride_ob, stride_oh, stride_ot, stride_od,
    H_KV: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    m = tl.program_id(1)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    if m < tl.load(miss_count_ptr + b * stride_nb + h * stride_nh):
        slot = tl.load(miss_slots_ptr + b * stride_mb + h * stride_mh + m * stride_mk).to(tl.int64)
        src = tl.load(staging_start_ptr + b * stride_tb + h * stride_th).to(tl.int64) + m
        offs_c = tl.arange(0, BLOCK_C)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_c < CHUNK)[:, None] & (offs_d < HEAD_DIM)[None, :]
        rows = tl.load(staging_ptr + src * stride_sm + offs_c[:, None] * stride_sc
                       + offs_d[None, :] * stride_sd, mask=mask)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + (slot * CHUNK + offs_c)[:, None] * stride_ot
                 + offs_d[None, :] * stride_od, rows.to(out_ptr.dtype.element_ty), mask=mask)


def scatter_values(staging, staging_start, miss_slots, miss_count, slot_v):
    batch, h_kv, k = miss_slots.shape
    _, chunk, head_dim = staging.shape
    assert slot_v.shape == (batch, h_kv, k * chunk, head_dim)
    assert staging_start.shape == miss_count.shape == (batch, h_kv)
    assert staging.device == slot_v.device == miss_slots.device
    assert all(t.dtype == torch.int32 for t in (staging_start, miss_slots, miss_count))
    _scatter_values_kernel[(batch * h_kv, k)](
        staging, staging_start, miss_slots, miss_count, slot_v,
        *staging.stride(), *staging_start.stride(), *miss_slots.stride(), *miss_count.stride(),
        *slot_v.stride(), H_KV=h_kv, CHUNK=chunk, HEAD_DIM=head_dim,
        BLOCK_C=triton.next_power_of_2(chunk), BLOCK_D=triton.next_power_of_2(head_dim))
