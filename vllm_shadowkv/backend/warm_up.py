"""Compile the decode kernels at start-up, not inside the first compressed requests' steps.

The CPU kernels (torch.compile) and the Triton kernels compile on their first call, and a graph
traced with static sizes compiles again when a size first changes (one request in the batch,
then two): one to several seconds each, which otherwise land in the decode steps of the first
long requests a server sees (measured: benchmarks/RESULTS.md, "TailorKV end to end at 16K").
After vLLM's own warm-up (``patches/kernel_warm_up.py``), the first layer of each kind on the
worker (``KVMethod.layer_kind``) runs its method's real hooks on scratch pages and a scratch host
store: two synthetic requests of different lengths prefilled, finalized, then decoded alone and
together, so every kernel is compiled with its varying sizes already dynamic. Nothing of the
engine's pages, store or request state is touched.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import torch

from vllm_shadowkv.backend.exact_attention import read_exact, write_exact
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.backend.worker_state import STATE, RequestStats
from vllm_shadowkv.core.ops import compiles, kernel_mode
from vllm_shadowkv.methods.base import LayerContext, RequestRows
from vllm_shadowkv.store import CpuValueStore

WARM_UP_ENV = "SHADOWKV_WARM_UP"  # "0": no warm-up (the kernels compile in the first steps)
EXTRA_TOKENS = 24  # the second request's prompt: longer, so that every count differs
BATCHES = ((0,), (0,), (0, 1), (0, 1), (1,))  # request indices decoded in each step


def warm_up(runner) -> float | None:
    """Warm every kind of compressed layer of the runner's model; the seconds spent, or None
    when no layer has the engine's impl."""
    from vllm_shadowkv.backend.attention import EngineImpl

    if os.environ.get(WARM_UP_ENV, "1") == "0":
        return None
    start = time.perf_counter()
    STATE.attach(runner)  # the layers' RoPE is looked up through it
    seen, warmed = set(), 0
    for layer in runner.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)
        if not isinstance(impl, EngineImpl) or layer.kv_cache.numel() == 0:
            continue
        layout = layer.get_kv_cache_spec(runner.vllm_config).layout
        index = impl._index_of(layer)
        kind = (repr(layout.method.settings), layout.method.layer_kind(index), impl.num_heads,
                impl.head_size, layer.kv_cache.dtype)
        if kind in seen:
            continue
        seen.add(kind)
        with kernel_mode(layout.method.settings.kernels):
            if not compiles(layer.kv_cache.device):
                continue  # the references, or Triton's interpreter: nothing to compile
        # Every tensor as in serving, for the graphs' guards (grad mode, inference-tensor keys):
        # the pages made outside inference mode, as vLLM's KV cache is; the layer's RoPE cache
        # (kept for serving) and all the rest under it, as vLLM runs the model.
        with torch.inference_mode():
            rope = impl._rope_of(layer, layout.method)
        scratch = ScratchLayer(layout, index, impl.num_heads, rope, impl.scale, layer.kv_cache)
        if not scratch.prompt_lens:
            continue  # no compressed request fits the context: nothing to compile
        with torch.inference_mode(), kernel_mode(layout.method.settings.kernels):
            scratch.run()
        warmed += 1
    return time.perf_counter() - start if warmed else None


class ScratchLayer:
    """One layer of a method on scratch pages shaped like ``like`` (the layer's cache) and a
    scratch host store, with synthetic compressed requests: by default the warm-up's two, the
    shortest prompts the method compresses, decoded in ``BATCHES``."""

    def __init__(self, layout: PageLayout, index: int, num_heads: int, rope, scale: float,
                 like: torch.Tensor, prompt_lens: list[int] | None = None,
                 batches: tuple[tuple[int, ...], ...] = BATCHES) -> None:
        self.layout, self.num_heads, self.batches = layout, num_heads, batches
        self.device, self.dtype = like.device, like.dtype
        # Its own generator: vLLM seeds the global one after profiling (--seed), and the
        # warm-up, which runs after that, must not move it.
        self.generator = torch.Generator(self.device).manual_seed(0)
        if prompt_lens is None:
            first = compressed_len(layout, len(batches) + 1)
            last = layout.shapes.max_model_len - len(batches) - 1
            prompt_lens = [] if first is None else sorted({first, min(first + EXTRA_TOKENS, last)})
        self.prompt_lens = prompt_lens
        self.block_ids, at = [], 1  # block 0 is vLLM's null block
        for p in self.prompt_lens:
            n = layout.blocks_needed(p, p + len(batches) + 1)
            self.block_ids.append(torch.arange(at, at + n, device=self.device))
            at += n
        self.cache = like.new_zeros(at, *like.shape[1:])
        self.seq_lens = list(self.prompt_lens)
        # A method with a guess row (SpeCache's speculative prefetch) decodes two rows per
        # request: the output row and the guess, never written.
        self.guess = int(layout.method.settings.speculative_config() is not None)
        stats = defaultdict(RequestStats)
        stores: dict[tuple[int, ...], CpuValueStore] = {}

        def store_for(shape: tuple[int, ...]) -> CpuValueStore:
            if shape not in stores:
                nbytes = sum(layout.method.store_bytes(index, p) for p in self.prompt_lens)
                stores[shape] = CpuValueStore(2 * nbytes + (1 << 20), self.dtype, shape)
            return stores[shape]

        self.ctx = LayerContext(index=index, kv_cache=self.cache, layout=layout, rope=rope,
                                store=store_for(layout.method.store_row_shape(index)),
                                store_for=store_for, scale=scale, stats=stats.__getitem__,
                                reference_kv={})

    def _rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random query, key and value rows (unit-scale, as after RoPE and normalisation)."""
        h_kv, d = self.layout.shapes.num_kv_heads, self.layout.shapes.head_size
        return tuple(torch.randn(n, h, d, device=self.device, dtype=self.dtype,
                                 generator=self.generator)
                     for h in (self.num_heads, h_kv, h_kv))

    def run(self) -> None:
        method, layout = self.layout.method, self.layout
        req_ids = [f"shadowkv-warm-up-{i}" for i in range(len(self.prompt_lens))]
        try:
            for req_id, p, ids in zip(req_ids, self.prompt_lens, self.block_ids):
                q, k, v = self._rows(p)
                positions = torch.arange(p, device=self.device)
                write_exact(self.cache, layout, *layout.exact_token_slots(p, ids, positions), k, v)
                req = RequestRows(req_id, p, p, 0, p, ids)
                method.prefill_chunk(self.ctx, req, q, k, v)
                method.finalize(self.ctx, req, *read_exact(self.cache, layout, p, ids, positions))
            for batch in self.batches:
                batch = [i for i in batch if i < len(req_ids)]
                if batch:
                    self._decode(batch, req_ids)
        finally:
            for req_id in req_ids:
                method.release(req_id)

    def _decode(self, batch: list[int], req_ids: list[str]) -> None:
        layout, g, reqs, blocks, slots, written = self.layout, self.guess, [], [], [], []
        for row, i in enumerate(batch):
            pos, p = self.seq_lens[i], self.prompt_lens[i]
            self.seq_lens[i] += 1
            start = row * (1 + g)
            reqs.append(RequestRows(req_ids[i], p, pos + 1 + g, start, start + 1 + g,
                                    self.block_ids[i], guess=g))
            b, s = layout.exact_token_slots(p, self.block_ids[i],
                                            torch.tensor([pos], device=self.device))
            blocks.append(b)
            slots.append(s)
            written.append(start)
        q, k, v = self._rows(len(batch) * (1 + g))
        write_exact(self.cache, layout, torch.cat(blocks), torch.cat(slots), k[written],
                    v[written])
        layout.method.decode(self.ctx, reqs, q, k, v, torch.empty_like(q))


def compressed_len(layout: PageLayout, steps: int) -> int | None:
    """The shortest prompt the method compresses with room for ``steps`` more tokens, or None
    (the context is too short for any)."""
    shapes = layout.shapes
    for p in range(layout.method.settings.min_sparse_len, shapes.max_model_len - steps + 1):
        if layout.is_sparse(p):
            return p
    return None
