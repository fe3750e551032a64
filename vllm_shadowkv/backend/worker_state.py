"""Per-worker state of the shadowkv backend: which requests are in the batch, the value store.

vLLM's attention metadata has no request ids or prompt lengths, and a backend is not told when a
request finishes, is aborted or is preempted. ``patches/runner_requests.py`` hands this module
the model runner each step, and the ids to release, before the runner updates its batch.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm_shadowkv.config import ShadowKVConfig
from vllm_shadowkv.store import CpuValueStore

GiB = 1 << 30


@dataclass(frozen=True)
class EngineFacts:
    """What the page format needs from the engine config, captured while the model is built
    (vLLM asks backends for their KV spec later, outside its config context)."""

    config: ShadowKVConfig
    max_model_len: int
    num_layers: int  # attention layers on this worker

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "EngineFacts":
        model_config = vllm_config.model_config
        return cls(
            config=ShadowKVConfig.from_additional_config(vllm_config.additional_config),
            max_model_len=model_config.max_model_len,
            num_layers=model_config.get_num_layers(vllm_config.parallel_config),
        )


@dataclass
class RequestStats:
    """What one request did on this worker: its mode and, when sparse, its selection traffic."""

    mode: str = "dense"  # "dense" (exact attention) or "sparse" (ShadowKV decode)
    prompt_len: int = 0
    decode_steps: int = 0  # sparse decode calls, over layers
    selected: int = 0  # selected chunk slots, over KV heads and layers
    hits: int = 0  # of which resident from the previous step
    bytes_fetched: int = 0  # values moved from the store

    @property
    def hit_rate(self) -> float:
        return self.hits / self.selected if self.selected else 0.0


@dataclass
class WorkerState:
    engine: EngineFacts | None = None
    runner_ref: weakref.ref | None = None
    _store: CpuValueStore | None = None
    # request id -> layers whose prompt is compressed (values in the store)
    compressed: dict[str, set[int]] = field(default_factory=dict)
    requests: dict[str, RequestStats] = field(default_factory=dict)
    finished: deque = field(default_factory=lambda: deque(maxlen=1024))  # (req_id, stats)

    def value_store(self, layout) -> CpuValueStore:
        """This worker's value store, created on first use with ``value_store_gib`` capacity
        (its pages are allocated lazily up to that bound, pinned on CUDA)."""
        if self._store is None:
            self._store = CpuValueStore(
                capacity_bytes=int(layout.config.value_store_gib * GiB), dtype=layout.dtype,
                chunk_size=layout.config.chunk_size, head_dim=layout.head_size)
        return self._store

    @property
    def runner(self):
        runner = self.runner_ref() if self.runner_ref is not None else None
        if runner is None:
            raise RuntimeError("shadowkv: the model runner was not registered (patch missing)")
        return runner

    def batch_requests(self, num_reqs: int) -> tuple[list[str], list[int]]:
        """Request ids and prompt lengths of the rows of this step's attention metadata."""
        batch = self.runner.input_batch
        return list(batch.req_ids[:num_reqs]), batch.num_prompt_tokens[:num_reqs].tolist()

    def request(self, req_id: str, prompt_len: int) -> RequestStats:
        stats = self.requests.get(req_id)
        if stats is None:
            stats = self.requests[req_id] = RequestStats(prompt_len=prompt_len)
        return stats

    def release(self, req_ids: Iterable[str]) -> None:
        """Finished, aborted or preempted: the request's values leave the store."""
        for req_id in req_ids:
            for layer in self.compressed.pop(req_id, ()):
                self._store.free((req_id, layer))
            stats = self.requests.pop(req_id, None)
            if stats is not None:
                self.finished.append((req_id, stats))


STATE = WorkerState()
