"""Filling the slots of missed chunks: keys rebuilt from A·B + RoPE, values from a staging buffer.

Torch references of the kernels in vllm_shadowkv.triton_kernels.rebuild_kernels (same
signatures). Both write in place and touch only the first miss_count[b, h] slots in
miss_slots[b, h]. ``copy_rows`` is the row scatter that slots and pages are written with (its
compiled CPU kernel: cpu_kernels.copy_rows).
"""

import torch

from .rope import RopeCache, apply_rope


def _misses(miss_slots: torch.Tensor, miss_count: torch.Tensor, width: int):
    """(valid [B, h, width] bool, slots [B, h, width] long clamped to >= 0)."""
    valid = torch.arange(width, device=miss_slots.device) < miss_count.unsqueeze(-1)
    return valid, miss_slots[..., :width].long().clamp_min(0)


def rebuild_keys(
    a: torch.Tensor,
    a_rows: torch.Tensor,
    a_positions: torch.Tensor,
    a_start: torch.Tensor,
    b: torch.Tensor,
    slot_chunks: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    rope: RopeCache,
    slot_k: torch.Tensor,
    slot_index: torch.Tensor | None = None,
) -> None:
    """slot_k[b, h, s*c:(s+1)*c] = RoPE(A[rows of chunk slot_chunks[b, h, s]] @ B[b, h]) for each
    missed slot s.

    Request b's token t is pool row a_start[b] + t, held in row a_rows[pool row] of a [NA, r]
    (any strides: in the engine, rows of pages); a_rows [TA] int64; a_positions [TA] int32; b
    [B, h_kv, r, d]; slot_chunks/miss_slots [B, h_kv, k] int32; miss_count [B, h_kv];
    slot_k [B, h_kv, k*c, d]. With ``slot_index`` [B, h_kv, k, c] int64, slot_k is ``[N, d]``
    rows (in the engine: of the layer's pages) and token t of slot (b, h, s) is row
    slot_index[b, h, s, t].
    """
    batch, h_kv, k = slot_chunks.shape
    c = slot_index.shape[-1] if slot_index is not None else slot_k.shape[2] // k
    width = int(miss_count.max()) if miss_count.numel() else 0
    if width == 0:
        return
    valid, slots = _misses(miss_slots, miss_count, width)
    chunks = slot_chunks.long().gather(-1, slots).clamp_min(0)  # [B, h, w]
    offsets = torch.arange(c, device=a.device)
    rows = (a_start.long().view(-1, 1, 1, 1) + chunks.unsqueeze(-1) * c + offsets)  # [B,h,w,c]
    rows = torch.where(valid.unsqueeze(-1), rows, 0).flatten(2)  # [B, h, w*c]
    keys_pre = torch.matmul(a[a_rows[rows]].float(), b.float())  # [B, h, w*c, d]
    keys = apply_rope(keys_pre.reshape(-1, 1, keys_pre.shape[-1]),
                      a_positions[rows.flatten()], rope)
    if slot_index is not None:
        chunk_keys = keys.view(*valid.shape, c, keys.shape[-1])
        rows = slot_index.gather(2, slots.unsqueeze(-1).expand(-1, -1, -1, c))  # [B, h, w, c]
        slot_k[rows[valid]] = chunk_keys[valid].to(slot_k.dtype)
        return
    dest = (slots.unsqueeze(-1) * c + offsets).flatten(2)  # [B, h, w*c]
    keep = valid.unsqueeze(-1).expand(-1, -1, -1, c).flatten(2)
    bi, hi, _ = torch.meshgrid(*(torch.arange(n, device=a.device) for n in dest.shape),
                               indexing="ij")
    slot_k[bi[keep], hi[keep], dest[keep]] = keys.view(keys_pre.shape)[keep].to(slot_k.dtype)


def scatter_values(
    staging: torch.Tensor,
    staging_start: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    slot_v: torch.Tensor,
) -> None:
    """slot_v[b, h, s*c:(s+1)*c] = staging[staging_start[b, h] + m] for the m-th miss slot s.

    staging [M, c, d] holds the gathered value rows of all misses, (b, h, m) in row-major order;
    staging_start [B, h_kv] int32 (exclusive cumsum of miss_count); slot_v [B, h_kv, k*c, d].
    """
    batch, h_kv, k = miss_slots.shape
    c = staging.shape[1]
    width = int(miss_count.max()) if miss_count.numel() else 0
    if width == 0:
        return
    valid, slots = _misses(miss_slots, miss_count, width)
    src = staging_start.long().unsqueeze(-1) + torch.arange(width, device=staging.device)
    bi, hi, _ = torch.meshgrid(*(torch.arange(n, device=staging.device) for n in slots.shape),
                               indexing="ij")
    view = slot_v.unflatten(2, (k, c))
    view[bi[valid], hi[valid], slots[valid]] = staging[src[valid]].to(slot_v.dtype)


def copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
              src_index: torch.Tensor | None = None) -> None:
    """dst[index[i]] = src[src_index[i]] (src[i] without ``src_index``), converted to dst's
    dtype. dst [N, ...] is written in place; the rows of ``index`` are distinct."""
    rows = src if src_index is None else src.index_select(0, src_index)
    dst.index_copy_(0, index, rows.to(dst.dtype))
