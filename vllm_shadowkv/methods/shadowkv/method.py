"""ShadowKV (Sun et al., 2024) on the shared engine: low-rank pre-RoPE keys, chunk landmarks
and outliers in the pages, values in the host store, top-k chunks rebuilt at each decode step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_shadowkv.backend.exact_attention import causal_attention, exact_kv, exact_rows
from vllm_shadowkv.core import ops, transfer
from vllm_shadowkv.core.compress import compress_prompt
from vllm_shadowkv.core.decode import decode_step
from vllm_shadowkv.core.fidelity import attended_chunks, chunk_attention_mass, measure_fidelity
from vllm_shadowkv.methods.base import KVMethod, KVShapes, LayerContext, RequestRows
from vllm_shadowkv.methods.shadowkv.cpu_step import CpuStep
from vllm_shadowkv.methods.shadowkv.pages import BatchPlan, RequestPlan, ShadowKVPages
from vllm_shadowkv.methods.shadowkv.settings import ShadowKVSettings
from vllm_shadowkv.store import paged_bytes


@dataclass
class StepRows:
    """Where one step's decoding requests are, built once per step (``_step_rows``)."""

    step: object  # the engine's metadata of the step
    key: tuple  # (request id, rows, seq_len) of each request
    counts: list[int]  # generated tokens before the step, per request
    rows: torch.Tensor  # [B * s_q] the requests' query rows, request-major
    gen_len: torch.Tensor  # [B] counts
    blocks: torch.Tensor  # [B, G] page of each generated token (padded)
    within: torch.Tensor  # [B, G] its slot in the page
    gen_rows: torch.Tensor | None = None  # (``_generated_rows``)
    attended: tuple | None = None  # (plan, k rows, v rows): ``_attended_rows``


class ShadowKVMethod(KVMethod):
    name = "shadowkv"
    settings_cls = ShadowKVSettings
    needs_rope = True  # keys are factorised before RoPE and rebuilt with it
    # The paper's settings (§5.1): 576 B per compressed token and layer instead of 4 KiB.
    capacity_claim = ({"rank": 160, "chunk_size": 8, "sparse_budget": 2048,
                       "outlier_chunks": 48, "local_window": 32}, 6.0)

    def __init__(self, settings: ShadowKVSettings, shapes: KVShapes) -> None:
        super().__init__(settings, shapes)
        self.pages = ShadowKVPages(settings, shapes)
        self.params = settings.params
        self._plans: dict[str, RequestPlan] = {}
        self._batch_plans: dict[tuple[str, ...], BatchPlan] = {}
        self._step: StepRows | None = None

    @classmethod
    def covering_settings(cls, key_width: int, context_len: int) -> dict:
        chunk = ShadowKVSettings.chunk_size
        return {"rank": key_width, "sparse_budget": -(-context_len // chunk) * chunk,
                "outlier_chunks": 8}

    # -- pages --------------------------------------------------------------------------------
    def token_bytes(self, layer: int) -> int:
        return self.pages.token_bytes

    def is_sparse(self, prompt_len: int) -> bool:
        return self.pages.compressed_tokens(prompt_len) > 0

    def region_blocks(self, prompt_len: int) -> int:
        return self.pages.packed_blocks(prompt_len) + self.pages.state_blocks(prompt_len)

    def store_bytes(self, layer: int, prompt_len: int) -> int:
        rows = self.params.compressed_chunks(prompt_len) * self.shapes.num_kv_heads
        return paged_bytes(rows, self.store_row_bytes(layer))

    def store_row_shape(self, layer: int) -> tuple[int, ...]:
        return (self.settings.chunk_size, self.shapes.head_size)

    # -- hooks --------------------------------------------------------------------------------
    def finalize(self, layer: LayerContext, req: RequestRows, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
        positions = torch.arange(req.prompt_len, device=keys.device)
        prompt = compress_prompt(keys, values, positions, layer.rope, self.params, layer.store,
                                 (req.req_id, layer.index))
        region = layer.layout.region_ids(req.prompt_len, req.block_ids)
        self.pages.write_compressed(layer.kv_cache, region, self._plan(layer, req), prompt)

    def release(self, req_id: str) -> None:
        self._plans.pop(req_id, None)
        self._batch_plans = {ids: plan for ids, plan in self._batch_plans.items()
                             if req_id not in ids}

    def decode(self, layer: LayerContext, reqs: list[RequestRows], query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:
        by_rows: dict[int, list[RequestRows]] = {}
        for req in reqs:  # one batch per query length (1 in plain decoding)
            by_rows.setdefault(req.end - req.start, []).append(req)
        for s_q, group in by_rows.items():
            self._decode_batch(layer, group, s_q, query, key, value, out)

    def _decode_batch(self, layer: LayerContext, reqs: list[RequestRows], s_q: int, query,
                      key, value, out) -> None:
        """One sparse step of one layer for every request of ``reqs`` (``s_q`` rows each)."""
        n = len(reqs)
        plan = self._batch_plan(layer, reqs)
        step = self._step_rows(layer, reqs, s_q)
        in_place = self.pages.slots_in_place and ops.native_cpu(layer.kv_cache)
        cpu_step = self._cpu_step(layer, plan, reqs, s_q, query) if in_place else None
        if cpu_step is not None:  # the whole step in one C call
            k_rows, v_rows = self._attended_rows(layer, step, plan)
            misses = cpu_step.run(layer.store, query[step.rows].unflatten(0, (n, s_q)), k_rows,
                                  v_rows, step.gen_len, layer.scale)
            out[step.rows] = cpu_step.out.flatten(0, 1)
            self._count_step(layer, reqs, misses)
            return
        generated = self._generated_rows(layer, step) if in_place else self._generated(layer, step)
        batch, outliers = self.pages.load_batch(layer.kv_cache, plan, layer.rope, generated,
                                                step.gen_len, max(step.counts))
        batch.store_keys = [(r.req_id, layer.index) for r in reqs]
        q = query[step.rows].unflatten(0, (n, s_q))
        # In place the step's K/V are read from their pages: only the queries are gathered.
        k, v = (None, None) if in_place else (t[step.rows].unflatten(0, (n, s_q))
                                              for t in (key, value))
        result, _ = decode_step(batch, q, k, v, layer.store, layer.scale)
        out[step.rows] = result.flatten(0, 1)
        self.pages.store_slots(layer.kv_cache, plan, batch)
        self._count_step(layer, reqs, batch.step_misses)
        gen_kv = None
        for i, req in enumerate(reqs):
            reference = layer.reference_kv.get((req.req_id, layer.index))
            if reference is not None:
                gen = slice(0, step.counts[i] + s_q)  # the step's tokens included
                gen_kv = gen_kv or batch.generated()
                self._record_fidelity(layer, req, reference, outliers[i],
                                      batch.slot_chunks[i], gen_kv[0][i, :, gen],
                                      gen_kv[1][i, :, gen], q[i], result[i],
                                      layer.stats(req.req_id))

    def _count_step(self, layer: LayerContext, reqs: list[RequestRows],
                    misses: list[int]) -> None:
        """Counted on the host: each KV head selects min(its slots, landmarks) chunks; the
        misses came back with the step's one copy to the host."""
        heads = self.shapes.num_kv_heads
        row_bytes = self.store_row_bytes(layer.index)
        for req, missed in zip(reqs, misses):
            stats, plan = layer.stats(req.req_id), self._plans[req.req_id]
            selected = heads * min(plan.num_slots, plan.num_landmarks)
            stats.decode_steps += 1
            stats.selected += selected
            stats.hits += selected - missed
            stats.bytes_fetched += missed * row_bytes

    def _cpu_step(self, layer: LayerContext, plan: BatchPlan, reqs: list[RequestRows],
                  s_q: int, query: torch.Tensor) -> CpuStep | None:
        """The batch's one-call CPU step in this layer (built once), or None where the
        composed step runs: the fidelity measure's requests (it reads the step's parts), or
        what ``CpuStep.build`` does not take."""
        if query.dtype != layer.kv_cache.dtype or (layer.reference_kv and any(
                (r.req_id, layer.index) in layer.reference_kv for r in reqs)):
            return None
        key = (layer.kv_cache.data_ptr(), s_q)
        cpu_step = plan.cpu_steps.get(key)
        if cpu_step is None:
            cpu_step = CpuStep.build(self.pages, layer.kv_cache, plan, layer.rope, layer.store,
                                     tuple((r.req_id, layer.index) for r in reqs), s_q,
                                     query.shape[1])
            if cpu_step is not None:
                plan.cpu_steps[key] = cpu_step
        return cpu_step

    def _attended_rows(self, layer: LayerContext, step: StepRows,
                       plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows the step attends, [B, h, E + k*c + G + s_q] int64 for K and for V: the
        exact region and the slots (the plan's), then the generated tokens (the step's). Every
        layer's the same: built in the step's first."""
        if step.attended is None or step.attended[0] is not plan:
            gen = self._generated_rows(layer, step)
            step.attended = (plan, torch.cat([plan.attended_k, gen[0]], -1),
                             torch.cat([plan.attended_v, gen[1]], -1))
        return step.attended[1], step.attended[2]

    # -- where a batch's data is ----------------------------------------------------------------
    def _plan(self, layer: LayerContext, req: RequestRows) -> RequestPlan:
        """Built once per compressed request (every layer shares it); dropped by ``release``."""
        plan = self._plans.get(req.req_id)
        if plan is None:
            region = layer.layout.region_ids(req.prompt_len, req.block_ids)
            plan = self._plans[req.req_id] = self.pages.plan(req.prompt_len, region)
        return plan

    def _batch_plan(self, layer: LayerContext, reqs: list[RequestRows]) -> BatchPlan:
        ids = tuple(r.req_id for r in reqs)
        plan = self._batch_plans.get(ids)
        if plan is None:
            if len(self._batch_plans) > 8:  # batches that no longer run
                self._batch_plans.clear()
            plan = self._batch_plans[ids] = self.pages.batch_plan(
                ids, [self._plan(layer, r) for r in reqs])
        return plan

    def _step_rows(self, layer: LayerContext, reqs: list[RequestRows], s_q: int) -> StepRows:
        """The batch's query rows and generated tokens' pages: the same for every layer of a
        step, so built in its first layer; the others only compare the step's key (no index
        built, no host-to-device copy)."""
        key = tuple((r.req_id, r.start, r.end, r.seq_len) for r in reqs)
        cached = self._step
        if cached is not None and layer.step is not None and cached.step is layer.step \
                and cached.key == key:
            return cached
        layout, device = layer.layout, layer.kv_cache.device
        per_page = layout.exact_per_page
        counts = [r.seq_len - s_q - r.prompt_len for r in reqs]
        pages = []
        for r, n in zip(reqs, counts):  # slices of the block table rows: no copies, no syncs
            first = layout.exact_blocks(r.prompt_len) + layout.region_blocks(r.prompt_len)
            pages.append(r.block_ids[first: first + -(-(n + s_q) // per_page)])
        table = torch.nn.utils.rnn.pad_sequence(pages, batch_first=True).long()
        # The step's own tokens too: the backend wrote them to their pages before the step.
        rel = torch.arange(max(counts) + s_q, device=device).expand(len(reqs), -1)
        rows = torch.tensor([i for r in reqs for i in range(r.start, r.end)], dtype=torch.long)
        self._step = StepRows(
            step=layer.step, key=key, counts=counts,
            rows=transfer.to_device_async(rows, device),
            gen_len=transfer.to_device_async(torch.tensor(counts), device),
            blocks=table.gather(1, (rel // per_page).clamp(max=table.shape[1] - 1)),
            within=rel % per_page)
        return self._step

    def _generated(self, layer: LayerContext, step: StepRows):
        """The exact K/V of each request's generated tokens, the step's own last,
        [B, h, G + s_q, d] each (copies)."""
        return exact_kv(layer.kv_cache, layer.layout, step.blocks, step.within)

    def _generated_rows(self, layer: LayerContext, step: StepRows) -> torch.Tensor:
        """The rows of the same K/V in the layer cache viewed ``[N, d]``, [2, B, h, G + s_q]
        (every layer's the same: built in the step's first)."""
        if step.gen_rows is None:
            step.gen_rows = exact_rows(layer.kv_cache, layer.layout, step.blocks, step.within)
        return step.gen_rows

    def _record_fidelity(self, layer: LayerContext, req: RequestRows, reference, outliers,
                         slot_chunks, gen_k, gen_v, query, out, stats, top: int = 8) -> None:
        """Dense attention over the exact prompt + generated tokens vs the sparse output
        (query/out ``[s_q, Hq, d]``; gen_k/gen_v ``[h, g, d]``, this step's last), and the
        recall of each KV head's ``top`` chunks of largest dense attention mass."""
        ref_k, ref_v = (t.to(query.device) for t in reference)
        all_k = torch.cat([ref_k, gen_k.transpose(0, 1)])
        all_v = torch.cat([ref_v, gen_v.transpose(0, 1)])
        dense = causal_attention(query, all_k, all_v, layer.scale)
        mass = chunk_attention_mass(query, ref_k, self.settings.chunk_size, layer.scale)
        attended = attended_chunks(req.prompt_len, self.pages.compressed_tokens(req.prompt_len),
                                   outliers, slot_chunks, self.settings.chunk_size)
        fid = measure_fidelity(out, dense, mass, attended, min(top, mass.shape[1]))
        stats.record_fidelity(layer.index, fid.relative_error, fid.chunk_recall)
