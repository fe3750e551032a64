"""KV-cache events in vLLM's blocks for the exact pages that prefix caching shares.

A KV-aware router (``--kv-events-config``) indexes the blocks each engine announces by vLLM's
chained block hashes. ``CompressedKVManager`` caches pages under keys of its own and announces
the blocks they fill (``cache_blocks``); two places in vLLM's own code speak of cached entries
without asking the manager, so this patch translates them:

- ``BlockPool._emit_block_removed_events``: an evicted page's key becomes the block it ends in
  (``page_block``), the first block a hit can no longer reach; a router's walk stops there.
- ``KVCacheCoordinator.emit_cached_block_events`` (a request's ``kv_cache_report_mode`` "full"
  announces its hits): vLLM counts the hit's entries as blocks; for pages that is more blocks
  than the request has hashes, and the scheduler failed with an ``IndexError``.
"""

from __future__ import annotations

_REMOVED = ["self", "block_hashes"]
_CACHED = ["self", "request", "computed_blocks"]


def apply() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_utils import (get_block_hash, get_group_id,
                                             make_block_hash_with_group_id)

    from vllm_shadowkv.patches import check_signature

    removed = BlockPool._emit_block_removed_events
    if getattr(removed, "_shadowkv_original", None) is not None:
        return
    check_signature(removed, _REMOVED, "BlockPool._emit_block_removed_events")
    cached = KVCacheCoordinator.emit_cached_block_events
    check_signature(cached, _CACHED, "KVCacheCoordinator.emit_cached_block_events")

    def _emit_block_removed_events(self, block_hashes):  # every eviction of a cached page
        if not self.enable_kv_cache_events:
            return  # (vLLM's own first line: nothing to translate)
        from vllm_shadowkv.backend.kv_spec import page_block

        named = []
        for key in block_hashes:
            block = page_block(get_block_hash(key))
            named.append(key if block is None
                         else make_block_hash_with_group_id(block, get_group_id(key)))
        return removed(self, list(dict.fromkeys(named)))  # a block's pages evicted together

    def emit_cached_block_events(self, request, computed_blocks):
        from vllm_shadowkv.backend.kv_spec import CompressedKVManager

        manager = self.single_type_managers[0]
        if not isinstance(manager, CompressedKVManager):
            return cached(self, request, computed_blocks)
        blocks = manager.announced_blocks(len(computed_blocks[0]), request)
        if blocks:
            manager.block_pool.emit_cached_block_events(request, blocks, manager.block_size,
                                                        manager.kv_cache_group_id)

    _emit_block_removed_events._shadowkv_original = removed
    emit_cached_block_events._shadowkv_original = cached
    BlockPool._emit_block_removed_events = _emit_block_removed_events
    KVCacheCoordinator.emit_cached_block_events = emit_cached_block_events
