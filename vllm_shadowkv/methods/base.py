"""What a method provides to the shared engine, and what the engine hands it.

The engine (``vllm_shadowkv/backend``) owns everything the methods share: the request phases
(exact prefill in staging pages, finalize at prompt end, compressed decode), the exact pages of
short requests and of generated tokens, page accounting through vLLM's block manager, the CPU
store, per-request stats and admission. A method decides three things:

* **its pages**: how many bytes one token slot of a page holds in each layer (``token_bytes``:
  the compressed size of a token, which is what makes vLLM's reported capacity grow), whether a
  prompt is compressed at all (``is_sparse``), how many pages its region of a compressed request
  takes (``region_blocks``) and how much of the host store it needs (``store_bytes``);
* **its hooks**: ``prefill_chunk`` (each prefill step, after exact attention), ``finalize``
  (the step that completes the prompt: compress staging into the region and the store) and
  ``decode`` (the steps after: attention from the region, the store and the generated tokens);
* **its settings**: a frozen dataclass under its own ``--additional-config`` key, with defaults
  that ``for_model`` and ``resolved`` may scale to the model.

Per-layer policy (a budget per layer, quantized vs offloaded layers) lives in the method: every
hook gets the layer index, and ``token_bytes`` may differ per layer (vLLM then sizes each layer's
pages on its own, with one block table for all). The block counts (``region_blocks``) are the
same for every layer, since the layers share the block table.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from vllm_shadowkv.core.ops import KERNEL_MODES, KernelMode


class SettingsError(ValueError):
    """A setting, the model or the engine options cannot be served by the selected method."""


@dataclass(frozen=True)
class KVShapes:
    """The attention shapes one worker (tensor-parallel rank) serves."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    num_layers: int  # attention layers on this worker
    max_model_len: int

    @property
    def key_width(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class EngineSettings:
    """Settings every method has (under its own key), read by the shared engine."""

    min_sparse_len: int = 4096
    """Context length (tokens) from which a request is compressed; shorter ones stay exact."""
    value_store_gib: float | None = None
    """CPU store size per worker in GiB. Unset: vLLM's --kv-offloading-size split over the
    tensor-parallel ranks, or 16 GiB per worker when that is unset too (at most half the host
    memory available to each worker of the node)."""
    max_staging_requests: int = 1
    """Long prompts held exactly at once while they are prefilled, before compression: bounds
    the transient full-size KV of compressions in flight. More wait for their turn."""
    measure_fidelity: bool = False
    """Diagnostic: keep an exact copy of each compressed prompt's K/V in host memory (outside
    every budget: not for production) and record, per layer and decode step, the relative error
    of the compressed attention against dense attention. Generation is unchanged."""
    kernels: KernelMode = "auto"
    """"auto": the Triton kernels on CUDA, the compiled CPU kernels on the CPU (torch.compile;
    the references without a C++ compiler); "triton": the Triton kernels on any device (on the
    CPU only under TRITON_INTERPRET=1: the kernel path tested inside the engine); "torch": the
    references everywhere."""

    def check(self) -> None:
        """Range checks that need no model; raise ``SettingsError`` naming the key."""
        at_least(self, "min_sparse_len", 1)
        at_least(self, "max_staging_requests", 1)
        one_of(self, "kernels", KERNEL_MODES)
        gib = self.value_store_gib  # (json.loads takes Infinity; 1e308 GiB overflows in bytes)
        if gib is not None and not (gib > 0 and math.isfinite(gib * (1 << 30))):
            raise SettingsError(f"{self.key}.value_store_gib must be a finite number > 0 (GiB), "
                                f"got {self.value_store_gib}")

    def check_engine(self, shapes: KVShapes) -> None:
        """Checks that need the engine's shapes (per tensor-parallel rank)."""

    def for_model(self, model_config) -> EngineSettings:
        """Fill the settings that depend on the model's own config (vLLM's ``ModelConfig``),
        before the shape checks; explicit settings stay as given."""
        return self

    def resolved(self, shapes: KVShapes) -> EngineSettings:
        """Fill the defaults that depend on the model; explicit settings stay as given."""
        return self

    def speculative_config(self) -> dict[str, Any] | None:
        """vLLM's ``speculative_config`` the settings need (SpeCache's guess row), or None: the
        front end sets it when the user gave none and refuses another."""
        return None

    @property
    def key(self) -> str:
        """The ``--additional-config`` key of these settings (the method's name)."""
        return type(self).method

    method: ClassVar[str] = ""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def at_least(settings: EngineSettings, name: str, low: int) -> None:
    value = getattr(settings, name)
    if value < low:
        raise SettingsError(f"{settings.key}.{name} must be >= {low}, got {value}")


def one_of(settings: EngineSettings, name: str, allowed: tuple, note: str = "") -> None:
    value = getattr(settings, name)
    if value not in allowed:
        raise SettingsError(f"{settings.key}.{name} must be one of "
                            f"{', '.join(map(repr, allowed))}{note}, got {value!r}")


def multiple_of(settings: EngineSettings, name: str, unit: str, why: str) -> None:
    value, step = getattr(settings, name), getattr(settings, unit)
    if value % step:
        raise SettingsError(f"{settings.key}.{name} ({value}) must be a multiple of {unit} "
                            f"({step}): {why}")


@dataclass
class LayerContext:
    """What the engine hands a method's hooks for one layer in one step."""

    index: int  # the layer's index in the model
    kv_cache: torch.Tensor  # the layer's pages, [num_blocks, ...] in the model dtype
    layout: Any  # backend.layout.PageLayout: exact pages, the method's region
    rope: Any  # core.rope.RopeCache of this layer (the model's own rotary embedding)
    store: Any  # the worker's host store for this layer's rows (core.store.ValueStore)
    store_for: Any  # callable: row shape -> the worker's host store for rows of that shape
    scale: float
    stats: Any  # callable: request id -> backend.worker_state.RequestStats
    reference_kv: dict  # measure_fidelity: (request id, layer) -> exact prompt (keys, values)
    # The step's metadata (the same object for every layer of one step), for index tensors a
    # method builds once per step; None outside the engine (nothing is then reused).
    step: Any = None


@dataclass
class RequestRows:
    """One request's rows in one layer's step: where its tokens are and what it holds."""

    req_id: str
    prompt_len: int
    seq_len: int  # position after this step's last row (vLLM's seq_len: guess rows included)
    start: int  # this step's query rows [start, end) in the batch
    end: int
    block_ids: torch.Tensor  # the request's vLLM block table row
    guess: int = 0
    """Trailing rows of [start, end) that are a guess of the next token (SpeCache's second
    query row): attended, never committed (not in the pages, not in ``committed_len``)."""

    @property
    def committed_len(self) -> int:
        """Tokens in the context after this step: ``seq_len`` without the guess rows."""
        return self.seq_len - self.guess


class KVMethod(ABC):
    """One method on the shared engine. One instance per worker, built from resolved settings
    and the worker's shapes; the scheduler side builds the same to count pages."""

    name: ClassVar[str]
    settings_cls: ClassVar[type[EngineSettings]]
    needs_rope: ClassVar[bool] = False  # refuse models without RoPE in every layer
    # Whether ``prefill_chunk`` wants the exact attention's LSE per query row where the
    # prefill's kernel gives it (CUDA's paged Triton kernel; vLLM's CPU kernel does not, and
    # the method then pays a pass of its own).
    needs_prefill_lse: ClassVar[bool] = False
    # Why vLLM's prefix caching cannot serve the method, or None. It shares the exact pages of
    # prompt tokens (backend/kv_spec.py), so a method whose ``finalize`` needs only the
    # prompt's keys and values gets it; one that gathers from every prefill chunk does not.
    prefix_caching_off: ClassVar[str | None] = None
    capacity_claim: ClassVar[tuple[dict[str, Any], float]]
    """The method's capacity claim: with these settings, at Llama-3.1-8B attention shapes and
    prompts of each of ``capacity_lengths`` tokens, vLLM's maximum concurrency is at least this
    many times its default backend's at the same KV memory (checked by
    tests/integration/test_capacity.py)."""
    capacity_lengths: ClassVar[tuple[int, ...]] = (131072,)

    @classmethod
    @abstractmethod
    def covering_settings(cls, key_width: int, context_len: int) -> dict[str, Any]:
        """Settings under which a compressed request of up to ``context_len`` tokens attends its
        whole context exactly (full rank, a budget that covers it, no quantization): the
        engine's exactness tests hold the method to dense attention with them."""

    def __init__(self, settings: EngineSettings, shapes: KVShapes) -> None:
        self.settings, self.shapes = settings, shapes

    # -- pages (scheduler and workers derive the same from the prompt length) -----------------
    @abstractmethod
    def token_bytes(self, layer: int) -> int:
        """Bytes of one token slot of a page in ``layer``."""

    @abstractmethod
    def is_sparse(self, prompt_len: int) -> bool:
        """Whether a prompt of this length is compressed (otherwise it stays exact)."""

    @abstractmethod
    def region_blocks(self, prompt_len: int) -> int:
        """Pages the method keeps per compressed request. One count for every layer (they share
        the block table); a layer that keeps less uses smaller pages (``token_bytes``)."""

    # Generated tokens of a compressed request are exact by default, all of them. A method that
    # folds them into its own format (quantized groups) keeps only a ring of the last
    # ``generated_ring`` exact (a class attribute, or set per instance from the settings) and
    # gets ``growth_blocks`` pages after the ring to fold into: at the step that fills the ring,
    # its ``decode`` must fold the ring's tokens there (the next token overwrites the ring's
    # first slot). A decode call never goes past that step: a longer step (vLLM recomputing a
    # preempted request) is written and decoded one ring segment at a time.
    generated_ring: int | None = None

    def growth_blocks(self, prompt_len: int, num_generated: int) -> int:
        """Pages for generated tokens folded out of the ring (0 without a ring)."""
        return 0

    @abstractmethod
    def store_bytes(self, layer: int, prompt_len: int) -> int:
        """Host-store bytes of one compressed request in ``layer`` (0: nothing offloaded)."""

    @abstractmethod
    def store_row_shape(self, layer: int) -> tuple[int, ...]:
        """Shape of one row of ``layer``'s host store (the unit a decode step fetches):
        ``LayerContext.store``. Rows of other shapes: ``LayerContext.store_for(shape)``."""

    def store_row_bytes(self, layer: int) -> int:
        """Bytes of one such row: what ``store_bytes`` counts and a fetch moves."""
        return math.prod(self.store_row_shape(layer)) * self.shapes.elem_bytes

    # -- worker hooks ---------------------------------------------------------------------------
    def prefill_chunk(self, layer: LayerContext, req: RequestRows, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      lse: torch.Tensor | None = None) -> None:
        """A prefill step of a request that will be compressed, after its exact attention.
        ``lse`` ``[h_kv, G, n]`` fp32: that attention's log-sum-exp per query row, where the
        method declares ``needs_prefill_lse`` and the device's kernel gives it (else None)."""

    @abstractmethod
    def finalize(self, layer: LayerContext, req: RequestRows, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
        """The step that completed the prompt: ``keys``/``values`` ``[prompt_len, h_kv, d]``
        (post-RoPE; as the prompt's last chunk's exact attention gathered them from the staging
        pages, else read from them) go into the method's region and the store."""

    @abstractmethod
    def decode(self, layer: LayerContext, reqs: list[RequestRows], query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:
        """Attention for compressed requests in decode: ``query``/``out`` ``[n, Hq, d]`` and
        ``key``/``value`` ``[n, Hkv, d]`` hold the whole batch; ``reqs`` says which rows are
        whose. This step's K/V are already in the generated-token pages."""

    def layer_kind(self, layer: int) -> Hashable:
        """Layers of one kind run the same kernels with the same graph-constant sizes: the
        start-up warm-up (backend/warm_up.py) runs the first layer of each kind on a worker.
        Default: one kind."""
        return None

    def release(self, req_id: str) -> None:
        """The request finished, was aborted or preempted (its pages and store rows are gone):
        drop what the method keeps about it on the side (index plans, caches)."""
