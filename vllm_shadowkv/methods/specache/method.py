"""SpeCache (Jie et al., ICML 2025) on the shared engine: every token of the prompt KIVI-quantized
on the pages (1 or 2 bits), its exact 16-bit K/V in the host store; each decode step picks the
``top_k`` tokens per KV head that the output row attends most over the low-bit keys, fetches
those that missed the previous step's slots, and attends them exactly in place of their low-bit
copies (``prefetch: "current"``, the paper's non-speculative mode). With ``prefetch:
"speculative"`` each decode step also carries a guess of the next token (methods/README.md,
"SpeCache's second query row"): the output row attends the slots the previous step's guess row
picked, with no fetch before it, and the guess row's top-k is fetched for the next step: decided
now, gathered and written when the next step reaches the layer (``methods/slots.py``), so on
CUDA the decision's copy to the host overlaps the rest of this step and the rows' copy the
next step's earlier layers. A request's first decode step is then the paper's pre-decoding
(``pre_decode``): low-bit attention alone, its output row's top-k fetched for the next step,
its tokens dropped and decoded again (methods/specache/guess.py, patches/pre_decode.py).

The pages are MiniKV's with every token kept and ``top_k`` exact rows per KV head for the slots,
and the decode step is MiniKV's (16-bit tail and generated-token ring exact, the quantized
groups fused), with the quantized part replaced by the mixed attention
(core/mixed_attention.py). Generated tokens are folded into low-bit groups every ``residual``
tokens as in the paper, but only the prompt is in the store: folded generated tokens are
attended from their low-bit copies and never fetched."""

from __future__ import annotations

import torch

from vllm_shadowkv.core import mixed_attention, ops
from vllm_shadowkv.core.attention import merge_attention
from vllm_shadowkv.methods.base import KVShapes, LayerContext, RequestRows
from vllm_shadowkv.methods.minikv.method import MiniKVMethod
from vllm_shadowkv.methods.minikv.pages import BatchPlan, MiniKVPages, RequestPlan
from vllm_shadowkv.methods.slots import SlotFetch, held_slots, plan_fetch
from vllm_shadowkv.methods.specache.guess import mark_pre_decoded, missed
from vllm_shadowkv.methods.specache.settings import SpeCacheSettings
from vllm_shadowkv.store import paged_bytes


class SpeCacheMethod(MiniKVMethod):
    name = "specache"
    settings_cls = SpeCacheSettings
    # The paper's headline configuration (§4.1): 1 bit, group 64, about 0.10x the 16-bit KV.
    capacity_claim = ({}, 9.0)
    capacity_lengths = (32768, 131072)
    needs_prefill_lse = False  # every token is kept: no heavy hitters to score
    prefix_caching_off = None  # nothing is gathered while prefilling

    def __init__(self, settings: SpeCacheSettings, shapes: KVShapes) -> None:
        super().__init__(settings, shapes)
        self.pages = MiniKVPages(settings, shapes, slots=settings.top_k)
        # Quantized token ids in each request's slots, per (request, layer): [h, top_k] int32,
        # -1 empty. The slots' K/V are rows of the request's pages (RequestPlan.slot_*_rows).
        self._slot_tokens: dict[tuple[str, int], torch.Tensor] = {}
        # (request, layer) whose slots a guess row picked for the request's next step.
        self._ahead: set[tuple[str, int]] = set()
        # (request, layer) compressed and not decoded yet: their first step may pre-decode.
        self._undecoded: set[tuple[str, int]] = set()
        self._pre_decoding: set[tuple[str, int]] = set()  # in the layer's current call
        # Per layer, the guess rows' fetches whose rows are not in the slots yet.
        self._pending: dict[int, list[SlotFetch]] = {}

    @classmethod
    def covering_settings(cls, key_width: int, context_len: int) -> dict:
        # Every prompt token fetched exact at each step, and no generated token folded.
        residual = -(-context_len // 64) * 64
        return {"top_k": context_len, "residual": residual}

    # -- pages and store ------------------------------------------------------------------------
    def _fetchable(self, prompt_len: int) -> int:
        """Prompt tokens per KV head in quantized groups: the ones the store holds."""
        return self.pages.shape(0, prompt_len).groups * self.settings.group_size

    def store_bytes(self, layer: int, prompt_len: int) -> int:
        if not self.settings.top_k:  # plain KIVI pages: nothing is fetched, nothing stored
            return 0
        return paged_bytes(self.shapes.num_kv_heads * self._fetchable(prompt_len),
                           self.store_row_bytes(layer))

    def store_row_shape(self, layer: int) -> tuple[int, ...]:
        return (2, self.shapes.head_size)  # one token of one KV head: key, value

    # -- hooks ----------------------------------------------------------------------------------
    def finalize(self, layer: LayerContext, req: RequestRows, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
        super().finalize(layer, req, keys, values)
        fetchable = self._fetchable(req.prompt_len)
        if self.settings.top_k and fetchable:
            rows = torch.stack([keys[:fetchable], values[:fetchable]], dim=2)  # [P, h, 2, d]
            layer.store.put((req.req_id, layer.index), rows.transpose(0, 1).cpu())
        self._slot_tokens.pop((req.req_id, layer.index), None)  # a recomputed request
        self._ahead.discard((req.req_id, layer.index))
        self._undecoded.add((req.req_id, layer.index))
        # Empty slots are masked, but a reused page may hold anything (NaN bit patterns of
        # another request's codes), and a masked NaN value still poisons the weighted sum.
        plan = self._plan(layer, req, self.pages.shape(layer.index, req.prompt_len))
        zeros = torch.zeros(plan.slot_key_rows.numel(), self.shapes.head_size,
                            dtype=layer.kv_cache.dtype, device=layer.kv_cache.device)
        self.pages.write_rows(layer.kv_cache, plan.slot_key_rows.flatten(), zeros)
        self.pages.write_rows(layer.kv_cache, plan.slot_value_rows.flatten(), zeros)

    def release(self, req_id: str) -> None:
        super().release(req_id)
        for key in [k for k in self._slot_tokens if k[0] == req_id]:
            del self._slot_tokens[key]
            self._ahead.discard(key)
        self._undecoded = {k for k in self._undecoded if k[0] != req_id}
        for layer, fetches in list(self._pending.items()):
            self._pending[layer] = [f for f in fetches if f.drop(req_id)]
            if not self._pending[layer]:
                del self._pending[layer]

    # -- decode ---------------------------------------------------------------------------------
    def _selected(self, layer: int, req: RequestRows) -> int:
        return 0  # counted by ``_fetch``: the store rows brought into the slots

    def _merge_quantized(self, layer: LayerContext, reqs: list[RequestRows],
                         plans: list[RequestPlan], q: torch.Tensor, batch: BatchPlan,
                         out_exact: torch.Tensor, lse_exact: torch.Tensor) -> torch.Tensor:
        """The quantized groups with each KV head's top-k tokens attended exact from the slots,
        merged with the exact part. Each (request, KV head) is one row of the group table.

        The slots hold the top-k of the output row (the last committed one), fetched now; in
        the speculative mode, those of the previous step's guess row instead, fetched then,
        and after the attention the guess row's top-k is fetched for the next step. A request
        with nothing picked ahead (its first decode step, a step without a guess) picks now,
        and so does every request with ``verify_guess`` (with "miss", every request whose
        last guess was wrong): only what the guess missed is then fetched in line. With
        ``pre_decode`` a request's first decode step with a guess is instead the paper's
        pre-decoding: nothing fetched, its output row attends the low-bit cache alone and
        picks the next step's top-k, and its tokens are dropped (methods/specache/guess.py)."""
        if not self.settings.top_k:
            return super()._merge_quantized(layer, reqs, plans, q, batch, out_exact, lse_exact)
        n, s_q, hq, d = q.shape
        h, guess = self.shapes.num_kv_heads, reqs[0].guess
        g = hq // h
        per_head = q.view(n, s_q, h, g, d).transpose(1, 2).reshape(n * h, s_q, g, d)
        pool = self.pages.unit_pool(layer.kv_cache)
        keys = [(r.req_id, layer.index) for r in reqs]
        for fetch in self._pending.pop(layer.index, []):  # the rows picked ahead
            fetch.complete(layer, self.pages)
        ahead = self.settings.prefetch == "speculative" and guess > 0
        picked_ahead = [i for i, key in enumerate(keys) if ahead and key in self._ahead]
        pre = ([i for i, key in enumerate(keys) if key in self._undecoded]
               if ahead and self.settings.pre_decode else [])
        self._undecoded.difference_update(keys)
        self._pre_decoding = {keys[i] for i in pre}
        # Who picks from the output row now and fetches in line: with verify_guess every
        # request (with "miss", those whose guess was wrong), and those with nothing picked
        # ahead; never the pre-decoded ones, whose output row picks for the next step.
        verify = self.settings.verify_guess
        wrong = missed() if verify == "miss" else frozenset()
        now = [i for i in range(n) if i not in pre and (
            verify is True or i not in picked_ahead or reqs[i].req_id in wrong)]
        for i in picked_ahead:
            if i in now:
                layer.stats(reqs[i].req_id).verified_steps += 1
        measure = self.settings.measure_fidelity and bool(picked_ahead)
        # One pass over the low-bit cache, all of it, with the logits of the row that picks
        # next: the guess row's when picking ahead, else the output row's.
        own_row = s_q - 1 - guess
        quant = ops.quant_attention(per_head, pool, batch.group_table, batch.group_count,
                                    self.pages.fmt, layer.scale, s_q - 1 if ahead else own_row,
                                    batch.most_groups)
        if now or measure or pre:  # the output row's top-k (from the pass unless ahead)
            wanted = self._wanted(pool, layer, reqs, per_head, lse_exact, batch, own_row,
                                  None if ahead else quant[2])
        if measure:
            self._record_speculation(
                layer, [reqs[i] for i in picked_ahead], wanted.view(n, h, -1)[picked_ahead],
                torch.stack([self._slot_tokens[keys[i]] for i in picked_ahead]))
        if now:
            self._fetch(layer, [reqs[i] for i in now], [plans[i] for i in now],
                        wanted.view(n, -1)[now].view(-1, self.settings.top_k)).complete(
                            layer, self.pages)
        slots = held_slots(self._slot_tokens, keys, h, self.settings.top_k,
                           q.device).flatten(0, 1)  # [n * h, k]
        slot_k, slot_v = self._slot_kv(layer, plans)
        out_q, lse_q = mixed_attention.swap_in_exact(
            quant[:2], per_head, pool, batch.group_table, batch.group_count, self.pages.fmt,
            layer.scale, slots.view(n * h, 1, -1), slot_k, slot_v)
        out_q = out_q.view(n, h, s_q, g, d).transpose(1, 2).reshape(n, s_q, hq, d)
        lse_q = lse_q.view(n, h, s_q, g).transpose(1, 2).reshape(n, s_q, hq)
        out, _ = merge_attention([out_exact, out_q], [lse_exact, lse_q])
        if ahead:  # the next step's slots, from the guess row, completed at that step
            picks = self._wanted(pool, layer, reqs, per_head, lse_exact, batch, s_q - 1, quant[2])
            if pre:  # from the output row: the same token is decoded again next step
                picks.view(n, -1)[pre] = wanted.view(n, -1)[pre]
                self._record_pre_decoded(layer, [reqs[i] for i in pre])
            self._pending.setdefault(layer.index, []).append(self._fetch(layer, reqs, plans,
                                                                         picks))
            self._ahead.update(keys)
        else:
            self._ahead.difference_update(keys)
        if self.settings.measure_fidelity:  # exact prompt tokens: the slots and the tail
            for i, req in enumerate(reqs):
                tail = torch.arange(self._fetchable(req.prompt_len), req.prompt_len).expand(h, -1)
                self._kept[(req.req_id, layer.index)] = torch.cat(
                    [slots[i * h:(i + 1) * h].clamp(min=0).long().cpu(), tail], dim=1)
        return out

    def _wanted(self, pool, layer: LayerContext, reqs: list[RequestRows],
                per_head: torch.Tensor, lse_exact: torch.Tensor, batch: BatchPlan,
                row: int, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The top-k fetchable tokens ``[n * h, k]`` of query row ``row`` (per KV head, by its
        probabilities over the whole context, the exact part's included), from the row's
        ``logits`` over the low-bit keys when the attention pass returned them."""
        n, h = len(reqs), self.shapes.num_kv_heads
        g = per_head.shape[2]
        row_lse = lse_exact[:, row].view(n, h, g).reshape(n * h, g)
        if logits is None:
            logits = ops.quant_logits(per_head[:, row], pool, batch.group_table,
                                      batch.group_count, self.pages.fmt, layer.scale,
                                      batch.most_groups)
        # Folded generated tokens count in the probabilities but cannot be fetched. They follow
        # each request's prompt groups: only the columns past the shortest prompt's are read.
        fetchable = [self._fetchable(r.prompt_len) for r in reqs]
        first = min(fetchable)
        tail = logits[..., first:]  # a view: masked in place below
        limits = torch.tensor(fetchable, device=per_head.device) - first
        folded = (torch.arange(tail.shape[-1], device=per_head.device)
                  >= limits.repeat_interleave(h).view(-1, 1, 1))
        other_lse = torch.logaddexp(
            row_lse, torch.logsumexp(tail.masked_fill(~folded, float("-inf")), dim=-1))
        tail.masked_fill_(folded, float("-inf"))
        return ops.top_k_tokens(logits, other_lse, 1, self.settings.top_k).view(n * h, -1)

    def _fetch(self, layer: LayerContext, reqs: list[RequestRows], plans: list[RequestPlan],
               wanted: torch.Tensor) -> SlotFetch:
        """Assign the ``wanted`` tokens ``[n * h, k]`` (-1: none) to the slots
        (``methods/slots.py``: those already there stay, the others are to be fetched by the
        returned fetch, before the slots are next read)."""
        n, h, k = len(reqs), self.shapes.num_kv_heads, self.settings.top_k
        held = held_slots(self._slot_tokens, [(r.req_id, layer.index) for r in reqs], h, k,
                          wanted.device)
        key_rows, value_rows = self._slot_rows(plans)
        slots, fetch = plan_fetch(reqs, held, wanted.view(n, h, k), key_rows.view(n, h, k),
                                  value_rows.view(n, h, k))
        for r, tokens in zip(reqs, slots):
            self._slot_tokens[(r.req_id, layer.index)] = tokens
        return fetch

    def _record_fidelity(self, layer: LayerContext, req: RequestRows, *args) -> None:
        # A pre-decoding step's output is dropped (it attended the low-bit cache alone): the
        # measure is of the attention the emitted tokens got.
        if (req.req_id, layer.index) not in self._pre_decoding:
            super()._record_fidelity(layer, req, *args)

    def _record_pre_decoded(self, layer: LayerContext, reqs: list[RequestRows]) -> None:
        mark_pre_decoded(r.req_id for r in reqs)
        for req in reqs:
            layer.stats(req.req_id).pre_decode_steps += 1

    def _record_speculation(self, layer: LayerContext, reqs: list[RequestRows],
                            own: torch.Tensor, slots: torch.Tensor) -> None:
        """measure_fidelity: of the top-k each output row would pick itself (``own`` ``[n, h,
        k]``, -1: none), how many the previous step's guess row put in its ``slots``."""
        valid = own >= 0
        hits = (own.unsqueeze(-1) == slots.unsqueeze(-2)).any(-1) & valid
        for req, (wanted, hit) in zip(reqs, torch.stack([valid.sum((1, 2)), hits.sum((1, 2))],
                                                        dim=1).tolist()):
            stats = layer.stats(req.req_id)
            stats.speculated += wanted
            stats.speculation_hits += hit

    def _slot_kv(self, layer: LayerContext, plans: list[RequestPlan]):
        """The slots' exact K/V ``[n * h, 1, k, d]`` each, read from the pages."""
        pool = self.pages.row_pool(layer.kv_cache)
        key_rows, value_rows = self._slot_rows(plans)
        return pool[key_rows.unsqueeze(1)], pool[value_rows.unsqueeze(1)]

    def _slot_rows(self, plans: list[RequestPlan]) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids of the batch's slots in the layer's pages, keys and values ``[n * h, k]``."""
        k = self.settings.top_k
        return (torch.stack([p.slot_key_rows for p in plans]).view(-1, k),
                torch.stack([p.slot_value_rows for p in plans]).view(-1, k))
