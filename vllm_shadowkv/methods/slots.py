"""Exact copies of host-store rows in page slots, kept across decode steps (the hit cache of
SpeCache's and TailorKV's top-k tokens).

Each (request, KV head) owns ``k`` slot rows of keys and values in its pages. A step wants up to
``k`` prompt tokens there; those already resident stay in place (hits), the others are gathered
from the layer's host store, rows ``[2, head_dim]`` (key, value) of one token of one KV head put
as ``[h_kv, prompt_len, 2, head_dim]`` under (request, layer), and written into the slots the
step no longer needs (``ops.assign_slots``: ShadowKV's hit-cache policy).

A fetch has two halves. ``plan_fetch`` decides on the device which slot gets which token and
starts copying that decision to the host, without waiting; ``SlotFetch.complete`` gathers the
rows on the host and writes them into the slots (on CUDA through the copy stream). A prefetch
for the next step (SpeCache's speculative mode) completes at that step, so on CUDA the decision
reaches the host while the rest of the step computes, and the rows' copy overlaps the layers
before this one."""

from __future__ import annotations

import torch

from vllm_shadowkv.core import ops, transfer
from vllm_shadowkv.methods.base import LayerContext, RequestRows


class SlotFetch:
    """Store rows decided for the slots of ``reqs`` and not yet in them."""

    def __init__(self, reqs: list[RequestRows], wanted: torch.Tensor, slots: torch.Tensor,
                 miss_slots: torch.Tensor, miss_count: torch.Tensor, key_rows: torch.Tensor,
                 value_rows: torch.Tensor) -> None:
        self.req_ids = [r.req_id for r in reqs]
        self.dropped: set[str] = set()  # released before completion: their pages may be reused
        self._rows = (key_rows, value_rows)
        self._host = transfer.HostCopy([(wanted >= 0).sum(dim=(1, 2)), miss_count, miss_slots,
                                        slots])

    def drop(self, req_id: str) -> bool:
        """Leave ``req_id``'s rows out; False when no request of the fetch is left."""
        self.dropped.add(req_id)
        return bool(set(self.req_ids) - self.dropped)

    def complete(self, layer: LayerContext, pages) -> None:
        """Gather the missed rows from ``layer``'s store into the slots of ``pages``
        (``MiniKVPages``) and count each live request's hits, fetched rows and bytes."""
        wanted_count, miss_count, miss_slots, slots = self._host.wait()
        live = torch.tensor([r not in self.dropped for r in self.req_ids])
        k = slots.shape[-1]
        filled = (torch.arange(k) < miss_count.unsqueeze(-1)) & live.view(-1, 1, 1)
        req, head, nth = filled.nonzero(as_tuple=True)  # request-major: gather_many's order
        dest = miss_slots[req, head, nth].long()
        misses = (miss_count * live.view(-1, 1)).sum(dim=1).tolist()
        if req.numel():
            device, key_rows, value_rows = layer.kv_cache.device, *self._rows
            stored = [(r, layer.index) for r in self.req_ids], head, slots[req, head, dest]
            if device.type == "cpu":  # straight into the slots' rows: no staging copy
                rows = torch.stack([key_rows[req, head, dest], value_rows[req, head, dest]], 1)
                layer.store.gather_many(*stored, misses, pages.row_pool(layer.kv_cache), rows)
            else:
                staging = transfer.host_staging((req.numel(), 2, pages.shapes.head_size),
                                                layer.kv_cache)
                layer.store.gather_many(*stored, misses, staging)
                fetched = transfer.to_device_async(staging, device)
                at = transfer.to_device_async(torch.stack([req, head, dest]), device).unbind()
                pages.write_rows(layer.kv_cache, key_rows[at], fetched[:, 0])
                pages.write_rows(layer.kv_cache, value_rows[at], fetched[:, 1])
        row_bytes = 2 * pages.row_bytes
        for req_id, count, miss, alive in zip(self.req_ids, wanted_count.tolist(), misses,
                                              live.tolist()):
            if alive:
                stats = layer.stats(req_id)
                stats.selected += count  # the store rows attended from the slots
                stats.hits += count - miss
                stats.bytes_fetched += miss * row_bytes


def held_slots(slot_tokens: dict, keys: list, num_kv_heads: int, k: int,
               device: torch.device) -> torch.Tensor:
    """The token ids ``[n, h, k]`` int32 the slots of each (request, layer) key hold, -1 for a
    key that holds none yet (its first decode step)."""
    if all(key in slot_tokens for key in keys):
        return torch.stack([slot_tokens[key] for key in keys])
    empty = torch.full((num_kv_heads, k), -1, dtype=torch.int32, device=device)
    return torch.stack([slot_tokens.get(key, empty) for key in keys])


def plan_fetch(reqs: list[RequestRows], held: torch.Tensor, wanted: torch.Tensor,
               key_rows: torch.Tensor, value_rows: torch.Tensor
               ) -> tuple[torch.Tensor, SlotFetch]:
    """Which of the ``wanted`` ``[n, h, k]`` tokens (-1: none) go where in the slots holding
    ``held`` (same shape, -1: empty), whose rows in the pages are ``key_rows``/``value_rows``
    ``[n, h, k]``. Returns the slots' new tokens ``[n, h, k]`` int32 (on the device, no host
    sync) and the fetch that brings the missing rows."""
    slots, miss_slots, miss_count = ops.assign_slots(held, wanted)
    return slots, SlotFetch(reqs, wanted, slots, miss_slots, miss_count, key_rows, value_rows)


def fetch_into_slots(layer: LayerContext, reqs: list[RequestRows], held: torch.Tensor,
                     wanted: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                     pages) -> torch.Tensor:
    """``plan_fetch`` and its completion at once: the slots' new tokens ``[n, h, k]``."""
    slots, fetch = plan_fetch(reqs, held, wanted, key_rows, value_rows)
    fetch.complete(layer, pages)
    return slots
