"""Exact attention over vLLM's paged KV cache, in torch (CPU and CUDA).

The cache of one layer is the logical view vLLM hands the backend: ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]``, keys in the first ``head_size`` channels of a slot and values in the
rest. Any physical layout vLLM chooses is just strides of that view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, N, 2d]`` -> key and value views ``[B, H, N, d]`` each (no copy)."""
    key_cache, value_cache = kv_cache.split(head_size, dim=-1)
    return key_cache, value_cache


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, H, d]`` at flat slots ``slot_mapping`` ``[T]`` (-1: skip)."""
    block_size = key_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def gather_context(
    cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request: ``[H, seq_len, d]``."""
    num_blocks = -(-seq_len // cache.shape[2])
    pages = cache[block_ids[:num_blocks]]  # [nb, H, N, d]
    return pages.transpose(0, 1).flatten(1, 2)[:, :seq_len]


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of the last ``q`` positions of a sequence over all its ``s`` keys.

    query ``[q, Hq, d]``; key, value ``[Hkv, s, d]`` (GQA: Hq a multiple of Hkv). Returns
    ``[q, Hq, d]``. Computed in fp32, like vLLM's kernels accumulate.
    """
    q_len, s_len = query.shape[0], key.shape[1]
    q = query.transpose(0, 1).float()
    mask = None
    if q_len > 1:  # query i sits at position s - q + i and sees keys 0..that position
        rows = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        mask = torch.arange(s_len, device=query.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(
        q, key.float(), value.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1).to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
    output: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged cache, written into ``output``.

    ``query`` is ``[T, Hq, d]`` with request ``i`` at rows ``query_start_loc[i]:[i+1]``; its
    keys are the first ``seq_lens[i]`` tokens of the pages ``block_table[i]``.
    """
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        key = gather_context(key_cache, block_table[i], seq_len)
        value = gather_context(value_cache, block_table[i], seq_len)
        output[start:end] = causal_attention(query[start:end], key, value, scale)
    return output
