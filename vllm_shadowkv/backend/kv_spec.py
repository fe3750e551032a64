"""The engine's KV-cache spec and block manager: compressed pages that vLLM's accounting sees.

``CompressedKVSpec`` sizes a layer's page for the method's compressed tokens, so vLLM sizes its
block pool and reports token capacity and maximum concurrency in compressed tokens. Layers whose
pages differ (a per-layer policy) get different specs, which vLLM groups under one block table
(``UniformTypeKVCacheSpecs``): the block counts are the method's, the same for every layer.
``CompressedKVManager`` (vLLM's scheduler side) gives each request the blocks ``PageLayout``
says it needs in each phase (exact staging while prefilling, the method's region after, exact
generated tokens), frees the staging once the prompt is finalized, and admits a long request
only when its rows fit in the host store and fewer than ``max_staging_requests`` prompts are
being staged. A request that does not fit waits; the scheduler never admits work that then
runs out of memory.

Prefix caching shares exact pages: a short request's (its prompt and generated tokens, as
vLLM shares its blocks) and a compressed prompt's staging. A later request with the same prefix
adopts them and prefills the rest; a compressed one then compresses its whole prompt from them
as if it had prefilled it. The method's region and a compressed request's generated tokens are
per request and never shared. An exact page
holds ``exact_per_page`` tokens, not vLLM's ``block_size``, so pages are hashed by a key of
their own (``page_hash``) in vLLM's block pool, which keeps evicting them as it does blocks.
KV-cache events speak of vLLM's blocks, as a KV-aware router hashes a prompt: a block is stored
once the pages that lie in it and before it are cached (``announced_blocks``), and removed
when one of them is evicted (``page_block``, ``patches/kv_cache_events``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from vllm.v1.core.kv_cache_utils import (BlockHash, generate_block_hash_extra_keys,
                                         make_block_hash_with_group_id, maybe_convert_block_hash)
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.config import Stamp
from vllm_shadowkv.methods.base import KVShapes, SettingsError

@dataclass(frozen=True, kw_only=True)
class CompressedKVSpec(FullAttentionSpec):
    stamp: Stamp | None = None  # the front end's decision (frozen, hashable, picklable)
    max_model_len: int = 0
    num_layers: int = 0  # attention layers on this worker

    @classmethod
    def for_layer(cls, spec: FullAttentionSpec, stamp: Stamp, layer: int, max_model_len: int,
                  num_layers: int) -> CompressedKVSpec:
        shapes = KVShapes(spec.num_kv_heads, spec.head_size, spec.dtype, spec.block_size,
                          num_layers, max_model_len)
        token_bytes = stamp.build(shapes).token_bytes(layer)
        return cls(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                   head_size=spec.head_size, head_size_v=spec.head_size_v, dtype=spec.dtype,
                   kv_quant_mode=spec.kv_quant_mode, num_head_slots=1,
                   state_content_bytes=token_bytes, stamp=stamp,
                   max_model_len=max_model_len, num_layers=num_layers)

    @property
    def shapes(self) -> KVShapes:
        return KVShapes(self.num_kv_heads, self.head_size, self.dtype, self.block_size,
                        self.num_layers, self.max_model_len)

    @property
    def layout(self) -> PageLayout:
        return _layout(self)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # A request's steady footprint: what decides how many fit (vLLM's max concurrency).
        # The staging peak of one prompt is checked against the pool by the manager.
        return self.layout.steady_blocks(self.max_model_len) * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        layout = self.layout
        return layout.peak_blocks(max_len) + layout.exact_blocks(max_len)

    @classmethod
    def merge(cls, specs: list[CompressedKVSpec]) -> CompressedKVSpec:
        assert all(spec == specs[0] for spec in specs), "merged layers must share one spec"
        return specs[0]


@cache  # the scheduler asks at every prefix-cache lookup; a spec is frozen
def _layout(spec: CompressedKVSpec) -> PageLayout:
    return PageLayout(spec.stamp.build(spec.shapes))


def _first_spec(spec):
    return spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec


_PAGE_TAG = b"vllm-shadowkv exact page"


def page_hash(block_hashes, page: int, per_page: int, block_size: int) -> BlockHash | None:
    """Prefix-cache key of exact page ``page`` (tokens ``[page, page + 1) * per_page``): vLLM's
    chained hash of the first block that covers the page's last token, which names every token
    before it, and the page's index. None while that block is not full."""
    block = -(-(page + 1) * per_page // block_size) - 1
    if block >= len(block_hashes):
        return None
    return BlockHash(bytes(block_hashes[block]) + _PAGE_TAG + page.to_bytes(4, "big"))


def page_block(key: bytes) -> BlockHash | None:
    """The vLLM block hash inside a page's key: the first block that no hit can reach once the
    page is evicted. None for a key that is not a page's."""
    cut = len(_PAGE_TAG) + 4
    if len(key) > cut and key[-cut:-4] == _PAGE_TAG:
        return BlockHash(key[:-cut])
    return None


class CompressedKVManager(FullAttentionManager):
    supports_fine_grained_hash_lookup = False

    def __init__(self, kv_cache_spec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        spec = _first_spec(kv_cache_spec)
        self.layout = spec.layout
        stamp = spec.stamp
        self.max_staging = stamp.settings.max_staging_requests
        self.store_capacity = stamp.store_bytes
        self.store_used = 0
        self.prompt_len: dict[str, int] = {}
        self.store_reserved: dict[str, int] = {}
        self.staging: set[str] = set()
        self._check_pool_fits_one_request(spec.max_model_len)

    def _check_pool_fits_one_request(self, max_len: int) -> None:
        pool, peak = self.block_pool.num_gpu_blocks - 1, self.layout.peak_blocks(max_len)
        if peak > pool:
            raise SettingsError(
                f"the KV cache has {pool} blocks, but a {max_len}-token prompt needs {peak} while "
                "it is prefilled (exact staging before compression); give the KV cache more "
                "memory or lower --max-model-len"
            )

    # -- vLLM's allocation protocol ------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is not None:
            self.prompt_len[request_id] = num_prompt_tokens
        prompt_len = self.prompt_len.get(request_id)
        if request_id in self.staging and processed_computed_tokens >= prompt_len:
            # The workers finalized the prompt in the step that completed it.
            self._remove_blocks_in_range(request_id, 0, self.layout.exact_blocks(prompt_len))
            self.staging.discard(request_id)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        prompt_len = self.prompt_len.get(request_id, prefill_end)
        held = self.req_to_blocks.get(request_id, ())
        if not held and not self._can_admit(prompt_len):
            return self.block_pool.num_gpu_blocks + 1  # cannot be met now: the request waits
        missing = self.layout.blocks_needed(prompt_len, num_tokens) - len(held)
        # Prefix-cache hits cost no new page, but those in the free queue leave it.
        return (max(missing - len(new_computed_blocks), 0)
                + self._get_num_evictable_blocks(new_computed_blocks))

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        prompt_len = self.prompt_len[request_id]
        req_blocks = self.req_to_blocks[request_id]
        if request_id not in self.store_reserved and self.layout.is_sparse(prompt_len):
            self._reserve_store(request_id, prompt_len)
        missing = self.layout.blocks_needed(prompt_len, num_tokens) - len(req_blocks)
        if missing <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(missing)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    # -- prefix caching -----------------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                               kv_cache_spec, drop_eagle_block, alignment_tokens,
                               dcp_world_size=1, pcp_world_size=1):
        """The longest run of cached exact pages from the prompt's start. It may end inside a
        vLLM block (``alignment_tokens``): the hit's last page is whole, so the request never
        writes into a shared page and needs no copy-on-write (``_has_partial_local_hit``)."""
        spec = _first_spec(kv_cache_spec)
        assert block_pool.hash_block_size == spec.block_size, "one hash per block expected"
        per_page = spec.layout.exact_per_page
        hits: tuple[list, ...] = tuple([] for _ in kv_cache_group_ids)
        page = 0
        while (page + 1) * per_page <= max_length:
            key = page_hash(block_hashes, page, per_page, spec.block_size)
            cached = key is not None and block_pool.get_cached_block(key, kv_cache_group_ids)
            if not cached:
                break
            for group, block in zip(hits, cached):
                group.append(block)
            page += 1
        if drop_eagle_block and page:
            page -= 1
            for group in hits:
                del group[page:]
        return hits, page * per_page

    def within_prompt(self, pages: list, hit_length: int, prompt_len: int) -> tuple[list, int]:
        """A compressed request's hit must end before its prompt does, so that a step completes
        the prompt and compresses it: only a recomputed (preempted) request, whose lookup
        covers its generated tokens too, can be offered more (``patches/prefix_cache_hits``)."""
        if not self.layout.is_sparse(prompt_len) or hit_length < prompt_len:
            return pages, hit_length
        kept = (prompt_len - 1) // self.layout.exact_per_page
        return pages[:kept], kept * self.layout.exact_per_page

    def _has_partial_local_hit(self, new_computed_blocks, num_local_computed_tokens) -> bool:
        return False  # hits are whole pages (find_longest_cache_hit)

    def cache_blocks(self, request, num_tokens, retention_interval=None, *,
                     replay_boundaries=()) -> None:
        """Hash the request's exact pages as they are scheduled (vLLM's rule: a request hitting
        them in the same step reads them after this step's writes): an exact request's whole
        sequence, as vLLM caches it (the next turn of a chat adopts the answer too), a
        compressed request's prompt only (its generated tokens sit after its region)."""
        req_id, per_page = request.request_id, self.layout.exact_per_page
        blocks, done = self.req_to_blocks[req_id], self.num_cached_block.get(req_id, 0)
        if self.layout.is_sparse(request.num_prompt_tokens):
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        full = num_tokens // per_page
        for page in range(done, full):
            key = page_hash(request.block_hashes, page, per_page, self.block_size)
            if key is None:
                full = page
                break
            if not blocks[page].is_null:
                self.block_pool._insert_block_hash(
                    make_block_hash_with_group_id(key, self.kv_cache_group_id), blocks[page],
                    num_tokens=(page + 1) * per_page)
        self.num_cached_block[req_id] = max(done, full)
        if self.block_pool.enable_kv_cache_events and full > done:
            self._announce(request, self.announced_blocks(done, request),
                           self.announced_blocks(full, request))

    def announced_blocks(self, pages: int, request) -> int:
        """vLLM blocks a router may count as cached once pages ``[0, pages)`` are: each block
        whose own pages and all before it are cached, so that a hit on its prefix ends less than
        a page before the block does (the page that crosses into the next block waits for it)."""
        blocks = ((pages + 1) * self.layout.exact_per_page - 1) // self.block_size
        return min(blocks, len(request.block_hashes))

    def _announce(self, request, start: int, end: int) -> None:
        """A ``BlockStored`` event for blocks ``[start, end)``, as vLLM's pool words its own."""
        if end <= start:
            return
        hashes, size, extra_keys, mm = request.block_hashes, self.block_size, [], 0
        for block in range(start, end):
            keys, mm = generate_block_hash_extra_keys(request, block * size, (block + 1) * size, mm)
            extra_keys.append(keys)
        pool = self.block_pool
        pool.kv_event_queue.append(pool._build_block_stored_event(
            request, block_hashes=[maybe_convert_block_hash(h) for h in hashes[start:end]],
            parent_block_hash=maybe_convert_block_hash(hashes[start - 1]) if start else None,
            start_token_idx=start * size, end_token_idx=end * size, block_size=size,
            kv_cache_group_id=self.kv_cache_group_id, extra_keys_list=extra_keys))

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.store_used -= self.store_reserved.pop(request_id, 0)
        self.staging.discard(request_id)
        self.prompt_len.pop(request_id, None)

    # -- admission ----------------------------------------------------------------------------
    def _can_admit(self, prompt_len: int) -> bool:
        if not self.layout.is_sparse(prompt_len):
            return True
        return (len(self.staging) < self.max_staging
                and self.store_used + self.layout.store_bytes(prompt_len) <= self.store_capacity)

    def _reserve_store(self, request_id: str, prompt_len: int) -> None:
        nbytes = self.layout.store_bytes(prompt_len)
        self.store_reserved[request_id] = nbytes
        self.store_used += nbytes
        self.staging.add(request_id)
