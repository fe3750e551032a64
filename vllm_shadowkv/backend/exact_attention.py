"""Exact attention over a request's exact pages: the engine's path for every method's prefill,
for short requests and for the final attention of a method that rebuilds exact K/V."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_shadowkv.core.attention import causal_attention_cpu

if TYPE_CHECKING:
    from vllm_shadowkv.backend.layout import PageLayout


def exact_view(kv_cache: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """``[num_blocks, exact_per_page, 2 (k, v), h_kv, d]`` view of the layer cache (no copy)."""
    h, d = layout.shapes.num_kv_heads, layout.shapes.head_size
    pages = kv_cache.view(kv_cache.shape[0], -1)[:, : layout.exact_per_page * 2 * h * d]
    return pages.view(-1, layout.exact_per_page, 2, h, d)


def read_exact(kv_cache, layout: PageLayout, prompt_len: int, block_ids, positions):
    """Keys and values ``[n, h_kv, d]`` of exact tokens at ``positions``."""
    blocks, slots = layout.exact_token_slots(prompt_len, block_ids, positions)
    kv = exact_view(kv_cache, layout)[blocks, slots]  # [n, 2, h, d]
    return kv[:, 0], kv[:, 1]


def write_exact(kv_cache, layout: PageLayout, blocks, slots, key, value) -> None:
    view = exact_view(kv_cache, layout)
    view[blocks, slots, 0] = key.to(view.dtype)
    view[blocks, slots, 1] = value.to(view.dtype)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The last ``q`` positions of a sequence attend all its ``s`` keys, causally.

    query ``[q, Hq, d]``; key, value ``[s, Hkv, d]`` -> ``[q, Hq, d]``; 16-bit inputs, fp32
    accumulation.
    """
    if query.device.type == "cpu":
        return causal_attention_cpu(query, key, value, scale)[0]
    q_len, s_len = query.shape[0], key.shape[0]
    mask = None
    if 1 < q_len < s_len:  # a later prefill chunk: query i sits at position s - q + i
        rows = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        mask = torch.arange(s_len, device=query.device)[None, :] <= rows
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        attn_mask=mask, is_causal=1 < q_len == s_len, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def exact_attention(kv_cache, layout: PageLayout, prompt_len: int, block_ids, seq_len: int,
                    query: torch.Tensor, scale: float) -> torch.Tensor:
    positions = torch.arange(seq_len, device=query.device)
    key, value = read_exact(kv_cache, layout, prompt_len, block_ids, positions)
    return causal_attention(query, key, value, scale)
