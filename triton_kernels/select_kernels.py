"""Triton kernels for chunk selection: landmark scores (softmax per query head, sum over query
tokens, max over the GQA group) and top-k per (request, KV head).

Reference and signatures: vllm_shadowkv.core.select.landmark_scores / select_chunks.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _landmark_logits_kernel(
    q_ptr, lm_ptr, lm_rows_ptr, lm_start_ptr, lm_count_ptr, logits_ptr, blk_max_ptr,
    blk_sum_ptr, stride_qb, stride_qs, stride_qh, stride_qd, stride_ln, stride_lh, stride_ld,
    stride_lr,
    max_count, n_blocks, scale,
    H_KV: tl.constexpr, GROUP: tl.constexpr, S_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Pass 1: raw logits of one block of landmarks for every (query head, query token) row of a
    # KV group, plus the block's max and sum of exp, for a split softmax over all landmarks.
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    start = tl.load(lm_start_ptr + b).to(tl.int64)
    count = tl.load(lm_count_ptr + b)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < count
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lm_row = tl.load(lm_rows_ptr + (start + offs_n) * stride_lr, mask=n_mask, other=0)
    lm = tl.load(lm_ptr + lm_row[:, None] * stride_ln + h * stride_lh
                 + offs_d[None, :] * stride_ld,
                 mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    for g in tl.static_range(GROUP):
        for s in tl.static_range(S_Q):
            row = g * S_Q + s
            qv = tl.load(q_ptr + b * stride_qb + s * stride_qs + (h * GROUP + g) * stride_qh
                         + offs_d * stride_qd, mask=d_mask, other=0.0).to(tl.float32)
            logit = tl.sum(lm * qv[None, :], axis=1) * scale
            logit = tl.where(n_mask, logit, float("-inf"))
            m = tl.max(logit, axis=0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            tl.store(logits_ptr + (pid_bh * (GROUP * S_Q) + row).to(tl.int64) * max_count + offs_n,
                     logit, mask=offs_n < max_count)
            stat = (pid_bh * n_blocks + blk) * (GROUP * S_Q) + row
            tl.store(blk_max_ptr + stat, m)
            tl.store(blk_sum_ptr + stat, tl.sum(tl.exp(logit - m_safe), axis=0))


@triton.jit
def _landmark_scores_kernel(
    logits_ptr, blk_max_ptr, blk_sum_ptr, lm_count_ptr, out_ptr,
    stride_ob, stride_oh, stride_on, max_count, n_blocks,
    H_KV: tl.constexpr, GROUP: tl.constexpr, S_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_BLK: tl.constexpr,
):
    # Pass 2: normalise each row by its global softmax statistics, sum the query tokens, take
    # the max over the group's query heads.
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    count = tl.load(lm_count_ptr + b)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < count
    offs_blk = tl.arange(0, BLOCK_BLK)
    blk_mask = offs_blk < n_blocks
    best = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(S_Q):
            row = g * S_Q + s
            stat = (pid_bh * n_blocks + offs_blk) * (GROUP * S_Q) + row
            maxes = tl.load(blk_max_ptr + stat, mask=blk_mask, other=float("-inf"))
            sums = tl.load(blk_sum_ptr + stat, mask=blk_mask, other=0.0)
            m = tl.max(maxes, axis=0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            total = tl.sum(sums * tl.exp(maxes - m_safe), axis=0)
            total = tl.where(total > 0.0, total, 1.0)  # a request without landmarks
            logit = tl.load(logits_ptr + (pid_bh * (GROUP * S_Q) + row).to(tl.int64) * max_count
                            + offs_n, mask=n_mask, other=float("-inf"))
            acc += tl.where(n_mask, tl.exp(logit - m_safe) / total, 0.0)
        best = tl.maximum(best, acc)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_n * stride_on,
             tl.where(n_mask, best, -1.0), mask=offs_n < max_count)


def landmark_scores(q, landmarks, lm_rows, lm_start, lm_count, max_count, scale):
    batch, s_q, h_q, head_dim = q.shape
    h_kv = landmarks.shape[1]
    assert landmarks.dim() == 3 and landmarks.shape[2] == head_dim and h_q % h_kv == 0
    assert lm_start.shape == lm_count.shape == (batch,)
    assert lm_rows.dim() == 1 and lm_rows.dtype == torch.int64
    assert lm_start.dtype == lm_count.dtype == torch.int32
    assert q.device == landmarks.device == lm_start.device == lm_count.device
    out = torch.full((batch, h_kv, max_count), -1.0, dtype=torch.float32, device=q.device)
    if max_count == 0:
        return out
    group, rows = h_q // h_kv, (h_q // h_kv) * s_q
    block_n = 128
    n_blocks = triton.cdiv(max_count, block_n)
    logits = torch.empty(batch * h_kv * rows, max_count, dtype=torch.float32, device=q.device)
    blk_max = torch.empty(batch * h_kv, n_blocks, rows, dtype=torch.float32, device=q.device)
    blk_sum = torch.empty_like(blk_max)
    grid = (batch * h_kv, n_blocks)
    _landmark_logits_kernel[grid](
        q, landmarks, lm_rows, lm_start, lm_count, logits, blk_max, blk_sum,
        *q.stride(), *landmarks.stride(), *lm_rows.stride(), max_count, n_blocks, scale,
        H_KV=h_kv, GROUP=group, S_Q=s_q, HEAD_DIM=head_dim,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim))
    _landmark_scores_kernel[grid](
        logits, blk_max, blk_sum, lm_count, out, *out.stride(), max_count, n_blocks,
        H_KV=h_kv, GROUP=group, S_Q=s_q, BLOCK_N=block_n,
        BLOCK_BLK=triton.next_power_of_2(n_blocks))
    return out


@triton.jit
def _select_chunks_kernel(
    scores_ptr, chunks_ptr, lm_start_ptr, lm_count_ptr, slot_count_ptr, out_ptr,
    stride_sb, stride_sh, stride_sn, stride_cn, stride_ch, stride_ob, stride_oh, stride_ok,
    k,
    H_KV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OWN: tl.constexpr,
):
    # Scores are >= 0, so their float bits order like ints: binary-search the bits of the
    # take-th largest score (t), then write every score > t and the first ties == t.
    pid_bh = tl.program_id(0)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    start = tl.load(lm_start_ptr + b).to(tl.int64)
    count = tl.load(lm_count_ptr + b)
    take = tl.minimum(count, k)
    if OWN:  # the request's own slots (its budget); the rest of its row is padding
        take = tl.minimum(take, tl.load(slot_count_ptr + b))
    row_ptr = scores_ptr + b * stride_sb + h * stride_sh
    out_row = out_ptr + b * stride_ob + h * stride_oh
    lo = tl.zeros((), dtype=tl.int32)
    hi = tl.full((), 0x7F800000, dtype=tl.int32)
    for _ in range(31):
        mid = lo + (hi - lo + 1) // 2
        n_ge = tl.zeros((), dtype=tl.int32)
        for n0 in range(0, count, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            mask = offs < count
            bits = tl.load(row_ptr + offs * stride_sn, mask=mask, other=0.0).to(tl.int32, bitcast=True)
            n_ge += tl.sum(((bits >= mid) & mask).to(tl.int32), axis=0)
        ok = n_ge >= take
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    written = tl.zeros((), dtype=tl.int32)
    for strict in tl.static_range(2):
        for n0 in range(0, count, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            mask = offs < count
            bits = tl.load(row_ptr + offs * stride_sn, mask=mask, other=0.0).to(tl.int32, bitcast=True)
            if strict == 0:
                sel = (bits > lo) & mask
            else:
                sel = (bits == lo) & mask
            pos = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            sel = sel & (pos < take)
            chunk = tl.load(chunks_ptr + (start + offs) * stride_cn + h * stride_ch, mask=sel)
            tl.store(out_row + pos * stride_ok, chunk, mask=sel)
            written += tl.sum(sel.to(tl.int32), axis=0)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_row + offs_k * stride_ok, tl.full([BLOCK_K], -1, tl.int32),
                 mask=(offs_k >= take) & (offs_k < k))


def select_chunks(scores, landmark_chunks, lm_start, lm_count, k, slot_count=None):
    batch, h_kv, max_count = scores.shape
    assert scores.dtype == torch.float32
    assert landmark_chunks.dim() == 2 and landmark_chunks.shape[1] == h_kv
    assert landmark_chunks.dtype == lm_start.dtype == lm_count.dtype == torch.int32
    assert lm_start.shape == lm_count.shape == (batch,)
    assert slot_count is None or (slot_count.dtype == torch.int32
                                  and slot_count.shape == (batch,))
    out = torch.empty(batch, h_kv, k, dtype=torch.int32, device=scores.device)
    _select_chunks_kernel[(batch * h_kv,)](
        scores, landmark_chunks, lm_start, lm_count,
        lm_count if slot_count is None else slot_count, out,
        *scores.stride(), *landmark_chunks.stride(), *out.stride(), k,
        H_KV=h_kv, BLOCK_N=1024, BLOCK_K=min(1024, triton.next_power_of_2(k)),
        OWN=slot_count is not None)
    return out
