"""MiniKV's pages: what a compressed request keeps in each layer, and where it sits.

**Kept tokens.** Layer l keeps, per KV head, ``kept = int(P * heavy_l) + int(P * recent)``
prompt tokens (all P when that covers the prompt). The first ``kept // G`` groups of G are
quantized; the last ``kept % G`` stay 16-bit (all of them at 16 bits: quantization off).

**Units and rows.** A *unit* is one quantized group of one KV head (``KiviFormat.group_bytes``:
codes, then the key and value scales and zeros; 2 KiB at Llama-3.1-8B shapes and 2 bits); a
*row* is ``head_dim`` 16-bit elements, one token of one KV head, key or value. A layer's page
is a whole number of units and of rows, so the layer's cache reads as one pool of units
``[n_units, 1, ...]`` (unit id = page * units_per_page + slot) and one pool of rows
``[n_rows, d]``, and nothing straddles two pages. A page holds units or rows, never both.

**Page size per layer.** One token slot of layer l holds what one *prompt* token costs there:
its share (``kept / P``) of a quantized token, rounded up to whole units per page. A layer that
keeps less (the pyramid's upper layers) has smaller pages, so vLLM's block counts (the same for
every layer) are prompt tokens / block size plus a little, and its capacity figure shows the
compression.

**Where a request's data is.** Region pages: the groups (unit k = group * h + head), then the
16-bit rows (key rows, then value rows, head-major). Growth pages (after the engine's ring of
``residual`` exact generated tokens): each fold of the ring appends ``residual / G`` groups per
head (16-bit rows at 16 bits) in the same order. ``RequestPlan`` holds the ids, built once per
request and layer shape and extended at each fold (``upto`` gives it as it stood after a number
of folds); ``BatchPlan`` pads them into the group table and row index of one decode call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from vllm_shadowkv.core import ops
from vllm_shadowkv.core.kivi import QuantizedGroups
from vllm_shadowkv.methods.base import KVShapes
from vllm_shadowkv.methods.minikv.settings import MiniKVSettings

_EPS = 1e-9  # budgets are floats: 0.5 * 16 must not round up to 9 units


@dataclass(frozen=True)
class LayerShape:
    """One request's sizes in one layer (hashable: layers with equal shapes share plans)."""

    units_per_page: int  # quantized units per page (0 at 16 bits)
    rows_per_page: int
    groups: int  # quantized groups per KV head
    tail: int  # kept tokens per KV head stored as 16-bit rows
    slots: int = 0  # 16-bit rows per KV head for exact copies fetched from the store (SpeCache)


@dataclass
class RequestPlan:
    """Where one request's kept tokens are in one layer shape: unit ids ``[h, n]`` (the
    prompt's groups, then each fold's) and row ids ``[h, t]`` of keys and values."""

    shape: LayerShape
    units: torch.Tensor  # int32
    key_rows: torch.Tensor  # int64
    value_rows: torch.Tensor
    folds: int = 0  # generated-token folds whose ids are in the plan
    slot_key_rows: torch.Tensor | None = None  # [h, slots] int64 (SpeCache), after the tail
    slot_value_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchPlan:
    """The plans of one decode call, padded (request order = call order)."""

    group_table: torch.Tensor  # [B * h, max units] int32
    group_count: torch.Tensor  # [B * h] int32
    most_groups: int  # group_count's largest, known on the host (no device read)
    key_rows: torch.Tensor  # [B, h, max rows] int64 (padding: the pool's row 0, masked)
    value_rows: torch.Tensor
    row_count: torch.Tensor  # [B]


class MiniKVPages:
    """Pages for ``settings`` (MiniKV's, or SpeCache's: every token kept, ``slots`` exact rows
    per KV head on top for the tokens fetched from the store)."""

    def __init__(self, settings: MiniKVSettings, shapes: KVShapes, slots: int = 0) -> None:
        self.settings, self.shapes, self.slots = settings, shapes, slots
        self.heavy = settings.heavy_budgets(max(shapes.num_layers, 1))
        self.fmt = settings.kivi_format(shapes.head_size) if settings.quantized else None
        self._units_per_page = [self._page_units(layer) for layer in range(len(self.heavy))]
        self._region_blocks: dict[int, int] = {}  # prompt length -> blocks (asked every step)

    # -- sizes (the scheduler and the workers derive the same) ------------------------------
    @cached_property
    def row_bytes(self) -> int:
        return self.shapes.head_size * self.shapes.elem_bytes

    @cached_property
    def unit_bytes(self) -> int:
        """The pages' allocation unit: a quantized group of one head, or a row at 16 bits."""
        return self.fmt.group_bytes(self.shapes.dtype) if self.fmt else self.row_bytes

    @cached_property
    def units_per_kept_token(self) -> float:
        h = self.shapes.num_kv_heads
        return h / self.settings.group_size if self.fmt else 2 * h

    def retention(self, layer: int) -> float:
        return min(1.0, self.heavy[layer] + self.settings.recent_ratio)

    def units_per_page(self, layer: int) -> int:
        assert layer < len(self.heavy), (
            f"minikv: layer {layer} of a worker with {len(self.heavy)} attention layers "
            "(pipeline parallelism is not supported: the budgets follow the layer index)")
        return self._units_per_page[layer]

    def _page_units(self, layer: int) -> int:
        """Units in one page of ``layer``: a block's prompt tokens at the layer's retention,
        at least one exact token (the engine's exact pages use the smallest page), and a count
        that gives whole rows and a whole number of 16-bit elements per token slot."""
        bs, unit = self.shapes.block_size, self.unit_bytes
        need = self.retention(layer) * bs * self.units_per_kept_token - _EPS
        exact = 2 * self.shapes.key_width * self.shapes.elem_bytes
        return self.whole_units(max(math.ceil(need), -(-exact // unit)))

    def whole_units(self, units: int) -> int:
        """``units`` rounded up to a page of whole rows and whole 16-bit elements per token."""
        unit, slot_bytes = self.unit_bytes, self.shapes.block_size * self.shapes.elem_bytes
        step = math.lcm(slot_bytes // math.gcd(unit, slot_bytes),
                        self.row_bytes // math.gcd(unit, self.row_bytes))
        return -(-units // step) * step

    def page_bytes(self, layer: int) -> int:
        return self.units_per_page(layer) * self.unit_bytes

    def token_bytes(self, layer: int) -> int:
        return self.page_bytes(layer) // self.shapes.block_size

    def rows_per_page(self, layer: int) -> int:
        return self.page_bytes(layer) // self.row_bytes

    def kept(self, layer: int, prompt_len: int) -> tuple[int, int]:
        """(heavy hitters, recent window) kept per KV head; their sum is at most the prompt."""
        heavy = int(prompt_len * self.heavy[layer])
        recent = int(prompt_len * self.settings.recent_ratio)
        if heavy + recent >= prompt_len:
            return prompt_len - min(recent, prompt_len), min(recent, prompt_len)
        return heavy, recent

    def shape(self, layer: int, prompt_len: int) -> LayerShape:
        kept = sum(self.kept(layer, prompt_len))
        groups = kept // self.settings.group_size if self.fmt else 0
        return LayerShape(
            units_per_page=self.units_per_page(layer) if self.quantized(layer) else 0,
            rows_per_page=self.rows_per_page(layer), groups=groups,
            tail=kept - groups * self.settings.group_size, slots=self.slots)

    def _blocks(self, shape: LayerShape) -> tuple[int, int]:
        """(unit pages, row pages) of a request's region in a layer of this shape."""
        h = self.shapes.num_kv_heads
        unit_pages = -(-h * shape.groups // shape.units_per_page) if shape.groups else 0
        return unit_pages, -(-2 * h * (shape.tail + shape.slots) // shape.rows_per_page)

    def region_blocks(self, prompt_len: int) -> int:
        blocks = self._region_blocks.get(prompt_len)
        if blocks is None:
            blocks = self._region_blocks[prompt_len] = max(
                sum(self._blocks(self.shape(layer, prompt_len)))
                for layer in range(len(self.heavy)))
        return blocks

    def quantized(self, layer: int) -> bool:
        """Whether ``layer`` keeps quantized groups (else 16-bit rows only)."""
        return self.fmt is not None

    def fold_units(self, quantized: bool) -> int:
        """Units (rows in a 16-bit layer) one fold of the ring adds to a layer."""
        h, ring = self.shapes.num_kv_heads, self.settings.residual
        return h * ring // self.settings.group_size if quantized else 2 * h * ring

    @cached_property
    def _fold_sizes(self) -> list[tuple[int, int]]:
        """Per layer: (units or rows a fold adds, units or rows per page)."""
        return [(self.fold_units(True), self.units_per_page(layer)) if self.quantized(layer)
                else (self.fold_units(False), self.rows_per_page(layer))
                for layer in range(len(self.heavy))]

    def growth_blocks(self, num_folds: int) -> int:
        return max(-(-num_folds * units // per_page) for units, per_page in self._fold_sizes)

    # -- views of a layer's pages (no copies) --------------------------------------------------
    def unit_pool(self, kv_cache: torch.Tensor) -> QuantizedGroups:
        """Every unit of the layer cache as a one-head ``QuantizedGroups`` ``[n_units, 1, ..]``."""
        fmt, elem = self.fmt, self.shapes.elem_bytes
        g, w, d, vg = fmt.group, fmt.words_per_token, fmt.head_dim, fmt.value_group
        words = kv_cache.view(-1).view(torch.int32).view(-1, self.unit_bytes // 4)
        params = kv_cache.view(-1).view(-1, self.unit_bytes // elem)
        at = 2 * g * w * 4 // elem  # the 16-bit parameters follow the codes
        n = words.shape[0]
        return QuantizedGroups(
            key_codes=words[:, : g * w].view(n, 1, g, w),
            key_scale=params[:, at: at + d].view(n, 1, d),
            key_zero=params[:, at + d: at + 2 * d].view(n, 1, d),
            value_codes=words[:, g * w: 2 * g * w].view(n, 1, g, w),
            value_scale=params[:, at + 2 * d: at + 2 * d + g * d // vg].view(n, 1, g, d // vg),
            value_zero=params[:, at + 2 * d + g * d // vg: at + 2 * d + 2 * g * d // vg]
            .view(n, 1, g, d // vg))

    def row_pool(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``[n_rows, head_dim]``: row i of page p is ``p * rows_per_page + i``."""
        return kv_cache.view(-1, self.shapes.head_size)

    # -- plans ---------------------------------------------------------------------------------
    def plan(self, shape: LayerShape, region_ids: torch.Tensor) -> RequestPlan:
        """Ids of a freshly compressed prompt's units and rows (``region_ids``: its blocks)."""
        h = self.shapes.num_kv_heads
        unit_pages, _ = self._blocks(shape)
        units = _ids(region_ids[:unit_pages], shape.units_per_page, 0, h * shape.groups)
        width = shape.tail + shape.slots
        rows = _ids(region_ids[unit_pages:], shape.rows_per_page, 0, 2 * h * width)
        rows = rows.view(2, h, width)
        return RequestPlan(shape, units.view(shape.groups, h).t().to(torch.int32),
                           rows[0, :, :shape.tail], rows[1, :, :shape.tail],
                           slot_key_rows=rows[0, :, shape.tail:],
                           slot_value_rows=rows[1, :, shape.tail:])

    def fold_ids(self, shape: LayerShape, growth_ids: torch.Tensor, fold: int) -> torch.Tensor:
        """Ids of fold ``fold``'s units (rows at 16 bits) in the growth pages, in write order."""
        quantized = shape.units_per_page > 0
        per_page = shape.units_per_page if quantized else shape.rows_per_page
        count = self.fold_units(quantized)
        return _ids(growth_ids, per_page, fold * count, count)

    def extend(self, plan: RequestPlan, fold_ids: torch.Tensor) -> None:
        """Append one fold's ids to a plan."""
        h = self.shapes.num_kv_heads
        if plan.shape.units_per_page:
            new = fold_ids.view(-1, h).t().to(torch.int32)
            plan.units = torch.cat([plan.units, new], dim=1)
        else:
            rows = fold_ids.view(2, h, -1)
            plan.key_rows = torch.cat([plan.key_rows, rows[0]], dim=1)
            plan.value_rows = torch.cat([plan.value_rows, rows[1]], dim=1)
        plan.folds += 1

    def upto(self, plan: RequestPlan, folds: int) -> RequestPlan:
        """The plan as it stood after ``folds`` folds (layers that share a plan fold in turn:
        a later layer may not have written what an earlier one appended)."""
        assert folds <= plan.folds
        ring, g = self.settings.residual, self.settings.group_size
        quantized = plan.shape.units_per_page > 0
        units = plan.shape.groups + folds * ring // g if quantized else 0
        rows = plan.shape.tail + (0 if quantized else folds * ring)
        return RequestPlan(plan.shape, plan.units[:, :units], plan.key_rows[:, :rows],
                           plan.value_rows[:, :rows], folds, plan.slot_key_rows,
                           plan.slot_value_rows)

    def batch_plan(self, plans: list[RequestPlan]) -> BatchPlan:
        device = plans[0].units.device
        units = [u for p in plans for u in p.units]  # [n] per (request, head)
        table = torch.nn.utils.rnn.pad_sequence(units, batch_first=True) if units else None
        if table is None or table.shape[1] == 0:
            table = torch.zeros(len(units), 1, dtype=torch.int32, device=device)
        sizes = [u.numel() for u in units]
        counts = torch.tensor(sizes, dtype=torch.int32, device=device)

        def padded(name: str) -> torch.Tensor:
            rows = [getattr(p, name).t() for p in plans]  # [t, h]
            out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, t_max, h]
            return out.permute(0, 2, 1).contiguous()

        return BatchPlan(group_table=table.contiguous(), group_count=counts,
                         most_groups=max(sizes, default=0), key_rows=padded("key_rows"),
                         value_rows=padded("value_rows"),
                         row_count=torch.tensor([p.key_rows.shape[1] for p in plans],
                                                device=device))

    # -- page I/O -----------------------------------------------------------------------------
    def write_groups(self, kv_cache: torch.Tensor, ids: torch.Tensor,
                     groups: QuantizedGroups) -> None:
        """``groups`` ``[n, h, ...]`` into units ``ids`` ``[n * h]`` (group-major)."""
        pool = self.unit_pool(kv_cache)
        ids = ids.long()
        for field, data in zip(pool, groups):
            field[ids] = data.reshape(-1, 1, *data.shape[2:]).to(field.dtype)

    def write_rows(self, kv_cache: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        ops.copy_rows(self.row_pool(kv_cache), ids.long(),
                      rows.reshape(-1, self.shapes.head_size))


def _ids(pages: torch.Tensor, per_page: int, first: int, count: int) -> torch.Tensor:
    """Pool ids (int64) of entries [first, first + count) laid out page after page."""
    at = torch.arange(first, first + count, device=pages.device)
    if count == 0:
        return at
    return pages.long()[at // per_page] * per_page + at % per_page
