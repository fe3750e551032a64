"""MiniKV (2-bit layer-discriminative KV cache) on the shared engine: at prompt end each KV head
keeps its heavy hitters (H2O column sums over the prompt or its ``score_window``) and the
recent window, with a budget per layer, quantized KIVI-style into the pages; generated tokens
collect in the engine's 16-bit ring and are quantized every ``residual`` tokens. Decode attends
the quantized groups (dequantization fused) and the 16-bit rows and ring exactly, merged by
their LSE."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_shadowkv.backend.exact_attention import (causal_attention, exact_kv, exact_rows,
                                                   exact_view)
from vllm_shadowkv.core import ops
from vllm_shadowkv.core.attention import merge_attention
from vllm_shadowkv.core.fidelity import chunk_attention_mass, measure_fidelity
from vllm_shadowkv.core.heavy_hitters import accumulate_column_sums, select_heavy_hitters
from vllm_shadowkv.core.kivi import quantize_groups
from vllm_shadowkv.methods.base import KVMethod, KVShapes, LayerContext, RequestRows
from vllm_shadowkv.methods.minikv.pages import BatchPlan, LayerShape, MiniKVPages, RequestPlan
from vllm_shadowkv.methods.minikv.settings import EXACT_BITS, MiniKVSettings

FIDELITY_TOP_TOKENS = 64  # recall of each KV head's most attended prompt tokens


@dataclass
class Ring:
    """A step's 16-bit generated tokens not folded yet (``MiniKVMethod._ring``), padded."""

    key: tuple  # the step's requests, lengths and rows
    blocks: torch.Tensor  # [B, R] int64: where token j of request b is
    slots: torch.Tensor  # [B, R] int64
    before: torch.Tensor  # [B] int64: the tokens before the step's own
    no_slots: torch.Tensor  # [B, h, 0] int32 (``ops.decode_attention`` attends no slots here)
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def rows(self, layer: LayerContext) -> torch.Tensor:
        """The tokens' K/V as rows of the layer's cache ``[2, B, h, R]`` int64 (layers whose
        pages have one size share them)."""
        page = layer.kv_cache.stride(0)
        if page not in self._rows:
            self._rows[page] = exact_rows(layer.kv_cache, layer.layout, self.blocks, self.slots)
        return self._rows[page]


class MiniKVMethod(KVMethod):
    name = "minikv"
    settings_cls = MiniKVSettings
    needs_rope = False  # post-RoPE keys are stored as they come
    needs_prefill_lse = True  # the column sums normalise by it (CUDA; the CPU's C attention)
    prefix_caching_off = ("the heavy hitters are scored by the attention of every prompt row, "
                          "which a cached prefix does not run")
    # The paper's defaults (§5.1): 2 bits, 25 % heavy hitters (pyramid) + 25 % recent window.
    capacity_claim = ({}, 7.0)
    capacity_lengths = (32768, 131072)

    def __init__(self, settings: MiniKVSettings, shapes: KVShapes) -> None:
        super().__init__(settings, shapes)
        self.pages = MiniKVPages(settings, shapes)
        self.generated_ring = settings.residual
        # Worker-side state, dropped by ``release``: column sums of prompts being prefilled
        # (transient, like their staging pages), plans of compressed requests, and with
        # measure_fidelity the kept positions.
        self._scores: dict[tuple[str, int], torch.Tensor] = {}
        self._plans: dict[tuple[str, LayerShape], RequestPlan] = {}
        self._batch_plans: dict[tuple, BatchPlan] = {}
        self._ring_index: Ring | None = None
        self._kept: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def covering_settings(cls, key_width: int, context_len: int) -> dict:
        # Every token kept in every layer (a recent window of the whole prompt), 16-bit; a ring
        # of 4 so that short generations fold generated tokens (into 16-bit rows) too.
        return {"bits": EXACT_BITS, "heavy_ratio": 0.0, "recent_ratio": 1.0, "group_size": 4,
                "residual": 4}

    # -- pages --------------------------------------------------------------------------------
    def token_bytes(self, layer: int) -> int:
        return self.pages.token_bytes(layer)

    def is_sparse(self, prompt_len: int) -> bool:
        return prompt_len >= self.settings.min_sparse_len

    def region_blocks(self, prompt_len: int) -> int:
        return self.pages.region_blocks(prompt_len)

    def growth_blocks(self, prompt_len: int, num_generated: int) -> int:
        return self.pages.growth_blocks(num_generated // self.settings.residual)

    def store_bytes(self, layer: int, prompt_len: int) -> int:
        return 0  # everything lives in the pages

    def store_row_shape(self, layer: int) -> tuple[int, ...]:
        return (self.shapes.head_size,)  # no host store is used

    # -- hooks --------------------------------------------------------------------------------
    def prefill_chunk(self, layer: LayerContext, req: RequestRows, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      lse: torch.Tensor | None = None) -> None:
        """Add the chunk's queries (those in the score window) to the H2O column sums of every
        key so far."""
        if not self._selects(layer.index, req.prompt_len):
            return  # the layer keeps the recent window only, or the whole prompt: no scores
        window = self.settings.score_window
        scored_from = max(0, req.prompt_len - window) if window else 0  # first scoring row
        first = req.seq_len - (req.end - req.start)  # position of the chunk's first row
        skip = max(0, scored_from - first)
        if skip >= len(query):
            return  # the chunk is before the window
        scores_key = (req.req_id, layer.index)
        previous = self._scores.get(scores_key)
        assert previous is not None or first + skip == scored_from, (
            "minikv: a prefill chunk without the column sums of the earlier ones")
        keys = self._staged_keys(layer, req)
        self._scores[scores_key] = accumulate_column_sums(
            previous, query[skip:], keys, layer.scale, None if lse is None else lse[..., skip:])

    def _selects(self, layer: int, prompt_len: int) -> bool:
        """Whether the layer picks heavy hitters among the prompt's tokens (scored while
        prefilling), rather than keeping the recent window only or the whole prompt."""
        heavy, recent = self.pages.kept(layer, prompt_len)
        return heavy > 0 and heavy + recent < prompt_len

    def finalize(self, layer: LayerContext, req: RequestRows, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
        """Select the kept tokens per KV head and write them: quantized groups, then the
        16-bit tail."""
        prompt_len, h, d = req.prompt_len, self.shapes.num_kv_heads, self.shapes.head_size
        heavy, recent = self.pages.kept(layer.index, prompt_len)
        scores = self._scores.pop((req.req_id, layer.index), None)
        if self._selects(layer.index, prompt_len):
            kept = select_heavy_hitters(scores, prompt_len, heavy, recent,
                                        self.settings.pool)
        else:  # the recent window only, or the whole prompt
            kept = torch.arange(prompt_len - heavy - recent, prompt_len,
                                device=keys.device).expand(h, -1)
        index = kept.unsqueeze(-1).expand(-1, -1, d)
        k = keys.transpose(0, 1).gather(1, index)  # [h, kept, d], positions ascending
        v = values.transpose(0, 1).gather(1, index)
        shape = self.pages.shape(layer.index, prompt_len)
        # The prompt's ids: a plan shared with an earlier layer may hold folds already (a
        # recomputed request decodes generated tokens in the step that finalizes it).
        plan = self.pages.upto(self._plan(layer, req, shape), 0)
        quantized = shape.groups * self.settings.group_size
        if shape.groups:
            groups = quantize_groups(k[:, :quantized].transpose(0, 1),
                                     v[:, :quantized].transpose(0, 1), self.pages.fmt)
            self.pages.write_groups(layer.kv_cache, plan.units.t().flatten(), groups)
        self.pages.write_rows(layer.kv_cache, plan.key_rows.flatten(), k[:, quantized:])
        self.pages.write_rows(layer.kv_cache, plan.value_rows.flatten(), v[:, quantized:])
        if self.settings.measure_fidelity:
            self._kept[(req.req_id, layer.index)] = kept.cpu()

    def decode(self, layer: LayerContext, reqs: list[RequestRows], query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:
        by_rows: dict[tuple[int, int], list[RequestRows]] = {}
        for req in reqs:  # one batch per query length and guess rows (1 and 0 in plain decoding)
            by_rows.setdefault((req.end - req.start, req.guess), []).append(req)
        for (s_q, _), group in by_rows.items():
            self._decode_batch(layer, group, s_q, query, key, value, out)

    def release(self, req_id: str) -> None:
        for table in (self._scores, self._plans, self._kept):
            for k in [k for k in table if k[0] == req_id]:
                del table[k]
        self._batch_plans = {ids: plan for ids, plan in self._batch_plans.items()
                             if all(entry[0] != req_id for entry in ids)}
        self._ring_index = None

    # -- decode -------------------------------------------------------------------------------
    def _decode_batch(self, layer: LayerContext, reqs: list[RequestRows], s_q: int, query,
                      key, value, out) -> None:
        """One step of one layer for every request of ``reqs`` (``s_q`` query rows each, the
        last ``guess`` of them guess rows: attended, not in the pages, never folded)."""
        n, h, guess = len(reqs), self.shapes.num_kv_heads, reqs[0].guess
        rows = torch.tensor([i for r in reqs for i in range(r.start, r.end)],
                            device=query.device)
        q = query[rows].unflatten(0, (n, s_q))
        plans = [self._caught_up_plan(layer, r, s_q) for r in reqs]
        batch = self._batch_plan(reqs, plans)

        ring = self._ring(layer, reqs, s_q)
        if guess == 0:
            result, lse = self._attend_pages(layer, batch, ring, q, ring.before)
        else:
            result, lse = self._attend_with_guess(layer, batch, ring, guess, q, key, value,
                                                  rows)
        if self.pages.fmt is not None and batch.most_groups > 0:
            result = self._merge_quantized(layer, reqs, plans, q, batch, result, lse)
        out[rows] = result.flatten(0, 1)

        residual, ring_kv = self.settings.residual, None
        for i, (req, plan) in enumerate(zip(reqs, plans)):
            if (req.committed_len - req.prompt_len) % residual == 0:  # the ring is full
                ring_kv = ring_kv or exact_kv(layer.kv_cache, layer.layout, ring.blocks,
                                               ring.slots)
                self._fold(layer, req, plan, ring_kv[0][i, :, :residual],
                           ring_kv[1][i, :, :residual])
            stats = layer.stats(req.req_id)
            stats.decode_steps += 1
            stats.selected += self._selected(layer.index, req)
            reference = layer.reference_kv.get((req.req_id, layer.index))
            if reference is not None:  # the committed rows
                step = rows[i * s_q:(i + 1) * s_q - guess]
                self._record_fidelity(layer, req, reference, q[i, :s_q - guess],
                                      result[i, :s_q - guess], key[step], value[step], stats)

    def _selected(self, layer: int, req: RequestRows) -> int:
        """What a step adds to the request's ``selected`` counter: the prompt tokens kept."""
        return self.shapes.num_kv_heads * sum(self.pages.kept(layer, req.prompt_len))

    def _merge_quantized(self, layer: LayerContext, reqs: list[RequestRows],
                         plans: list[RequestPlan], q: torch.Tensor, batch: BatchPlan,
                         out_exact: torch.Tensor, lse_exact: torch.Tensor) -> torch.Tensor:
        """Attention over the quantized groups, merged with the exact part's. Each (request,
        KV head) is one row of the group table: its query heads attend its own groups."""
        n, s_q, hq, d = q.shape
        h = self.shapes.num_kv_heads
        per_head = q.view(n, s_q, h, hq // h, d).transpose(1, 2).reshape(n * h, s_q, hq // h, d)
        out_q, lse_q = ops.quant_attention(per_head, self.pages.unit_pool(layer.kv_cache),
                                           batch.group_table, batch.group_count,
                                           self.pages.fmt, layer.scale,
                                           most_groups=batch.most_groups)
        out_q = out_q.view(n, h, s_q, hq // h, d).transpose(1, 2).reshape(n, s_q, hq, d)
        lse_q = lse_q.view(n, h, s_q, hq // h).transpose(1, 2).reshape(n, s_q, hq)
        out, _ = merge_attention([out_exact, out_q], [lse_exact, lse_q])
        return out

    def _attend_pages(self, layer: LayerContext, batch: BatchPlan, ring: Ring, q: torch.Tensor,
                      before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The 16-bit rows, then the ring, read where they lie in the pages: query row i of
        request b sees the ring's first ``before[b] + i + 1`` tokens."""
        ring_k, ring_v = ring.rows(layer)
        return ops.decode_attention(
            q, self.pages.row_pool(layer.kv_cache), torch.cat([batch.key_rows, ring_k], 2),
            torch.cat([batch.value_rows, ring_v], 2), batch.key_rows.shape[2], batch.row_count,
            ring.no_slots, 1, before, layer.scale)

    def _attend_with_guess(self, layer: LayerContext, batch: BatchPlan, ring: Ring, guess: int,
                           q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact part of a step with guess rows, read in place as a plain step's is. A guess
        row sees what the last committed row sees, and the guesses up to itself, whose K/V are
        the step's own (never in the pages). So the last committed row and the guess rows
        attend the pages in one call, as more query heads of one row (each KV head's rows
        read once); the rows before it, causally, in another; the guesses' own K/V are then
        merged into the guess rows by their LSE."""
        n, s_q, h_q, d = q.shape
        h, committed = self.shapes.num_kv_heads, s_q - guess
        g, shared = h_q // h, guess + 1  # the rows that see the same pages and ring
        heads = q[:, committed - 1:].reshape(n, shared, h, g, d).transpose(1, 2)
        out, lse = self._attend_pages(layer, batch, ring, heads.reshape(n, 1, h * shared * g, d),
                                      ring.before + committed - 1)
        out = out.view(n, h, shared, g, d).transpose(1, 2).reshape(n, shared, h_q, d)
        lse = lse.view(n, h, shared, g).transpose(1, 2).reshape(n, shared, h_q)
        guess_k, guess_v = (t[rows].unflatten(0, (n, s_q))[:, committed:].float()
                            for t in (key, value))  # [n, guess, h, d]
        guessed = self._with_own_guesses(q[:, committed:], guess_k, guess_v, out[:, 1:],
                                         lse[:, 1:], layer.scale)
        outs, lses = [out[:, :1], guessed[0]], [lse[:, :1], guessed[1]]
        if committed > 1:
            before = self._attend_pages(layer, batch, ring, q[:, :committed - 1], ring.before)
            outs.insert(0, before[0])
            lses.insert(0, before[1])
        return torch.cat(outs, 1), torch.cat(lses, 1)

    @staticmethod
    def _with_own_guesses(q, keys, values, out, lse, scale):
        """Guess rows' attention ``out``, ``lse`` over the pages merged with their attention
        over the step's guesses (``keys``, ``values`` ``[n, u, h, d]``, causal among the u
        rows), in fp32: a few small products, no kernel call."""
        n, u, h_q, d = q.shape
        h = keys.shape[2]
        logits = torch.einsum("nihgd,njhd->nhgij", q.float().view(n, u, h, h_q // h, d),
                              keys) * scale
        causal = torch.ones(u, u, dtype=torch.bool, device=q.device).tril()
        own_lse = logits.masked_fill_(~causal, float("-inf")).logsumexp(-1, keepdim=True)
        own = torch.einsum("nhgij,njhd->nihgd", (logits - own_lse).exp_(), values)
        own_lse = own_lse.squeeze(-1).permute(0, 3, 1, 2).reshape(n, u, h_q)
        total = torch.logaddexp(lse, own_lse)
        merged = (out.float() * (lse - total).exp_().unsqueeze(-1)
                  + own.reshape(n, u, h_q, d) * (own_lse - total).exp_().unsqueeze(-1))
        return merged.to(out.dtype), total

    def _ring(self, layer: LayerContext, reqs: list[RequestRows], s_q: int) -> Ring:
        """The 16-bit generated tokens not folded yet, this step's committed ones included (shared
        by the layers: built in the step's first). The rows count too: a request's seq_len
        recurs when a step without a guess row follows one with it (vLLM drafts nothing past
        max_model_len)."""
        key = (tuple((r.req_id, r.seq_len) for r in reqs), s_q, reqs[0].guess)
        if self._ring_index is None or self._ring_index.key != key:
            self._ring_index = self._ring_slots(layer, reqs, s_q, key)
        return self._ring_index

    def _ring_slots(self, layer: LayerContext, reqs: list[RequestRows], s_q: int,
                    key: tuple) -> Ring:
        ring, device = self.settings.residual, layer.kv_cache.device
        blocks, slots, before = [], [], []
        for r in reqs:
            generated, committed = r.committed_len - r.prompt_len, s_q - r.guess
            folded = (generated - committed) // ring * ring
            positions = torch.arange(r.prompt_len + folded, r.committed_len, device=device)
            b, s = layer.layout.exact_token_slots(r.prompt_len, r.block_ids, positions)
            blocks.append(b)
            slots.append(s)
            before.append(generated - folded - committed)
        blocks = torch.nn.utils.rnn.pad_sequence(blocks, batch_first=True)
        slots = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
        return Ring(key, blocks, slots, torch.tensor(before, device=device),
                    torch.empty(len(reqs), self.shapes.num_kv_heads, 0, dtype=torch.int32,
                                device=device))

    def _fold(self, layer: LayerContext, req: RequestRows, plan: RequestPlan,
              ring_k: torch.Tensor, ring_v: torch.Tensor) -> None:
        """The full ring ``[h, residual, d]`` into its growth pages (the next step appends its
        ids to the plan)."""
        generated = req.committed_len - req.prompt_len  # (a guess row is never folded)
        growth = layer.layout.growth_ids(req.prompt_len, generated, req.block_ids)
        ids = self.pages.fold_ids(plan.shape, growth, generated // self.settings.residual - 1)
        if plan.shape.units_per_page:  # a quantized layer
            groups = quantize_groups(ring_k.transpose(0, 1), ring_v.transpose(0, 1),
                                     self.pages.fmt)
            self.pages.write_groups(layer.kv_cache, ids, groups)
        else:
            key_ids, value_ids = ids.view(2, -1)
            self.pages.write_rows(layer.kv_cache, key_ids, ring_k)
            self.pages.write_rows(layer.kv_cache, value_ids, ring_v)

    # -- where a batch's data is ----------------------------------------------------------------
    def _plan(self, layer: LayerContext, req: RequestRows, shape: LayerShape) -> RequestPlan:
        """Built once per request and layer shape (layers of one shape share it)."""
        plan = self._plans.get((req.req_id, shape))
        if plan is None:
            region = layer.layout.region_ids(req.prompt_len, req.block_ids)
            plan = self._plans[(req.req_id, shape)] = self.pages.plan(shape, region)
        return plan

    def _caught_up_plan(self, layer: LayerContext, req: RequestRows, s_q: int) -> RequestPlan:
        """The request's plan with the ids of every fold before this step, and no later one."""
        plan = self._plan(layer, req, self.pages.shape(layer.index, req.prompt_len))
        generated = req.seq_len - s_q - req.prompt_len
        folds = generated // self.settings.residual
        if plan.folds < folds:
            growth = layer.layout.growth_ids(req.prompt_len, generated, req.block_ids)
            while plan.folds < folds:
                self.pages.extend(plan, self.pages.fold_ids(plan.shape, growth, plan.folds))
        return self.pages.upto(plan, folds)

    def _batch_plan(self, reqs: list[RequestRows], plans: list[RequestPlan]) -> BatchPlan:
        ids = tuple((r.req_id, p.shape, p.folds) for r, p in zip(reqs, plans))
        plan = self._batch_plans.get(ids)
        if plan is None:
            if len(self._batch_plans) > 2 * self.shapes.num_layers:  # batches no longer run
                self._batch_plans.clear()
            plan = self._batch_plans[ids] = self.pages.batch_plan(plans)
        return plan

    def _staged_keys(self, layer: LayerContext, req: RequestRows) -> torch.Tensor:
        """The exact keys ``[seq_len, h, d]`` of the prompt so far, from the staging pages."""
        positions = torch.arange(req.seq_len, device=layer.kv_cache.device)
        blocks, slots = layer.layout.exact_token_slots(req.prompt_len, req.block_ids, positions)
        return exact_view(layer.kv_cache, layer.layout)[blocks, slots, 0]

    def _record_fidelity(self, layer: LayerContext, req: RequestRows, reference, query, out,
                         step_k, step_v, stats) -> None:
        """Dense attention over the exact prompt and exact generated tokens (kept on the side
        for this diagnostic) vs the compressed output, and the share of each KV head's most
        attended prompt tokens that were kept."""
        ref_k, ref_v = (torch.cat([t, s.cpu()]) for t, s in zip(reference, (step_k, step_v)))
        layer.reference_kv[(req.req_id, layer.index)] = (ref_k, ref_v)
        device = query.device
        dense = causal_attention(query, ref_k.to(device), ref_v.to(device), layer.scale)
        prompt_k = ref_k[: req.prompt_len].to(device)
        mass = chunk_attention_mass(query, prompt_k, 1, layer.scale)  # per token
        kept = self._kept[(req.req_id, layer.index)].to(device)
        attended = torch.zeros_like(mass, dtype=torch.bool).scatter_(1, kept, True)
        fid = measure_fidelity(out, dense, mass, attended,
                               min(FIDELITY_TOP_TOKENS, req.prompt_len))
        stats.record_fidelity(layer.index, fid.relative_error, fid.chunk_recall)
