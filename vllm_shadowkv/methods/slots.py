"""Exact copies of host-store rows in page slots, kept across decode steps (the hit cache of
SpeCache's and TailorKV's top-k tokens).

Each (request, KV head) owns ``k`` slot rows of keys and values in its pages. A step wants up to
``k`` prompt tokens there; those already resident stay in place (hits), the others are gathered
from the layer's host store, rows ``[2, head_dim]`` (key, value) of one token of one KV head put
as ``[h_kv, prompt_len, 2, head_dim]`` under (request, layer), and written into the slots the
step no longer needs (``core.select.assign_slots``: ShadowKV's hit-cache policy)."""

from __future__ import annotations

import torch

from vllm_shadowkv.core.select import assign_slots
from vllm_shadowkv.methods.base import LayerContext, RequestRows


def fetch_into_slots(layer: LayerContext, reqs: list[RequestRows], held: torch.Tensor,
                     wanted: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                     pages) -> torch.Tensor:
    """Bring ``wanted`` ``[n, h, k]`` tokens (-1: none) into the slots holding ``held`` (same
    shape, -1: empty) whose rows in ``pages`` (``MiniKVPages``) are ``key_rows``/``value_rows``
    ``[n, h, k]``. Counts each request's hits, fetched rows and bytes in its stats. Returns the
    slots' new tokens ``[n, h, k]`` int32."""
    n, h, k = wanted.shape
    slots, miss_slots, miss_count = assign_slots(held, wanted)
    filled = torch.arange(k, device=wanted.device) < miss_count.unsqueeze(-1)
    req, head, nth = filled.nonzero(as_tuple=True)  # request-major: gather_many's order
    dest = miss_slots[req, head, nth].long()
    tokens = slots[req, head, dest]
    # One host sync for both per-request counts.
    wanted_count, misses = torch.stack([(wanted >= 0).sum(dim=(1, 2)),
                                        miss_count.sum(dim=1)]).tolist()
    if req.numel():
        shapes = pages.shapes
        fetched = torch.empty(req.numel(), 2, shapes.head_size, dtype=shapes.dtype)
        layer.store.gather_many([(r.req_id, layer.index) for r in reqs], head.cpu(),
                                tokens.cpu(), misses, fetched)
        fetched = fetched.to(wanted.device)
        pages.write_rows(layer.kv_cache, key_rows[req, head, dest], fetched[:, 0])
        pages.write_rows(layer.kv_cache, value_rows[req, head, dest], fetched[:, 1])
    row_bytes = 2 * pages.row_bytes
    for r, count, miss in zip(reqs, wanted_count, misses):
        hit = count - miss
        stats = layer.stats(r.req_id)
        stats.selected += hit + miss  # the store rows attended from the slots
        stats.hits += hit
        stats.bytes_fetched += miss * row_bytes
    return slots
