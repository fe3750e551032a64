"""ShadowKV's CPU decode step of one layer in one C call (``native.SparseStep``).

The composed step (``ShadowKVPages.load_batch``, ``core.decode.decode_step`` with the slots in
place, ``store_slots``) runs the same C kernels one by one, with about a hundred torch and ctypes
calls around them per layer; once the model's weights have swept the caches between layers each
of those costs microseconds (about 0.5 ms of a 2.5 ms layer step at 32K). Here the batch's row
ids, tables and scratch are set once per batch and layer cache, and a step sets its queries,
generated rows and outputs. Where its conditions do not hold (``CpuStep.build`` returns None)
the method takes the composed step.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from vllm_shadowkv.core import native
from vllm_shadowkv.core.rope import RopeCache
from vllm_shadowkv.methods.shadowkv.pages import BatchPlan, ShadowKVPages
from vllm_shadowkv.store import CpuValueStore


@dataclass
class CpuStep:
    """One layer cache's ``SparseStep`` for one batch, and the tensors it points into."""

    step: native.SparseStep
    keep: tuple  # every tensor the step points into
    keys: tuple[Hashable, ...]
    misses: torch.Tensor  # [B] int64, set by each step
    out: torch.Tensor  # [B, s_q, h_q, d]
    tables: tuple | None = None

    @classmethod
    def build(cls, pages: ShadowKVPages, kv_cache: torch.Tensor, plan: BatchPlan,
              rope: RopeCache, store, keys: tuple[Hashable, ...], s_q: int,
              h_q: int) -> CpuStep | None:
        params, shapes = pages.settings.params, pages.shapes
        h, d, k, c = shapes.num_kv_heads, shapes.head_size, plan.num_slots, params.chunk_size
        rows = kv_cache.view(-1, d)
        found = store.gather_tables(keys) if isinstance(store, CpuValueStore) else None
        if not (found and pages.slots_in_place and params.selection == "landmarks"
                and plan.max_landmarks and kv_cache.dtype in native.DTYPES
                and rope.cos_sin_cache.dtype in native.DTYPES
                and d <= native.MAX_HEAD_DIM and rope.rotary_dim <= native.MAX_HEAD_DIM
                and s_q * h_q <= native.MAX_QUERY_ROWS
                and native.supports_store_gather(rows, plan.slot_v_rows.reshape(-1, c), found[0],
                                                 c * d)):
            return None
        batch, scratch = len(keys), plan.cpu_scratch
        if not scratch:  # shared by the layers of the batch (they run one after another)
            scratch.update(
                scores=torch.full((batch, h, plan.max_landmarks), -1.0),
                b=torch.empty(batch, h, params.rank, d, dtype=kv_cache.dtype),
                ints=torch.empty(3, batch * h * k, dtype=torch.int32),
                longs=torch.empty(3, batch * h * k, dtype=torch.int64),
                misses=torch.empty(batch, dtype=torch.int64),
                value_rows=torch.empty(batch * h * k * c, dtype=torch.int64))
        _, landmark_chunks = pages.chunk_ids(kv_cache, plan)
        tables = {name: t.contiguous() for name, t in (
            ("landmark_rows", plan.landmark_rows), ("a_rows", plan.a_rows),
            ("b_offsets", plan.b.flatten()), ("slot_ids", plan.slot_chunks.flatten()),
            ("slot_k_rows", plan.slot_k_rows), ("slot_v_rows", plan.slot_v_rows),
            ("exact_len", plan.exact_len), ("cos_sin", rope.cos_sin_cache))}
        tables.update((name, t.to(torch.int32).contiguous()) for name, t in (
            ("lm_start", plan.lm_start), ("lm_count", plan.lm_count),
            ("landmark_chunks", landmark_chunks), ("a_positions", plan.a_positions),
            ("a_start", plan.a_start)))
        if plan.slot_count is not None:  # else NULL: every request owns k slots
            tables["slot_count"] = plan.slot_count.to(torch.int32).contiguous()
        slot_chunks, miss_slots, miss_count = scratch["ints"]
        heads, chunks, filled = scratch["longs"]
        buffers = dict(
            scores=scratch["scores"], b=scratch["b"], misses=scratch["misses"],
            value_rows=scratch["value_rows"], slot_chunks=slot_chunks, miss_slots=miss_slots,
            miss_count=miss_count, heads=heads, chunks=chunks, filled=filled,
            out=torch.empty(batch, s_q, h_q, d, dtype=kv_cache.dtype),
            lse=torch.empty(batch, s_q, h_q, dtype=torch.float32))
        step = native.SparseStep(
            pages=kv_cache.data_ptr(), dtype=native.DTYPES[kv_cache.dtype], num_rows=len(rows),
            batch=batch, s_q=s_q, h_q=h_q, h_kv=h, d=d, rank=params.rank, k=k, chunk=c,
            landmark_scale=1.0 / math.sqrt(d), q_dtype=native.DTYPES[kv_cache.dtype],
            max_landmarks=plan.max_landmarks, logits_ld=native.logits_ld(plan.max_landmarks),
            cos_sin_dtype=native.DTYPES[rope.cos_sin_cache.dtype], rotary_dim=rope.rotary_dim,
            neox=int(rope.is_neox_style), exact_width=plan.exact_k.shape[-1],
            page_rows=store.page_rows, row_numel=c * d,
            **{name: t.data_ptr() for name, t in (tables | buffers).items()})
        return cls(step, (kv_cache, *tables.values(), *buffers.values()), keys,
                   buffers["misses"], buffers["out"])

    def run(self, store: CpuValueStore, q: torch.Tensor, k_rows: torch.Tensor,
            v_rows: torch.Tensor, gen_before: torch.Tensor, scale: float) -> list[int]:
        """One step: q [B, s_q, h_q, d] contiguous of the cache's dtype; k_rows/v_rows
        [B, h, width] int64 (exact region, slots, generated tokens); gen_before [B] int64. The
        output lands in ``out`` (the LSE in its buffer in ``keep``); -> the missed chunks of
        each request."""
        found = store.gather_tables(self.keys)
        if found is None:  # the batch's plan outlived a request's rows (release drops both)
            raise RuntimeError(f"value store: a request of the batch {self.keys} has no rows")
        (pool, tables), s = found, self.step
        if tables is not self.tables:  # the store's tables were rebuilt (a put or free)
            self.tables = tables
            s.pool, s.pool_dtype = pool.data_ptr(), native.DTYPES[pool.dtype]
            s.page_offsets, s.first_page, s.num_heads, s.num_rows_stored = (
                t.data_ptr() for t in tables)
        s.q, s.k_rows, s.v_rows, s.gen_before = (
            q.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(), gen_before.data_ptr())
        s.width, s.scale = k_rows.shape[-1], scale
        bad = native.sparse_step(s)
        if bad:
            raise IndexError(f"value store: the batch's missed row {bad - 1} is not stored "
                             f"(keys {self.keys})")
        misses = self.misses.tolist()
        store.bytes_fetched += sum(misses) * s.row_numel * pool.element_size()
        return misses
