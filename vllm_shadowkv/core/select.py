"""Chunk selection for decode: landmark scores, top-k per KV head, slot assignment (hit cache).

`landmark_scores` and `select_chunks` are the torch references of the Triton kernels in
vllm_shadowkv.triton_kernels.select_kernels (same signatures); `assign_slots` is vectorised torch
used on CUDA. On the CPU, `landmark_scores`, `select_slots` (selection and assignment) and
`list_misses` are the references of the C kernels (core/native.py).
"""

import torch

from . import transfer


def landmark_scores(
    q: torch.Tensor,
    landmarks: torch.Tensor,
    lm_rows: torch.Tensor,
    lm_start: torch.Tensor,
    lm_count: torch.Tensor,
    max_count: int,
    scale: float,
) -> torch.Tensor:
    """Chunk scores per KV head, [B, h_kv, max_count] fp32; -1 past a request's count.

    q [B, s_q, h_q, d] post-RoPE; request b owns pool rows [lm_start[b], lm_start[b] +
    lm_count[b]), pool row i held in row lm_rows[i] (int64) of landmarks [N, h_kv, d] (any
    strides: in the engine, rows of pages). Per query head: softmax over the request's
    landmarks (fp32, scale 1/sqrt(d) in the paper); summed over the s_q query tokens; max over
    the query heads of each KV head (GQA).
    """
    batch, s_q, h_q, head_dim = q.shape
    h_kv = landmarks.shape[1]
    out = q.new_full((batch, h_kv, max_count), -1.0, dtype=torch.float32)
    for i, (start, count) in enumerate(zip(lm_start.tolist(), lm_count.tolist())):
        if count == 0:
            continue
        lm = landmarks[lm_rows[start:start + count]].float()  # [n, h_kv, d]
        qg = q[i].float().view(s_q, h_kv, h_q // h_kv, head_dim)
        probs = torch.softmax(torch.einsum("shgd,nhd->hgsn", qg, lm) * scale, dim=-1)
        out[i, :, :count] = probs.sum(dim=2).amax(dim=1)
    return out


def sink_recent_scores(
    landmark_chunks: torch.Tensor, lm_start: torch.Tensor, lm_count: torch.Tensor, max_count: int
) -> torch.Tensor:
    """The naive baseline's scores, same shape and padding as `landmark_scores`: chunk 0 (the
    attention sinks) first, then the others by recency, whatever the query."""
    batch = lm_start.shape[0]
    idx = torch.arange(max_count, device=landmark_chunks.device)
    valid = idx < lm_count.view(-1, 1)  # [B, n]
    rows = (lm_start.view(-1, 1) + idx).clamp(max=landmark_chunks.shape[0] - 1)
    chunks = landmark_chunks[rows.long()].transpose(1, 2).float()  # [B, h_kv, n]
    scores = torch.where(chunks == 0, float(2**24), chunks + 1.0)
    return torch.where(valid.view(batch, 1, max_count), scores, -1.0)


def select_chunks(
    scores: torch.Tensor,
    landmark_chunks: torch.Tensor,
    lm_start: torch.Tensor,
    lm_count: torch.Tensor,
    k: int,
    slot_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k landmarks per (request, KV head) -> their chunk ids [B, h_kv, k] int32.

    Request b selects min(k, lm_count[b], slot_count[b]) chunks (``slot_count`` [B]: the slots
    request b owns, its budget; None: k); the rest of its row is -1. The order of the selected
    ids within a row is unspecified (it is a set).
    """
    batch, h_kv, max_count = scores.shape
    out = torch.full((batch, h_kv, k), -1, dtype=torch.int32, device=scores.device)
    take = min(k, max_count)
    if take == 0:
        return out
    idx = torch.topk(scores, take, dim=-1).indices  # [B, h, take]
    valid = idx < lm_count.view(-1, 1, 1)
    if slot_count is not None:  # topk's order is by score: the first slot_count[b] win
        valid &= torch.arange(take, device=scores.device) < slot_count.view(-1, 1, 1)
    rows = (lm_start.view(-1, 1, 1) + idx).clamp(max=landmark_chunks.shape[0] - 1)
    heads = torch.arange(h_kv, device=scores.device).view(1, -1, 1)
    chunks = landmark_chunks[rows.long(), heads]
    out[..., :take] = torch.where(valid, chunks.to(torch.int32), -1)
    return out


def assign_slots(
    slot_chunks: torch.Tensor, selected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The upstream hit-cache policy: a selected chunk already resident stays in its slot; the
    misses take the freed slots, lowest slot first, in selection order.

    slot_chunks [B, h_kv, k] int32 resident chunk per slot (-1 empty); selected [B, h_kv, k] int32
    (-1 = none). -> (new slot_chunks, miss_slots [B, h_kv, k] int32 whose first miss_count
    entries are the slots to fill, -1 after; miss_count [B, h_kv] int32).
    """
    k = slot_chunks.shape[-1]
    sel_valid = selected >= 0
    # Each selected chunk looked up among the resident ones by binary search (O(k log k) per
    # KV head; comparing all pairs cost 1.3 ms per layer and step at k = 256).
    resident, resident_slot = slot_chunks.sort(dim=-1)
    at = torch.searchsorted(resident, selected.contiguous()).clamp_max(k - 1)
    hit = sel_valid & (resident.gather(-1, at) == selected)  # per selected entry
    keep = torch.zeros_like(slot_chunks).scatter_add_(  # per slot
        -1, resident_slot.gather(-1, at), hit.to(slot_chunks.dtype)) > 0
    miss = sel_valid & ~hit
    miss_count = miss.sum(dim=-1)
    # Stable sorts put the misses (and the free slots) first, each in their original order.
    miss_chunks = selected.gather(-1, torch.sort((~miss).to(torch.int8), dim=-1, stable=True).indices)
    free_slots = torch.sort(keep.to(torch.int8), dim=-1, stable=True).indices
    used = torch.arange(k, device=selected.device) < miss_count.unsqueeze(-1)
    # Writing -1 past miss_count also clears evicted slots; kept slots are restored after.
    new_slots = slot_chunks.scatter(-1, free_slots, torch.where(used, miss_chunks, -1))
    new_slots = torch.where(keep, slot_chunks, new_slots)
    miss_slots = torch.where(used, free_slots, -1)
    return new_slots.to(torch.int32), miss_slots.to(torch.int32), miss_count.to(torch.int32)


def select_slots(
    scores: torch.Tensor,
    landmark_chunks: torch.Tensor,
    lm_start: torch.Tensor,
    lm_count: torch.Tensor,
    k: int,
    slot_chunks: torch.Tensor,
    slot_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`select_chunks` then `assign_slots`: a step's selection and refill plan, with the
    selected chunks taking the free slots in order of score (reference of
    native.select_slots). The misses take the lowest free slots, so a request's padding slots
    (from ``slot_count[b]`` on, empty) stay empty."""
    return assign_slots(slot_chunks, select_chunks(scores, landmark_chunks, lm_start, lm_count, k,
                                                   slot_count))


def list_misses(
    slot_chunks: torch.Tensor, miss_slots: torch.Tensor, miss_count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The step's misses on the host, in (b, h, miss) order: (KV head, chunk id, flat slot id
    over [B, h_kv, k]) of each, int64, and each request's count. One device-to-host copy (the
    layer's one host sync on CUDA). Reference of native.list_misses."""
    _, h_kv, k = miss_slots.shape
    chunks = slot_chunks.gather(-1, miss_slots.long().clamp_min(0))
    count, slots, chunks = transfer.HostCopy([miss_count, miss_slots, chunks]).wait()
    bi, hi, mi = (torch.arange(k) < count.unsqueeze(-1)).nonzero(as_tuple=True)
    filled = (bi * h_kv + hi) * k + slots[bi, hi, mi].long()
    return hi, chunks[bi, hi, mi].long(), filled, count.sum(dim=-1).tolist()
