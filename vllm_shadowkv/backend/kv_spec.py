"""ShadowKV's KV-cache spec and block manager: compressed pages that vLLM's accounting sees.

``ShadowKVSpec`` sizes a page for compressed tokens (``layout.PageLayout``), so vLLM sizes its
block pool, reports its token capacity and maximum concurrency in compressed tokens.
``ShadowKVManager`` (vLLM's scheduler side) gives each request the blocks ``PageLayout`` says it
needs in each phase (exact staging while prefilling, compressed pages + per-request state after,
exact generated tokens), frees the staging once the prompt is compressed, and admits a long
request only when its values fit in the CPU value store and fewer than ``max_staging_requests``
prompts are being staged. A request that does not fit waits; the scheduler never admits work
that then runs out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_shadowkv.backend.layout import PageLayout
from vllm.logger import init_logger

from vllm_shadowkv.config import ShadowKVConfig, ShadowKVConfigError

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers and level
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class ShadowKVSpec(FullAttentionSpec):
    shadowkv: ShadowKVConfig = ShadowKVConfig()
    max_model_len: int = 0
    num_layers: int = 0  # attention layers on this worker (value-store accounting)

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self.shadowkv, self.num_kv_heads, self.head_size, self.dtype,
                          self.block_size)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # A request's steady footprint: what decides how many fit (vLLM's max concurrency).
        # The staging peak of one prompt is checked against the pool by the manager.
        return self.layout.steady_blocks(self.max_model_len) * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        layout = self.layout
        return layout.peak_blocks(max_len) + layout.exact_blocks(max_len)

    @classmethod
    def merge(cls, specs: list[ShadowKVSpec]) -> ShadowKVSpec:
        assert all(spec == specs[0] for spec in specs), "shadowkv layers must share one spec"
        return specs[0]


class ShadowKVManager(FullAttentionManager):
    supports_fine_grained_hash_lookup = False

    def __init__(self, kv_cache_spec: ShadowKVSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.layout = kv_cache_spec.layout
        config = kv_cache_spec.shadowkv
        self.max_staging = config.max_staging_requests
        self.store_capacity = int(config.value_store_gib * GiB)
        self.store_used = 0
        self.prompt_len: dict[str, int] = {}
        self.store_reserved: dict[str, int] = {}
        self.staging: set[str] = set()
        self._num_layers = kv_cache_spec.num_layers
        self._check_pool_fits_one_request(kv_cache_spec.max_model_len)

    def _check_pool_fits_one_request(self, max_len: int) -> None:
        pool, peak = self.block_pool.num_gpu_blocks - 1, self.layout.peak_blocks(max_len)
        if peak > pool:
            raise ShadowKVConfigError(
                f"the KV cache has {pool} blocks, but a {max_len}-token prompt needs {peak} while "
                "it is prefilled (exact staging before compression); give the KV cache more "
                "memory or lower --max-model-len"
            )
        need = self.layout.value_store_bytes(max_len, self._num_layers)
        if self.layout.is_sparse(max_len) and need > self.store_capacity:
            raise ShadowKVConfigError(
                f"shadowkv.value_store_gib ({self.store_capacity / GiB:g}) cannot hold the values "
                f"of one {max_len}-token prompt ({need / GiB:.2f} GiB on this worker); raise "
                "value_store_gib or lower --max-model-len"
            )

    # -- vLLM's allocation protocol ------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is not None:
            self.prompt_len[request_id] = num_prompt_tokens
        prompt_len = self.prompt_len.get(request_id)
        if request_id in self.staging and processed_computed_tokens >= prompt_len:
            # The workers compressed the prompt in the step that completed it.
            self._remove_blocks_in_range(request_id, 0, self.layout.exact_blocks(prompt_len))
            self.staging.discard(request_id)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        assert not new_computed_blocks, "shadowkv runs without prefix caching"
        prompt_len = self.prompt_len.get(request_id, prefill_end)
        held = self.req_to_blocks.get(request_id, ())
        if not held and not self._can_admit(prompt_len):
            return self.block_pool.num_gpu_blocks + 1  # cannot be met now: the request waits
        return max(self.layout.blocks_needed(prompt_len, num_tokens) - len(held), 0)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        prompt_len = self.prompt_len[request_id]
        req_blocks = self.req_to_blocks[request_id]
        if not req_blocks and self.layout.is_sparse(prompt_len):
            self._reserve_store(request_id, prompt_len)
        missing = self.layout.blocks_needed(prompt_len, num_tokens) - len(req_blocks)
        if missing <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(missing)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.store_used -= self.store_reserved.pop(request_id, 0)
        self.staging.discard(request_id)
        self.prompt_len.pop(request_id, None)

    # -- admission ----------------------------------------------------------------------------
    def _store_bytes(self, prompt_len: int) -> int:
        return self.layout.value_store_bytes(prompt_len, self._num_layers)

    def _can_admit(self, prompt_len: int) -> bool:
        if not self.layout.is_sparse(prompt_len):
            return True
        return (len(self.staging) < self.max_staging
                and self.store_used + self._store_bytes(prompt_len) <= self.store_capacity)

    def _reserve_store(self, request_id: str, prompt_len: int) -> None:
        nbytes = self._store_bytes(prompt_len)
        self.store_reserved[request_id] = nbytes
        self.store_used += nbytes
        self.staging.add(request_id)
