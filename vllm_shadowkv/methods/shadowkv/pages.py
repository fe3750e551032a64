"""ShadowKV's region of a compressed request, in the pages the engine assigns it.

**Compressed pages.** A page of ``block_size`` token slots holds, for ``block_size`` compressed
prompt tokens, their A rows ``[block_size, r]`` and ``block_size / c`` landmark rows
``[h_kv, d]``: one token slot is ``r + h_kv*d/c`` elements (576 B at Llama-3.1-8B shapes instead
of 4 KiB exact). Landmark row i of KV head h is that head's i-th *selectable* chunk (outlier
chunks are attended exactly and never selected), so decode scores the rows as they are.

**State pages.** The rest of the request's state is stored as *state rows* of ``head_dim``
elements (one token of one KV head): B (``h*r`` rows), the exact region (outlier chunks and the
local window, ``h*E`` rows for K and for V), the selection slots (``h*k*c`` rows for K and for
V: the hit cache that persists between decode steps), and int32 rows for the outlier and slot
chunk ids. A page holds ``page_bytes // row_bytes`` whole rows, so a row never straddles two
pages and every row is addressed as (page, row in page).

Every row is addressed by its element offset in the flat layer cache. Decode reads the rows of
every request of the step with one ``index_select`` per field (the offsets: ``RequestPlan`` and
``BatchPlan``, built once per request and batch, shared by all layers). On the CPU, where the
rows tile the pages (``slots_in_place``), the step writes the rebuilt keys and fetched values of
the slots whose chunk changed straight into their rows of the pages, then gathers the exact
region, the slots and the generated tokens for one attention call; elsewhere it copies them out
first and writes the changed slots back after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_shadowkv.core import ops, transfer
from vllm_shadowkv.core.compress import CompressedPrompt
from vllm_shadowkv.core.decode import DecodeBatch, InPlace, slot_counts
from vllm_shadowkv.methods.base import KVShapes
from vllm_shadowkv.methods.shadowkv.settings import ShadowKVSettings

@dataclass(frozen=True)
class StateLayout:
    """First state row of each field of one compressed request's state (one layer)."""

    num_outliers: int  # o: outlier chunks per KV head
    exact_tokens: int  # E: o*c outlier tokens + the local window
    num_slots: int  # k: selected chunks per KV head
    b: int
    exact_k: int
    exact_v: int
    slot_k: int
    slot_v: int
    outliers: int  # int32 fields, ``ints_per_row`` ids per row
    slot_chunks: int
    pad: int  # padding for a batch whose requests own more slots or outliers (a ratio set):
    pad_ids: int  # a zero K/V row and an id row of -1; 0 rows without a ratio
    rows: int


@dataclass(frozen=True)
class RequestPlan:
    """Where one compressed request's data sits in its pages (any layer: they share the block
    table and the layout)."""

    prompt_len: int
    num_landmarks: int  # selectable landmarks per KV head
    num_slots: int  # selection slots per KV head (its budget in chunks)
    num_outliers: int  # outlier chunks per KV head
    exact_tokens: int
    # int64 element offsets in the flat layer cache (int32 elements for the ids)
    a_rows: torch.Tensor  # [T] A rows
    landmark_rows: torch.Tensor  # [n_sel]
    b: torch.Tensor  # [h*r] state rows
    exact_k: torch.Tensor  # [h*E]
    exact_v: torch.Tensor
    slot_k: torch.Tensor  # [h*k*c]
    slot_v: torch.Tensor
    outliers: torch.Tensor  # [h*o] ids
    slot_chunks: torch.Tensor  # [h*k] ids
    pad: torch.Tensor | None  # [] the padding row (zeros), where requests' sizes differ
    pad_id: torch.Tensor | None  # [] the padding id (-1)


@dataclass(frozen=True)
class BatchPlan:
    """The plans of one decode batch, concatenated (request order = batch order)."""

    req_ids: tuple[str, ...]
    a_rows: torch.Tensor  # [TA]
    a_positions: torch.Tensor  # [TA] int32
    a_start: torch.Tensor  # [B] int32
    landmark_rows: torch.Tensor  # [NL]
    lm_start: torch.Tensor  # [B] int32
    lm_count: torch.Tensor  # [B] int32
    lm_flat: torch.Tensor  # [NL] int64 request * max_landmarks + index among its landmarks
    max_landmarks: int
    b: torch.Tensor  # [B, h*r]
    exact_k: torch.Tensor  # [B, h, E_max] (short requests padded with their own first row)
    exact_v: torch.Tensor
    exact_len: torch.Tensor  # [B]
    slot_k: torch.Tensor  # [B, h*k*c] (a request owning fewer slots: padded)
    slot_v: torch.Tensor
    outliers: torch.Tensor  # [B, h*o] (a request with fewer outliers: padded with id -1)
    slot_chunks: torch.Tensor  # [B, h*k]
    num_slots: int  # k, the most slots a request of the batch owns
    slot_count: torch.Tensor | None  # [B] int32 each request's own slots; None: all own k

    # Where the slots are refilled in place (``ShadowKVPages.slots_in_place``), else None:
    attended_k: torch.Tensor | None = None  # [B, h, E_max + k*c] rows: exact region, slots
    attended_v: torch.Tensor | None = None
    slot_k_rows: torch.Tensor | None = None  # [B, h, k, c] rows of each slot's tokens
    slot_v_rows: torch.Tensor | None = None
    # Per layer cache (by its data pointer): the outlier ids [B, h, o] and each pooled
    # landmark's chunk id [NL, h], fixed once the requests are compressed.
    chunk_ids: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The one-call CPU step (cpu_step.py): its scratch, shared by the layers, and its steps by
    # (layer cache, query rows per request).
    cpu_scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    cpu_steps: dict[tuple[int, int], object] = field(default_factory=dict)


@dataclass(frozen=True)
class ShadowKVPages:
    settings: ShadowKVSettings
    shapes: KVShapes

    # -- sizes (the scheduler and the workers derive the same) ------------------------------
    @property
    def token_bytes(self) -> int:
        """One compressed token: its A row and its share of a chunk landmark."""
        s = self.settings
        return (s.rank + -(-self.shapes.key_width // s.chunk_size)) * self.shapes.elem_bytes

    @property
    def page_bytes(self) -> int:
        return self.shapes.block_size * self.token_bytes

    @property
    def row_bytes(self) -> int:
        return self.shapes.head_size * self.shapes.elem_bytes

    @property
    def rows_per_page(self) -> int:
        rows = self.page_bytes // self.row_bytes
        assert rows > 0, (f"a {self.page_bytes}-byte page cannot hold one {self.row_bytes}-byte "
                          "state row; raise the block size")
        return rows

    @property
    def slots_in_place(self) -> bool:
        """Whether the state rows tile the pages, so that the layer's cache seen as rows holds
        every slot row: the CPU step then refills the slots in place, row by row (a chunk may
        straddle two pages)."""
        return self.page_bytes == self.rows_per_page * self.row_bytes

    @property
    def ints_per_row(self) -> int:
        return self.row_bytes // 4

    @property
    def pads_batches(self) -> bool:
        """Whether requests own different slot or outlier counts (a budget or outlier share
        per prompt), so that a batch pads the smaller ones: each request then keeps a padding
        row and id."""
        s = self.settings
        return s.sparse_budget_ratio is not None or s.outlier_ratio is not None

    def compressed_tokens(self, prompt_len: int) -> int:
        """Prompt tokens that go to the low-rank pool; 0 means the request stays exact."""
        return self.settings.params.compressed_chunks(prompt_len) * self.settings.chunk_size

    def packed_blocks(self, prompt_len: int) -> int:
        return -(-self.compressed_tokens(prompt_len) // self.shapes.block_size)

    def state(self, prompt_len: int) -> StateLayout:
        p, c = self.settings.params, self.settings.chunk_size
        n_chunks = p.compressed_chunks(prompt_len)
        o = min(p.outliers_for(prompt_len), n_chunks)
        k = p.select_chunks_for(prompt_len)  # slots a selection may leave empty stay so
        exact = o * c + prompt_len - n_chunks * c
        h, ipr = self.shapes.num_kv_heads, self.ints_per_row
        padded = int(self.pads_batches)
        sizes = {"b": h * p.rank, "exact_k": h * exact, "exact_v": h * exact,
                 "slot_k": h * k * c, "slot_v": h * k * c,
                 "outliers": -(-h * o // ipr), "slot_chunks": -(-h * k // ipr),
                 "pad": padded, "pad_ids": padded}
        first, at = {}, 0
        for name, rows in sizes.items():
            first[name] = at
            at += rows
        return StateLayout(num_outliers=o, exact_tokens=exact, num_slots=k, rows=at, **first)

    def state_blocks(self, prompt_len: int) -> int:
        return -(-self.state(prompt_len).rows // self.rows_per_page)

    # -- views of a layer's pages (no copies) --------------------------------------------------
    def a_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """Every r-element run of the flat layer cache as a row: A row t of a request is row
        ``RequestPlan.a_rows[t]`` (its element offset). Overlapping, read only."""
        flat, r = kv_cache.view(-1), self.settings.rank
        return torch.as_strided(flat, (flat.numel() - r + 1, r), (1, 1))

    def landmark_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """Every ``h_kv*d``-element run of the flat layer cache as a landmark row ``[h_kv, d]``:
        a request's landmark row i is row ``RequestPlan.landmark_rows[i]``. Read only."""
        flat, h, d = kv_cache.view(-1), self.shapes.num_kv_heads, self.shapes.head_size
        return torch.as_strided(flat, (flat.numel() - h * d + 1, h, d), (1, d, 1))

    def read_rows(self, kv_cache: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """State rows at element ``offsets`` [...] -> [..., head_dim] (a copy)."""
        flat, d = kv_cache.view(-1), self.shapes.head_size
        rows = torch.as_strided(flat, (flat.numel() - d + 1, d), (1, 1))
        return torch.index_select(rows, 0, offsets.flatten()).view(*offsets.shape, d)

    def write_rows(self, kv_cache: torch.Tensor, offsets: torch.Tensor, data: torch.Tensor,
                   data_rows: torch.Tensor | None = None) -> None:
        """``data`` [n, head_dim] (or its rows ``data_rows`` [n]) into the state rows at element
        ``offsets`` [n]."""
        page_elems, d = self.page_bytes // self.shapes.elem_bytes, self.shapes.head_size
        if page_elems == self.rows_per_page * d:  # rows tile the pages: one flat row index
            ops.copy_rows(kv_cache.view(-1, d), offsets // d, data, data_rows)
            return
        if data_rows is not None:
            data = data.index_select(0, data_rows)
        pages = kv_cache.view(kv_cache.shape[0], -1)[:, : self.rows_per_page * d]
        pages.view(kv_cache.shape[0], -1, d)[offsets // page_elems,
                                             offsets % page_elems // d] = data

    @staticmethod
    def ids(kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer cache as flat int32 elements (where the id fields live)."""
        return kv_cache.view(-1).view(torch.int32)

    # -- plans ---------------------------------------------------------------------------------
    def plan(self, prompt_len: int, region_ids: torch.Tensor) -> RequestPlan:
        """Index tensors of one compressed request's region (``region_ids``: its block ids)."""
        bs, c, r = self.shapes.block_size, self.settings.chunk_size, self.settings.rank
        h, device = self.shapes.num_kv_heads, region_ids.device
        packed = self.packed_blocks(prompt_len)
        packed_ids, state_ids = region_ids[:packed].long(), region_ids[packed:].long()
        tokens = torch.arange(self.compressed_tokens(prompt_len), device=device)
        page_elems = self.page_bytes // self.shapes.elem_bytes
        a_rows = packed_ids[tokens // bs] * page_elems + tokens % bs * r
        per_page = bs // c
        st = self.state(prompt_len)
        n_sel = tokens.numel() // c - st.num_outliers
        lm = torch.arange(n_sel, device=device)
        m, ipr, d = self.rows_per_page, self.ints_per_row, self.shapes.head_size

        def rows(first: int, count: int) -> torch.Tensor:
            at = first + torch.arange(count, device=device)
            return state_ids[at // m] * page_elems + at % m * d

        def ints(first: int, count: int) -> torch.Tensor:
            at = torch.arange(count, device=device)
            row = first + at // ipr
            return (state_ids[row // m] * page_elems + row % m * d) * self.shapes.elem_bytes // 4 \
                + at % ipr

        h_e, h_s = h * st.exact_tokens, h * st.num_slots * c
        padded = self.pads_batches
        return RequestPlan(
            prompt_len=prompt_len, num_landmarks=n_sel, num_slots=st.num_slots,
            num_outliers=st.num_outliers, exact_tokens=st.exact_tokens,
            a_rows=a_rows,
            landmark_rows=(packed_ids[lm // per_page] * page_elems + bs * r
                           + lm % per_page * self.shapes.key_width),
            b=rows(st.b, h * r), exact_k=rows(st.exact_k, h_e), exact_v=rows(st.exact_v, h_e),
            slot_k=rows(st.slot_k, h_s), slot_v=rows(st.slot_v, h_s),
            outliers=ints(st.outliers, h * st.num_outliers),
            slot_chunks=ints(st.slot_chunks, h * st.num_slots),
            pad=rows(st.pad, 1)[0] if padded else None,
            pad_id=ints(st.pad_ids, 1)[0] if padded else None)

    def batch_plan(self, req_ids: tuple[str, ...], plans: list[RequestPlan]) -> BatchPlan:
        device = plans[0].a_rows.device
        h = self.shapes.num_kv_heads
        a_counts = [p.a_rows.numel() for p in plans]
        lm_counts = [p.num_landmarks for p in plans]
        e_max = max(p.exact_tokens for p in plans)

        def stack(name: str) -> torch.Tensor:
            return torch.stack([getattr(p, name) for p in plans])

        def padded_exact(name: str) -> torch.Tensor:
            """[h, E] per request, padded with its first row (masked by exact_len; finite data,
            since a masked NaN still poisons the sum). A request with no exact region (no
            outliers, no local window, a prompt of whole chunks) pads with its first B row."""
            out = []
            for p in plans:
                t = getattr(p, name).view(h, -1)
                fill = (t if t.shape[1] else p.b.view(1, -1))[:1, :1]
                out.append(torch.cat([t, fill.expand(h, e_max - t.shape[1])], dim=1))
            return torch.stack(out)

        owned = [p.num_slots for p in plans]
        k = max(owned)

        def padded(name: str, count: str, per_item: int, pad: str) -> torch.Tensor:
            """[B, h*most*per_item]: a request owning fewer than the batch's most slots or
            outliers (``count``) padded, per KV head, with its padding row or id (slots: never
            filled, ``select_slots``; outliers: id -1, no chunk)."""
            counts = [getattr(p, count) for p in plans]
            most, out = max(counts), []
            for p, n in zip(plans, counts):
                t = getattr(p, name).view(h, -1)
                if n < most:
                    t = torch.cat([t, getattr(p, pad).view(1, 1).expand(h, (most - n) * per_item)],
                                  1)
                out.append(t.reshape(-1))
            return torch.stack(out)

        c = self.settings.chunk_size
        slots = {"slot_k": padded("slot_k", "num_slots", c, "pad"),
                 "slot_v": padded("slot_v", "num_slots", c, "pad"),
                 "slot_chunks": padded("slot_chunks", "num_slots", 1, "pad_id")}
        lm_request = torch.repeat_interleave(torch.arange(len(plans), device=device),
                                             torch.tensor(lm_counts, device=device),
                                             output_size=sum(lm_counts))
        lm_start = _starts(lm_counts, device)
        lm_rank = torch.arange(len(lm_request), device=device) - lm_start[lm_request]
        return BatchPlan(
            req_ids=req_ids,
            a_rows=torch.cat([p.a_rows for p in plans]),
            a_positions=torch.cat([torch.arange(n, dtype=torch.int32, device=device)
                                   for n in a_counts]),
            a_start=_starts(a_counts, device),
            landmark_rows=torch.cat([p.landmark_rows for p in plans]),
            lm_start=lm_start, lm_count=torch.tensor(lm_counts, dtype=torch.int32,
                                                     device=device),
            lm_flat=lm_request * max(lm_counts) + lm_rank, max_landmarks=max(lm_counts),
            b=stack("b"), exact_k=padded_exact("exact_k"), exact_v=padded_exact("exact_v"),
            exact_len=torch.tensor([p.exact_tokens for p in plans], device=device),
            outliers=padded("outliers", "num_outliers", 1, "pad_id"), **slots, num_slots=k,
            slot_count=slot_counts(owned, device),
            **(self._in_place_rows(padded_exact, slots, k) if self.slots_in_place else {}))

    def _in_place_rows(self, padded_exact, slots, k: int) -> dict[str, torch.Tensor]:
        h, d, c = self.shapes.num_kv_heads, self.shapes.head_size, self.settings.chunk_size
        fields = {}
        for kv in ("k", "v"):
            slot_rows = slots[f"slot_{kv}"].view(-1, h, k * c) // d
            fields[f"attended_{kv}"] = torch.cat([padded_exact(f"exact_{kv}") // d, slot_rows],
                                                 -1)
            fields[f"slot_{kv}_rows"] = slot_rows.unflatten(-1, (-1, c))
        return fields

    # -- page I/O -----------------------------------------------------------------------------
    def write_compressed(self, kv_cache: torch.Tensor, region_ids: torch.Tensor,
                         plan: RequestPlan, prompt: CompressedPrompt) -> None:
        """A freshly compressed prompt into its region: A rows and selectable landmarks in the
        compressed pages; B, outliers and the exact region in the state rows; empty slots."""
        d, bs, r = self.shapes.head_size, self.shapes.block_size, self.settings.rank
        dtype, device = kv_cache.dtype, kv_cache.device
        packed_ids = region_ids[: self.packed_blocks(plan.prompt_len)].long()
        a_pages = kv_cache.view(kv_cache.shape[0], -1)[:, : bs * r].view(-1, bs, r)
        a = torch.zeros(len(packed_ids) * bs, r, dtype=dtype, device=device)
        a[: prompt.compressed_tokens] = prompt.a
        a_pages[packed_ids] = a.view(-1, bs, r)
        per_page, kw = bs // self.settings.chunk_size, self.shapes.key_width
        lm_pages = kv_cache.view(kv_cache.shape[0], -1)[:, bs * r: bs * r + per_page * kw]
        lm = torch.arange(plan.num_landmarks, device=device)
        lm_pages.view(-1, per_page, kw)[packed_ids[lm // per_page], lm % per_page] = (
            prompt.landmarks.flatten(1).to(dtype))
        self.write_rows(kv_cache, plan.b, prompt.b.reshape(-1, d))
        self.write_rows(kv_cache, plan.exact_k, prompt.exact_k.reshape(-1, d))
        self.write_rows(kv_cache, plan.exact_v, prompt.exact_v.reshape(-1, d))
        ids = self.ids(kv_cache)
        ids[plan.outliers] = prompt.outliers.flatten().to(torch.int32)
        ids[plan.slot_chunks] = -1
        if plan.pad is not None:  # what a batch's padding slots read: empty, zero rows
            ids[plan.pad_id] = -1
            self.write_rows(kv_cache, plan.pad.view(1), kv_cache.new_zeros(1, d))

    def load_batch(self, kv_cache: torch.Tensor, plan: BatchPlan, rope,
                   generated: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
                   gen_len: torch.Tensor, gen_width: int) -> tuple[DecodeBatch, torch.Tensor]:
        """The batch's state in its pages, as the core's ``DecodeBatch``, and its outlier ids
        [B, h, o]. ``gen_len``: each request's generated tokens before the step, ``gen_width``
        the largest (a host int). ``generated`` is either their K/V ``[B, h, capacity, d]``
        (then the exact region and the slots are copied out here, and ``store_slots`` writes
        the refilled slots back) or, where ``slots_in_place`` on the CPU, the rows of their K
        and V ``[2, B, h, G + s_q]`` (the step's own last): the step refills the slots in their
        pages and gathers what it attends after."""
        params, h, d = self.settings.params, self.shapes.num_kv_heads, self.shapes.head_size
        batch, c, k = len(plan.req_ids), params.chunk_size, plan.num_slots
        ids = self.ids(kv_cache)
        outliers, landmark_chunks = self.chunk_ids(kv_cache, plan)
        if isinstance(generated, torch.Tensor):
            state = dict.fromkeys(("exact_k", "exact_v", "slot_k", "slot_v", "gen_k", "gen_v"))
            state["in_place"] = InPlace(
                kv_cache.view(-1, d), torch.cat([plan.attended_k, generated[0]], -1),
                torch.cat([plan.attended_v, generated[1]], -1), plan.exact_k.shape[-1],
                plan.slot_k_rows, plan.slot_v_rows)
        else:
            state = dict(
                exact_k=self.read_rows(kv_cache, plan.exact_k),
                exact_v=self.read_rows(kv_cache, plan.exact_v),
                slot_k=self.read_rows(kv_cache, plan.slot_k).view(batch, h, k * c, d),
                slot_v=self.read_rows(kv_cache, plan.slot_v).view(batch, h, k * c, d),
                gen_k=generated[0], gen_v=generated[1])
        return DecodeBatch(
            params=params, rope=rope.to(kv_cache.device), store_keys=[],
            a=self.a_view(kv_cache), a_rows=plan.a_rows, a_positions=plan.a_positions,
            a_start=plan.a_start,
            b=self.read_rows(kv_cache, plan.b).view(batch, h, params.rank, d),
            landmarks=self.landmark_view(kv_cache), lm_rows=plan.landmark_rows,
            landmark_chunks=landmark_chunks, lm_start=plan.lm_start, lm_count=plan.lm_count,
            max_landmarks=plan.max_landmarks, exact_len=plan.exact_len,
            slot_chunks=ids[plan.slot_chunks].view(batch, h, k), slot_count=plan.slot_count,
            gen_len=gen_len, gen_width=gen_width, **state,
        ), outliers

    def chunk_ids(self, kv_cache: torch.Tensor,
                  plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's outlier ids [B, h, o] and each pooled landmark's chunk id [NL, h] int32
        in this layer cache: fixed once the requests are compressed, so read once."""
        cached = plan.chunk_ids.get(kv_cache.data_ptr())
        if cached is None:
            outliers = self.ids(kv_cache)[plan.outliers].view(len(plan.req_ids),
                                                              self.shapes.num_kv_heads, -1)
            cached = plan.chunk_ids[kv_cache.data_ptr()] = (
                outliers, _selectable_chunk_ids(outliers, plan))
        return cached

    def store_slots(self, kv_cache: torch.Tensor, plan: BatchPlan, batch: DecodeBatch) -> None:
        """Persist the selection slots after a step: all slot ids, and the K/V rows of the slots
        the step filled (``batch.step_filled``: the misses, flat ids over ``[B, h, k]``)."""
        n, h, k = batch.slot_chunks.shape
        c, d = self.settings.chunk_size, self.shapes.head_size
        self.ids(kv_cache)[plan.slot_chunks] = batch.slot_chunks.view(n, -1)
        if batch.in_place is not None or batch.step_filled is None \
                or batch.step_filled.numel() == 0:
            return
        slots = transfer.to_device_async(batch.step_filled, kv_cache.device)
        rows = (slots.unsqueeze(1) * c + torch.arange(c, device=slots.device)).flatten()
        for offsets, data in ((plan.slot_k, batch.slot_k), (plan.slot_v, batch.slot_v)):
            self.write_rows(kv_cache, offsets.flatten().index_select(0, rows),
                            data.view(-1, d), rows)


def _starts(counts: list[int], device) -> torch.Tensor:
    return (torch.tensor([0] + counts[:-1], device=device).cumsum(0)).to(torch.int32)


def _selectable_chunk_ids(outliers: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
    """Chunk id of each pooled landmark row, [NL, h] int32. With a KV head's outlier ids sorted
    (o_j), its i-th selectable chunk is i + #{j : o_j - j <= i}: the non-outliers in order.
    Padding ids (-1) sort last and count nowhere."""
    batch, h, o = outliers.shape
    n, device = plan.max_landmarks, outliers.device
    present = torch.where(outliers < 0, n + o, outliers.long())  # padding: gaps past every i
    gaps = present.sort(dim=-1).values - torch.arange(o, device=device)
    # #{j : gaps_j <= i} for every i at once: a histogram of the gaps and its running sum
    # (searching 16K ranks among the gaps took 0.7 ms per layer and step at 128K).
    below = torch.zeros(batch, h, n + 1, dtype=torch.int32, device=device).scatter_add_(
        -1, gaps.clamp(0, n), torch.ones_like(gaps, dtype=torch.int32)).cumsum(-1,
                                                                           dtype=torch.int32)
    ids = torch.arange(n, dtype=torch.int32, device=device) + below[..., :n]  # [B, h, n_max]
    # One row gather of [B * n_max, h] (advanced indexing on two dims cost 2x).
    return ids.transpose(1, 2).reshape(batch * n, h).index_select(0, plan.lm_flat)
