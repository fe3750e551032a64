"""Sparse decode of one layer for a ragged batch of compressed requests.

`DecodeBatch` holds the GPU-side state of a fixed set of requests, built once from their
`CompressedPrompt`s (plan once, step many times, as FlashInfer's plan/run split): the growing
pools (A rows, landmarks) are packed with per-request start/count; the fixed-size parts are
padded [B, h_kv, ...] tensors. Each `decode_step`:
  1. appends the step's keys/values to the exact generated-token region;
  2. scores the landmarks, takes the top-k chunks per KV head (k = sparse_budget // chunk_size,
     at most the request's landmark count);
  3. keeps hits in their slots, gives misses the freed slots (`ops.select_slots`);
  4. rebuilds the missed keys (A rows x B, RoPE at their true positions) and, overlapping that
     on CUDA, copies the missed values from the value store on a copy stream (transfer.py);
  5. attends exactly the exact region (outliers + local window), the slots and the generated
     tokens, merging the three by log-sum-exp.
Slots start empty: the first step rebuilds every selected chunk (the authors' accuracy path; the
efficient path primes them with exact prefill keys).

In the engine's CPU step the slots are refilled where they lie in the pages (``InPlace``): the
rebuilt keys and fetched values are written once, straight into their pages, and the attention
then reads the exact region, the slots and the generated tokens where they lie, in one call
(copying the slots out before the refill and back after cost 2 copies of every refilled row).
"""

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from . import ops, transfer
from .attention import attention_with_lse, decode_masks, merge_attention
from .compress import CompressedPrompt
from .params import ShadowKVParams
from .rope import RopeCache
from .select import sink_recent_scores
from .store import ValueStore


def _pad_stack(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Stack [h, n_i, d] tensors into [B, h, max n_i, d], zero padded along `dim` (of each)."""
    width = max(t.shape[dim] for t in tensors)
    padded = []
    for t in tensors:
        pad = [0, 0] * (t.dim() - 1 - dim) + [0, width - t.shape[dim]]
        padded.append(torch.nn.functional.pad(t, pad))
    return torch.stack(padded)


def _starts(counts: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + counts[:-1], device=device).cumsum(0).to(torch.int32)


@dataclass(frozen=True)
class InPlace:
    """Where a batch's attended K/V and slots lie in the engine's pages (a layer's cache)."""

    rows: torch.Tensor  # [N, d] the layer's pages as rows
    k_rows: torch.Tensor  # [B, h_kv, E + k*c + G] int64 rows of the attended keys, in order:
    v_rows: torch.Tensor  # exact region (E), slots, generated tokens (the step's own included)
    exact_width: int  # E
    slot_k: torch.Tensor  # [B, h_kv, k, c] int64 rows of ``rows`` holding each slot's
    slot_v: torch.Tensor  # keys / values, token by token (a chunk may straddle two pages)

    def generated(self, slot_width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The generated tokens' keys and values, [B, h_kv, G + s_q, d] each (a gather)."""
        return tuple(self.rows[rows[:, :, self.exact_width + slot_width:]]
                     for rows in (self.k_rows, self.v_rows))


def slot_counts(owned: list[int], device) -> torch.Tensor | None:
    """``DecodeBatch.slot_count`` for requests owning ``owned`` slots each (the batch has the
    largest): None where they all own as many."""
    if min(owned) == max(owned):
        return None
    return torch.tensor(owned, dtype=torch.int32, device=device)


@dataclass
class DecodeBatch:
    params: ShadowKVParams
    rope: RopeCache
    store_keys: list[Hashable]
    a: torch.Tensor  # [NA, r] rows of A, any strides (in the engine: the rows of pages)
    a_rows: torch.Tensor  # [TA] int64 row of `a` holding each pool row
    a_positions: torch.Tensor  # [TA] int32
    a_start: torch.Tensor  # [B] int32
    b: torch.Tensor  # [B, h_kv, r, d]
    landmarks: torch.Tensor  # [N, h_kv, d] rows of landmarks, any strides (engine: of pages)
    lm_rows: torch.Tensor  # [NL] int64 row of `landmarks` holding each pool row
    landmark_chunks: torch.Tensor  # [NL, h_kv] int32
    lm_start: torch.Tensor  # [B] int32
    lm_count: torch.Tensor  # [B] int32
    max_landmarks: int
    exact_k: torch.Tensor  # [B, h_kv, E, d] outliers + local window
    exact_v: torch.Tensor
    exact_len: torch.Tensor  # [B]
    slot_chunks: torch.Tensor  # [B, h_kv, k] int32, -1 = empty
    slot_k: torch.Tensor  # [B, h_kv, k*c, d]
    slot_v: torch.Tensor
    gen_k: torch.Tensor  # [B, h_kv, capacity, d]
    gen_v: torch.Tensor
    gen_len: torch.Tensor  # [B] int64
    gen_width: int = 0  # max of gen_len, kept on the host (reading it back would sync)
    # [B] int32: the slots each request owns (its budget, ``sparse_budget_ratio``), the rest of
    # its k padding that stays empty; None: every request owns k.
    slot_count: torch.Tensor | None = None
    # The last step's refill, on the host: missed chunks per request, and the flat slot ids
    # (over [B, h_kv, k]) they filled, the only slots whose pages need writing.
    step_misses: list[int] = field(default_factory=list)
    step_filled: torch.Tensor | None = None
    # In the pages (then exact_*, slot_* and gen_* are None: the attention reads the pages;
    # gen_len counts the tokens before the step, already in the pages).
    in_place: InPlace | None = None

    def generated(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The generated tokens' K/V, [B, h_kv, >= G + s_q, d] each (after a step: its own)."""
        if self.in_place is None:
            return self.gen_k, self.gen_v
        return self.in_place.generated(self.slot_chunks.shape[-1] * self.params.chunk_size)

    @classmethod
    def build(cls, prompts: Sequence[CompressedPrompt], store_keys: Sequence[Hashable],
              rope: RopeCache, params: ShadowKVParams, gen_capacity: int = 64) -> "DecodeBatch":
        first = prompts[0]
        device, dtype = first.exact_k.device, first.exact_k.dtype
        batch, (h_kv, _, head_dim) = len(prompts), first.exact_k.shape
        owned = [params.select_chunks_for(p.num_tokens) for p in prompts]
        k, c = max(owned), params.chunk_size
        lm_counts = [p.landmarks.shape[0] for p in prompts]
        a_counts = [p.compressed_tokens for p in prompts]

        def slots(width: int) -> torch.Tensor:
            return torch.zeros(batch, h_kv, width, head_dim, dtype=dtype, device=device)

        return cls(
            params=params, rope=rope.to(device), store_keys=list(store_keys),
            a=torch.cat([p.a for p in prompts]),
            a_rows=torch.arange(sum(a_counts), device=device),
            a_positions=torch.cat([p.a_positions for p in prompts]),
            a_start=_starts(a_counts, device),
            b=torch.stack([p.b for p in prompts]),
            landmarks=torch.cat([p.landmarks for p in prompts]),
            lm_rows=torch.arange(sum(lm_counts), device=device),
            landmark_chunks=torch.cat([p.landmark_chunks for p in prompts]),
            lm_start=_starts(lm_counts, device),
            lm_count=torch.tensor(lm_counts, dtype=torch.int32, device=device),
            max_landmarks=max(lm_counts),
            exact_k=_pad_stack([p.exact_k for p in prompts], 1),
            exact_v=_pad_stack([p.exact_v for p in prompts], 1),
            exact_len=torch.tensor([p.exact_k.shape[1] for p in prompts], device=device),
            slot_chunks=torch.full((batch, h_kv, k), -1, dtype=torch.int32, device=device),
            slot_k=slots(k * c), slot_v=slots(k * c),
            gen_k=slots(gen_capacity), gen_v=slots(gen_capacity),
            gen_len=torch.zeros(batch, dtype=torch.int64, device=device),
            slot_count=slot_counts(owned, device),
        )

    def _append_generated(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        s_q = k_new.shape[1]
        needed = self.gen_width + s_q
        if needed > self.gen_k.shape[2]:
            grow = max(needed, 2 * self.gen_k.shape[2]) - self.gen_k.shape[2]
            self.gen_k = torch.nn.functional.pad(self.gen_k, (0, 0, 0, grow))
            self.gen_v = torch.nn.functional.pad(self.gen_v, (0, 0, 0, grow))
        rows = torch.arange(len(self.gen_len), device=k_new.device).unsqueeze(1)
        cols = self.gen_len.unsqueeze(1) + torch.arange(s_q, device=k_new.device)
        self.gen_k[rows, :, cols] = k_new.to(self.gen_k.dtype)
        self.gen_v[rows, :, cols] = v_new.to(self.gen_v.dtype)
        self.gen_len = self.gen_len + s_q  # (not in place: the engine shares it between layers)
        self.gen_width += s_q

    def _missed_rows(self, miss_slots, miss_count) -> tuple[torch.Tensor, torch.Tensor]:
        """(KV head, chunk id) of every missed slot on the host, (b, h, miss) in row-major
        order (``ops.list_misses``: the layer's one host sync on CUDA); also sets
        ``step_misses`` and ``step_filled``."""
        heads, chunks, self.step_filled, self.step_misses = ops.list_misses(
            self.slot_chunks, miss_slots, miss_count)
        return heads, chunks

    def _fetch_values(self, heads, chunks, per_request, store: ValueStore) -> torch.Tensor:
        """The missed value rows of every request gathered on the host at once and copied to
        the slots' device on the copy stream (see transfer.py)."""
        shape = (len(heads), self.params.chunk_size, self.slot_v.shape[-1])
        staging = transfer.host_staging(shape, self.slot_v)
        store.gather_many(self.store_keys, heads, chunks, per_request, staging)
        return transfer.to_device_async(staging, self.slot_v.device)

    def _refresh_slots(self, q: torch.Tensor, store: ValueStore) -> None:
        if self.params.selection == "sink_recent":
            scores = sink_recent_scores(self.landmark_chunks, self.lm_start, self.lm_count,
                                        self.max_landmarks)
        else:
            scores = ops.landmark_scores(q, self.landmarks, self.lm_rows, self.lm_start,
                                         self.lm_count, self.max_landmarks,
                                         1.0 / math.sqrt(q.shape[-1]))
        self.slot_chunks, miss_slots, miss_count = ops.select_slots(
            scores, self.landmark_chunks, self.lm_start, self.lm_count, self.slot_chunks.shape[-1],
            self.slot_chunks, self.slot_count)
        # The host needs the missed rows before the rebuild is queued: reading them after would
        # wait for the rebuild. Then, on CUDA, the rebuild runs while the host gathers the
        # values and the copy stream moves them.
        heads, chunks = self._missed_rows(miss_slots, miss_count)
        if heads.numel() == 0:
            return
        c, pages = self.params.chunk_size, self.in_place
        # On the CPU the store's rows go straight into their slots (no staging copy):
        # step_filled lists the slots in the (b, h, miss) order of heads and chunks.
        if pages is not None:  # slots are rows of the pages
            key_slots, key_index = pages.rows, pages.slot_k
            value_slots = pages.rows, pages.slot_v.flatten(0, 2).index_select(0, self.step_filled)
        else:
            key_slots, key_index, value_slots = self.slot_k, None, None
            if ops.native_cpu(self.slot_v) and self.slot_v.is_contiguous():
                value_slots = self.slot_v.view(-1, c, self.slot_v.shape[-1]), self.step_filled
        ops.rebuild_keys(self.a, self.a_rows, self.a_positions, self.a_start, self.b,
                         self.slot_chunks, miss_slots, miss_count, self.rope, key_slots,
                         key_index)
        if value_slots is not None:
            store.gather_many(self.store_keys, heads, chunks, self.step_misses, *value_slots)
            return
        staging = self._fetch_values(heads, chunks, self.step_misses, store)
        flat = miss_count.flatten()
        staging_start = (flat.cumsum(0) - flat).view_as(miss_count).to(torch.int32)
        ops.scatter_values(staging, staging_start, miss_slots, miss_count, self.slot_v)


def decode_step(
    batch: DecodeBatch,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    store: ValueStore,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of one layer. q [B, s_q, h_q, d], k_new/v_new [B, s_q, h_kv, d], all
    post-RoPE, the step's tokens following each request's previous ones (causal among them);
    k_new/v_new are not read where the batch is ``in_place`` (the pages hold them already).
    -> out [B, s_q, h_q, d], lse [B, s_q, h_q] fp32 (natural log). scale defaults to
    1/sqrt(d); landmark scoring always uses 1/sqrt(d) as the paper does."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s_q, c = q.shape[1], batch.params.chunk_size
    gen_before = batch.gen_len  # (both branches replace gen_len, never write it in place)
    if batch.in_place is None:
        batch._append_generated(k_new, v_new)
    else:  # the step's K/V are in the pages already
        batch.gen_len, batch.gen_width = batch.gen_len + s_q, batch.gen_width + s_q
    batch.step_misses, batch.step_filled = [0] * q.shape[0], None
    if batch.max_landmarks > 0:
        batch._refresh_slots(q, store)

    if batch.in_place is not None:  # one call over the rows where they lie, after the refill
        pages = batch.in_place
        return ops.decode_attention(q, pages.rows, pages.k_rows, pages.v_rows, pages.exact_width,
                                    batch.exact_len, batch.slot_chunks, c, gen_before, scale)
    gen_width = batch.gen_width
    exact_mask, slot_mask, gen_mask = decode_masks(
        batch.exact_k.shape[2], batch.exact_len, batch.slot_chunks, c, gen_before, gen_width, s_q)
    parts = [
        attention_with_lse(q, batch.exact_k, batch.exact_v, exact_mask, scale),
        attention_with_lse(q, batch.gen_k[:, :, :gen_width], batch.gen_v[:, :, :gen_width],
                           gen_mask, scale),
    ]
    if batch.max_landmarks > 0:
        parts.append(attention_with_lse(q, batch.slot_k, batch.slot_v, slot_mask, scale))
    return merge_attention([p[0] for p in parts], [p[1] for p in parts])
