"""The engine's attention backend in vLLM's four-class shape, shared by every method.

``KVCompressionBackend`` declares what the engine supports, ``EngineMetadata`` is one step's
batch, ``EngineMetadataBuilder`` makes it (request ids, prompt lengths, where each new token's
K/V goes), and ``EngineImpl`` stores K/V and runs each request in its phase: exact attention
over the exact pages (short requests, prefill), the method's ``prefill_chunk`` and ``finalize``
hooks as a long prompt is prefilled and completed, and the method's ``decode`` for the
compressed requests of the step, all of them in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_shadowkv.backend.engine_check import SUPPORTED_KV_CACHE_DTYPES
from vllm_shadowkv.backend.exact_attention import exact_attention_step, read_exact, write_exact
from vllm_shadowkv.backend.host_malloc import keep_freed_memory
from vllm_shadowkv.backend.kv_spec import CompressedKVSpec
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.backend.rotary import rope_of
from vllm_shadowkv.backend.worker_state import STATE, EngineFacts
from vllm_shadowkv.core.ops import kernel_mode
from vllm_shadowkv.core.rope import RopeCache
from vllm_shadowkv.methods.base import KVMethod, LayerContext, RequestRows, SettingsError


class KVCompressionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM's slot this plugin fills; the method is the impl's

    @staticmethod
    def get_impl_cls() -> type[EngineImpl]:
        return EngineImpl

    @staticmethod
    def get_builder_cls() -> type[EngineMetadataBuilder]:
        return EngineMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(8)]  # whole chunks of the default chunk_size per block

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # torch attention: any head size

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # each page one contiguous run of bytes per layer


@dataclass
class EngineMetadata:
    layout: PageLayout
    num_actual_tokens: int
    req_ids: list[str | None]  # None: a dummy row (profiling, warm-up)
    prompt_lens: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    guesses: list[int]  # trailing guess rows per request (RequestRows.guess), never written
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    write_blocks: torch.Tensor  # block id of each written token's K/V
    write_slots: torch.Tensor  # exact slot in that page
    # Rows written now (None: all num_actual_tokens): a step that overfills a method's
    # generated-token ring has its later segments written by ``EngineImpl._run``; guess rows
    # are left out.
    write_rows: torch.Tensor | None = None
    # Which request is in which phase: the same in every layer, worked out in the first
    # (``EngineImpl._phases``).
    phases: StepPhases | None = None
    # The exact requests' in-place row ids (``exact_attention_step``), planned in the first layer.
    exact_plans: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepPhases:
    exact: list[tuple[RequestRows, bool]]  # rows attended exactly, and whether compressed
    decode_rounds: list[list[RequestRows]]  # the compressed decodes, one method call each


def cpu_lengths_exact(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's CPU copy of a step's sequence lengths is exact. Under async speculative
    decoding it assumes every draft was accepted, and only the device's are (reading them is
    one host wait a step on a GPU)."""
    return not (vllm_config.scheduler_config.async_scheduling
                and vllm_config.speculative_config is not None)


class EngineMetadataBuilder(AttentionMetadataBuilder[EngineMetadata]):
    # Never captured: a step's work depends on each request's phase (exact prefill, finalize,
    # compressed decode) and on data (how many selected rows missed, gathered by the host from
    # the store), which a replayed graph would freeze. vLLM then leaves these layers out of its
    # CUDA graphs (piecewise capture around them). CPU-checked: the engine tests run eagerly too.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: CompressedKVSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layout = kv_cache_spec.layout
        self.cpu_lens_exact = cpu_lengths_exact(vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> EngineMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        query_start_loc = m.query_start_loc_cpu[: num_reqs + 1].tolist()
        lens = m.seq_lens_cpu_upper_bound if self.cpu_lens_exact else m.seq_lens
        seq_lens = lens[:num_reqs].tolist()
        req_ids, prompt_lens = STATE.batch_requests(num_reqs)
        if len(req_ids) < num_reqs:  # a dummy batch: no real requests behind its rows
            req_ids, prompt_lens = [None] * num_reqs, list(seq_lens)
        # A compressed request's guess rows are never written: the position is the next
        # step's, and in a step whose output row fills the ring it is the first ring slot,
        # folded only after the step's attention. An exact request's are (exact attention
        # reads every row from the pages; the next step overwrites the position).
        guesses = [STATE.guesses.get(r, 0) if r is not None and self.layout.is_sparse(p) else 0
                   for r, p in zip(req_ids, prompt_lens)]
        block_table = m.block_table_tensor[:num_reqs]
        blocks, slots, rows, clipped = [], [], [], False
        device = block_table.device
        for i in range(num_reqs):
            first = seq_lens[i] - (query_start_loc[i + 1] - query_start_loc[i])
            committed = seq_lens[i] - guesses[i]
            _, end = self.layout.ring_segments(prompt_lens[i], first, committed)[0]
            clipped |= end < seq_lens[i]
            positions = torch.arange(first, end, device=device)
            b, s = self.layout.exact_token_slots(prompt_lens[i], block_table[i], positions)
            blocks.append(b)
            slots.append(s)
            rows.append(positions - first + query_start_loc[i])
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return EngineMetadata(
            layout=self.layout, num_actual_tokens=m.num_actual_tokens, req_ids=req_ids,
            prompt_lens=prompt_lens, query_start_loc=query_start_loc, seq_lens=seq_lens,
            guesses=guesses, block_table=block_table,
            write_blocks=torch.cat(blocks) if blocks else empty,
            write_slots=torch.cat(slots) if slots else empty,
            write_rows=torch.cat(rows) if clipped else None,
        )


class EngineImpl(AttentionImpl[EngineMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        vllm_config = get_current_vllm_config()
        facts = EngineFacts.from_vllm_config(vllm_config)
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            f"sliding window ({sliding_window})": sliding_window is not None,
            f"logits soft cap ({logits_soft_cap})": bool(logits_soft_cap),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "attention sinks": sinks is not None,
            f"--kv-cache-dtype {kv_cache_dtype}": kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES,
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
        }
        found = [name for name, bad in unsupported.items() if bad]
        if found:
            raise ValueError(
                f"The {facts.stamp.method} attention backend does not support "
                f"{', '.join(found)}; it serves decoder layers with full causal attention and a KV "
                f"cache of the model's dtype (--kv-cache-dtype "
                f"{' / '.join(SUPPORTED_KV_CACHE_DTYPES)})")
        STATE.begin_engine(facts, vllm_config)
        keep_freed_memory()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.method_name = facts.stamp.method
        self._rope: RopeCache | None = None
        self._layer_index: int | None = None

    def layer_kv_spec(self, spec, layer_name: str) -> CompressedKVSpec:
        """This layer's pages (``patches/layer_kv_spec.py``)."""
        from vllm.model_executor.models.utils import extract_layer_index

        facts = STATE.engine
        return CompressedKVSpec.for_layer(spec, facts.stamp, extract_layer_index(layer_name),
                                          facts.max_model_len, facts.num_layers)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata[layer.layer_name]
        if metadata is None:
            return
        rows = metadata.write_rows
        if rows is None:
            key, value = key[:metadata.num_actual_tokens], value[:metadata.num_actual_tokens]
        else:
            key, value = key[rows], value[rows]
        write_exact(kv_cache, metadata.layout, metadata.write_blocks, metadata.write_slots,
                    key, value)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: EngineMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{self.method_name} does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        m, layout = attn_metadata, attn_metadata.layout
        n, h, hkv, d = m.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        query, out = query[:n].view(n, h, d), output[:n].view(n, h, d)
        key, value = key[:n].view(n, hkv, d), value[:n].view(n, hkv, d)
        ctx = self._context(layer, kv_cache, layout, m)
        with kernel_mode(layout.method.settings.kernels):
            self._run(m, ctx, query, key, value, out)
        return output

    def _run(self, m: EngineMetadata, ctx: LayerContext, query, key, value, out) -> None:
        """Each request in its phase; the compressed decodes of the step in one method call
        (one per ring segment when a recomputed request overfills a method's ring)."""
        layout, kv_cache = ctx.layout, ctx.kv_cache
        method = layout.method
        if m.phases is None:
            m.phases = self._phases(m, layout)
        exact = m.phases.exact
        # The prompts this step completes: compressed next from the tokens their attention reads
        read = {i: [] for i, (req, sparse) in enumerate(exact)
                if sparse and req.seq_len >= req.prompt_len}
        results = exact_attention_step(
            kv_cache, layout, [req for req, _ in exact], query, self.scale,
            [sparse and method.needs_prefill_lse for _, sparse in exact], m.exact_plans, read)
        for i, ((req, sparse), (req_out, lse)) in enumerate(zip(exact, results)):
            start, end = req.start, req.end
            out[start:end] = req_out
            if not sparse:
                continue
            method.prefill_chunk(ctx, req, query[start:end], key[start:end], value[start:end],
                                 lse)
            if req.seq_len >= req.prompt_len:  # this step completed the prompt
                self._finalize(ctx, req, read.get(i))
        for segment, reqs in enumerate(m.phases.decode_rounds):
            if segment:  # later segments of a long step: their K/V go to the ring now
                rows = torch.cat([torch.arange(r.start, r.end - r.guess, device=key.device)
                                  for r in reqs])
                slots = [layout.exact_token_slots(r.prompt_len, r.block_ids, torch.arange(
                    r.seq_len - (r.end - r.start), r.committed_len, device=key.device))
                         for r in reqs]
                write_exact(kv_cache, layout, torch.cat([b for b, _ in slots]),
                            torch.cat([s for _, s in slots]), key[rows], value[rows])
            method.decode(ctx, reqs, query, key, value, out)

    def _phases(self, m: EngineMetadata, layout: PageLayout) -> StepPhases:
        """The step's requests by phase: exact rows (short requests, prefill chunks) and the
        compressed decodes (a recomputed request's chunk past its prompt end decodes
        compressed, like when it was generated)."""
        exact: list[tuple[RequestRows, bool]] = []
        decoding: list[RequestRows] = []
        for i, req_id in enumerate(m.req_ids):
            start, end = m.query_start_loc[i], m.query_start_loc[i + 1]
            if end == start:
                continue
            req = RequestRows(req_id, m.prompt_lens[i], m.seq_lens[i], start, end,
                              m.block_table[i], m.guesses[i])
            sparse = req_id is not None and layout.is_sparse(req.prompt_len)
            if req_id is not None:
                STATE.request(req_id, req.prompt_len, sparse)
            first = req.seq_len - (end - start)
            if sparse and first >= req.prompt_len:
                decoding.append(req)
                continue
            if sparse and req.seq_len > req.prompt_len:
                split = start + req.prompt_len - first
                decoding.append(replace(req, start=split))
                req = replace(req, end=split, seq_len=req.prompt_len, guess=0)
            exact.append((req, sparse))
        return StepPhases(exact, self._ring_rounds(layout, decoding))

    @staticmethod
    def _ring_rounds(layout: PageLayout, decoding: list[RequestRows]) -> list[list[RequestRows]]:
        """The decode calls of a step: every request's first ring segment, then the second
        segments of the requests that have one, and so on. Segments cut the committed rows;
        the guess rows go with the last."""
        rounds: list[list[RequestRows]] = []
        for req in decoding:
            first = req.seq_len - (req.end - req.start)
            segments = layout.ring_segments(req.prompt_len, first, req.committed_len)
            for k, (a, b) in enumerate(segments):
                if k == len(rounds):
                    rounds.append([])
                guess = req.guess if k == len(segments) - 1 else 0
                rounds[k].append(replace(req, start=req.start + a - first,
                                         end=req.start + b - first + guess, seq_len=b + guess,
                                         guess=guess))
        return rounds

    def _finalize(self, ctx: LayerContext, req: RequestRows, read: list | None) -> None:
        """Compress the request's prompt: its keys and values as the exact attention ``read``
        them for the prompt's last chunk, else from the pages."""
        if read and len(read[0]) == req.prompt_len:
            keys, values = read
        else:
            keys, values = read_exact(ctx.kv_cache, ctx.layout, req.prompt_len, req.block_ids,
                                      torch.arange(req.prompt_len, device=ctx.kv_cache.device))
        ctx.layout.method.finalize(ctx, req, keys, values)
        STATE.compressed.setdefault(req.req_id, set()).add(ctx.index)
        if ctx.layout.method.settings.measure_fidelity:
            ctx.reference_kv[(req.req_id, ctx.index)] = (keys.cpu(), values.cpu())

    def _context(self, layer, kv_cache, layout: PageLayout, step: EngineMetadata
                 ) -> LayerContext:
        index = self._index_of(layer)
        STATE.methods.add(layout.method)
        return LayerContext(
            index=index, kv_cache=kv_cache, layout=layout,
            rope=self._rope_of(layer, layout.method), store=STATE.store(layout.method, index),
            store_for=lambda shape: STATE.store_for(shape, layout.shapes.dtype), scale=self.scale,
            stats=STATE.requests.__getitem__, reference_kv=STATE.reference_kv, step=step)

    def _index_of(self, layer) -> int:
        if self._layer_index is None:
            from vllm.model_executor.models.utils import extract_layer_index

            self._layer_index = extract_layer_index(layer.layer_name)
        return self._layer_index

    def _rope_of(self, layer, method: KVMethod) -> RopeCache | None:
        """The model's own rotary embedding for this layer (backend/rotary.py), for a method
        that rebuilds keys with it; None for the others."""
        if self._rope is None and method.needs_rope:
            parent = layer.layer_name.rsplit(".", 1)[0]
            rotary = getattr(STATE.runner.get_model().get_submodule(parent), "rotary_emb", None)
            if rotary is None:  # (start-up checks the config; this is the module vLLM built)
                raise SettingsError(
                    f"the {method.name} attention backend rebuilds keys with the model's rotary "
                    f"embedding, but {parent} has no rotary_emb module (a model implementation "
                    "vLLM's own classes do not provide, e.g. --model-impl transformers); serve "
                    "the model with vLLM's implementation or another method (minikv, specache, "
                    "tailorkv)")
            self._rope = rope_of(rotary, method.name)
        return self._rope
