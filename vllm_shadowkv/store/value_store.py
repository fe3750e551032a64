"""Bounded CPU pool for what a method moves off the GPU (the host store).

A row is the unit a decode step fetches, shaped by the method (`row_shape`): for ShadowKV one
chunk of one KV head's values, [chunk_size, head_dim]. Rows live in fixed-size pages of
`page_rows` rows. A key (one request, one layer) owns a list of pages; row (h, n) of a put of
[h_kv, n_rows, *row_shape] is logical row h * n_rows + n of that list. Freed pages go back to a free list that later puts take from, so the pool cannot fragment:
a put fits whenever enough pages are free, wherever they are.

Pages are slices of a few large extents, allocated only when the free list runs short (the
default capacity, 16 GiB, must not be taken up front) and kept for reuse. Extents double in size
up to 1 GiB, so there are few of them: a gather is one index_select per extent the key touches,
not one per page.
"""

import itertools
import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch

from vllm_shadowkv.core import native, ops

_MAX_EXTENT_BYTES = 1 << 30


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


PAGE_ROWS = 256  # rows (one chunk of one KV head) per page; the block manager accounts in pages


def paged_bytes(num_rows: int, row_bytes: int, page_rows: int = PAGE_ROWS) -> int:
    """What `num_rows` rows take in the store: whole pages (the unit it allocates)."""
    return -(-num_rows // page_rows) * page_rows * row_bytes


class ValueStoreFull(RuntimeError):
    """A put needs more pages than the capacity has free."""


@dataclass
class _Entry:
    num_heads: int
    num_rows: int
    pages: list[int]  # global page ids, in logical order
    page_extent: torch.Tensor  # [n_pages] int64, extent holding each page
    page_base: torch.Tensor  # [n_pages] int64, first row of each page within its extent
    extents: list[int]  # the distinct extents, for the per-extent loops


class CpuValueStore:
    """Implements `vllm_shadowkv.core.store.ValueStore` within `capacity_bytes`. Pinned memory by
    default where CUDA is available, so the pool is DMA-able. Not thread-safe."""

    def __init__(self, capacity_bytes: int, dtype: torch.dtype, row_shape: tuple[int, ...],
                 page_rows: int = PAGE_ROWS, pin_memory: bool | None = None):
        row_shape = tuple(row_shape)
        if capacity_bytes < 0 or min((*row_shape, page_rows)) < 1:
            raise ValueError(f"CpuValueStore: capacity_bytes={capacity_bytes} must be >= 0, "
                             f"row_shape={row_shape} and page_rows={page_rows} >= 1")
        self.dtype, self.row_shape = dtype, row_shape
        self.page_rows = page_rows
        # Pinned on CUDA machines; checked by test_cuda_decode_from_pinned_store_matches_cpu
        # (scripts/gpu_checks.sh), the CPU tests pass pin_memory=False.
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.row_bytes = math.prod(row_shape) * dtype.itemsize
        self.page_bytes = page_rows * self.row_bytes
        self._max_pages = capacity_bytes // self.page_bytes  # whole pages, never above capacity
        self._extents: list[torch.Tensor] = []  # [rows, *row_shape] each
        self._page_extent: list[int] = []  # by global page id
        self._page_base: list[int] = []
        self._free: list[int] = []
        self._entries: dict[Hashable, _Entry] = {}
        self._table_cache: dict[tuple[Hashable, ...], tuple[torch.Tensor, ...]] = {}
        self.bytes_put = 0  # cumulative, for metrics
        self.bytes_fetched = 0

    @property
    def capacity_bytes(self) -> int:
        """The configured capacity rounded down to whole pages."""
        return self._max_pages * self.page_bytes

    @property
    def allocated_bytes(self) -> int:
        return len(self._page_extent) * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return (len(self._page_extent) - len(self._free)) * self.page_bytes

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    def bytes_needed(self, num_heads: int, num_rows: int) -> int:
        """What a put of [num_heads, num_rows, *row_shape] takes: whole pages."""
        return paged_bytes(num_heads * num_rows, self.row_bytes, self.page_rows)

    def can_fit(self, nbytes: int) -> bool:
        return nbytes <= self.capacity_bytes - self.used_bytes

    def put(self, key: Hashable, values: torch.Tensor) -> None:
        if key in self._entries:
            raise ValueError(f"value store: key {key!r} is already stored; free it first")
        if tuple(values.shape[2:]) != self.row_shape or values.dtype != self.dtype:
            raise ValueError(f"value store: values for {key!r} are {tuple(values.shape)} "
                             f"{values.dtype}, expected [h_kv, n_rows, "
                             f"{', '.join(map(str, self.row_shape))}] {self.dtype}")
        num_heads, num_rows = values.shape[:2]
        needed = self.bytes_needed(num_heads, num_rows)
        if not self.can_fit(needed):
            free = self.capacity_bytes - self.used_bytes
            raise ValueStoreFull(
                f"host store full: request {key!r} needs {needed} bytes "
                f"({num_heads} KV heads x {num_rows} rows), {free} bytes free of a "
                f"{self.capacity_bytes}-byte capacity; "
                f"raise value_store_gib or --kv-offloading-size")
        num_pages = needed // self.page_bytes
        self._grow(num_pages)
        split = len(self._free) - num_pages
        pages = self._free[split:]
        del self._free[split:]
        entry = _Entry(num_heads, num_rows, pages,
                       torch.tensor([self._page_extent[p] for p in pages], dtype=torch.long),
                       torch.tensor([self._page_base[p] for p in pages], dtype=torch.long),
                       sorted({self._page_extent[p] for p in pages}))
        rows = values.reshape(-1, *self.row_shape).cpu()
        for extent, at, local in self._by_extent(entry.page_extent, entry.page_base,
                                                 entry.extents, torch.arange(len(rows))):
            extent.index_copy_(0, local, rows if at is None else rows[at])
        self._entries[key] = entry
        self._table_cache.clear()
        self.bytes_put += values.numel() * values.element_size()

    def gather(self, key: Hashable, heads: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """Rows (heads[i], chunks[i]) of `key` -> [M, *row_shape] on the CPU."""
        out = torch.empty((len(heads), *self.row_shape), dtype=self.dtype)
        return self.gather_many([key], heads, chunks, [len(heads)], out)

    def gather_many(self, keys: list[Hashable], heads: torch.Tensor, chunks: torch.Tensor,
                    counts: list[int], out: torch.Tensor,
                    out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of several keys into the CPU tensor `out` [M, *row_shape] at once: key i owns the
        next counts[i] of (heads, chunks) (a key with none need not be stored). Row i goes to
        out[i], or to out[out_rows[i]]: the CPU decode step gathers straight into its slots,
        with no staging copy; with ``out_rows`` [n, c] (``out`` [M, d]) each of a row's c token
        rows goes where its own row id says. One C call for all keys where the kernels are built
        (``native.gather_store_rows``, through page tables cached per set of keys), else one
        index_select (or ``copy_rows``) per extent the rows touch, whatever the number of keys
        (on CUDA `out` is the decode step's pinned staging buffer, which the core then copies
        on its copy stream)."""
        stored = [(k, n) for k, n in zip(keys, counts) if n]
        if not stored:
            return out
        keys, counts = zip(*stored)
        entries = [self._entry(key) for key in keys]
        heads, chunks = (t if t.device.type == "cpu" and t.dtype == torch.int64
                         else t.cpu().long() for t in (heads, chunks))
        row_numel = math.prod(self.row_shape)
        if ops.native_cpu(out) and native.supports_store_gather(out, out_rows, self._extents[0],
                                                                  row_numel):
            bad = native.gather_store_rows(out, out_rows, self._extents[0], self._tables(keys),
                                           counts, heads, chunks, self.page_rows, row_numel)
            if bad is not None:
                self._check_rows(keys, entries, heads, chunks, counts)  # raises
            self.bytes_fetched += len(heads) * row_numel * out.element_size()
            return out
        per_row = self._check_rows(keys, entries, heads, chunks, counts)

        def each_row(values: list[int]) -> torch.Tensor:
            return torch.tensor(values).repeat_interleave(per_row)

        num_rows = each_row([e.num_rows for e in entries])
        # Each key's pages follow the previous keys' in one table.
        first_page = each_row(list(itertools.accumulate([len(e.pages) for e in entries[:-1]],
                                                        initial=0)))
        if len(entries) == 1:
            page_extent, page_base = entries[0].page_extent, entries[0].page_base
        else:
            page_extent = torch.cat([e.page_extent for e in entries])
            page_base = torch.cat([e.page_base for e in entries])
        extents = sorted({x for e in entries for x in e.extents})
        for extent, at, local in self._by_extent(page_extent, page_base, extents,
                                                 heads * num_rows + chunks, first_page):
            if out_rows is not None:
                dest = out_rows if at is None else out_rows.index_select(0, at)
                src = extent.view(len(extent), -1)
                if dest.dim() == 2:  # token rows: each store row split into dest's c rows
                    c = dest.shape[1]
                    src = src.view(len(extent) * c, -1)
                    local = (local.unsqueeze(1) * c + torch.arange(c)).flatten()
                ops.copy_rows(out.view(len(out), -1), dest.long().flatten(), src, local)
                continue
            if at is None:
                torch.index_select(extent, 0, local, out=out)
                continue
            first, last = int(at[0]), int(at[-1])
            if last - first + 1 == len(at):  # one run of `out` (a key's rows)
                torch.index_select(extent, 0, local, out=out[first: last + 1])
            else:
                out[at] = extent.index_select(0, local)
        self.bytes_fetched += len(heads) * row_numel * out.element_size()
        return out

    @property
    def pool(self) -> torch.Tensor:
        """The first extent, flat: where `page_offsets` count from."""
        if not self._extents:
            raise RuntimeError("value store: nothing allocated yet, so no pool to address")
        return self._extents[0].view(-1)

    def page_offsets(self, key: Hashable) -> torch.Tensor:
        """The element offset of each of the key's pages (logical order) from `pool`'s first
        element, int64 [n_pages]: how a kernel reads rows in place (row r of the key at
        ``pool + offsets[r // page_rows] + (r % page_rows) * prod(row_shape)``; pages of other
        extents lie outside `pool`'s bounds, in the same address space). Valid while the key is
        stored: extents are never released."""
        entry = self._entry(key)
        base, itemsize = self._extents[0].data_ptr(), self.dtype.itemsize
        extent_offset = torch.tensor([(e.data_ptr() - base) // itemsize for e in self._extents])
        row_numel = math.prod(self.row_shape)
        return extent_offset[entry.page_extent] + entry.page_base * row_numel

    def _check_rows(self, keys, entries, heads, chunks, counts) -> torch.Tensor:
        """Raise IndexError for the first wanted row its key does not hold; -> counts, a
        tensor."""
        per_row = torch.tensor(counts)
        num_heads, num_rows = (torch.tensor(values).repeat_interleave(per_row) for values in
                               ([e.num_heads for e in entries], [e.num_rows for e in entries]))
        bad = (heads < 0) | (heads >= num_heads) | (chunks < 0) | (chunks >= num_rows)
        if bad.any():
            i = int(bad.nonzero()[0])
            key = keys[int(torch.searchsorted(per_row.cumsum(0), i, right=True))]
            raise IndexError(f"value store: key {key!r} holds {int(num_heads[i])} heads x "
                             f"{int(num_rows[i])} rows; asked for head {int(heads[i])}, "
                             f"row {int(chunks[i])}")
        return per_row

    def gather_tables(self, keys: tuple[Hashable, ...]
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """For a kernel that gathers the keys' rows itself (``native.SparseStep``, where
        ``native.supports_store_gather`` takes its rows): the pool (the first extent) and the
        keys' page tables (``_tables``); None where a key is not stored."""
        if not (self._extents and all(key in self._entries for key in keys)):
            return None
        return self._extents[0], self._tables(keys)

    def _tables(self, keys: tuple[Hashable, ...]) -> tuple[torch.Tensor, ...]:
        """The keys' page tables for the C gather: page offsets (``page_offsets``, one table),
        first page, heads and rows of each key, int64. Cached per set of keys (a batch's, the
        same every step) until the next put or free."""
        tables = self._table_cache.get(keys)
        if tables is None:
            entries = [self._entry(key) for key in keys]
            first_page = itertools.accumulate([len(e.pages) for e in entries[:-1]], initial=0)
            tables = self._table_cache[keys] = (
                torch.cat([self.page_offsets(key) for key in keys]),
                torch.tensor(list(first_page)), torch.tensor([e.num_heads for e in entries]),
                torch.tensor([e.num_rows for e in entries]))
        return tables

    def _entry(self, key: Hashable) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"value store has no values for key {key!r} (never put, or freed)")
        return entry

    def free(self, key: Hashable) -> None:
        """Give the key's pages back; unknown keys are ignored (requests aborted before a put)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._free.extend(entry.pages)
            self._table_cache.clear()

    def clear(self) -> None:
        """Free every key. The extents stay allocated for reuse."""
        for key in list(self._entries):
            self.free(key)

    def _grow(self, num_pages: int) -> None:
        """Allocate extents until `num_pages` pages are free; the caller checked the capacity.
        An extent holds the pages that fit in a power of two bytes: at least the pool so far
        (doubling) where the capacity left allows, at most 1 GiB. Torch's pinned allocator
        rounds every block up to a power of two bytes, so whatever the page size (head size 96
        gives 3 x 2^k bytes) an extent pins less than one page beyond its pages."""
        while len(self._free) < num_pages:
            allocated = len(self._page_extent)
            want = max(num_pages - len(self._free), allocated) * self.page_bytes
            left = self._max_pages - allocated
            target = min(1 << (want - 1).bit_length(), _MAX_EXTENT_BYTES,
                         _pow2_floor(left * self.page_bytes))
            size = min(max(1, target // self.page_bytes), left)
            extent_id = len(self._extents)
            self._extents.append(torch.empty((size * self.page_rows, *self.row_shape),
                                             dtype=self.dtype,
                                             pin_memory=self.pin_memory))
            self._page_extent += [extent_id] * size
            self._page_base += range(0, size * self.page_rows, self.page_rows)
            self._free += range(allocated, allocated + size)

    def _by_extent(self, page_extent: torch.Tensor, page_base: torch.Tensor, extents: list[int],
                   rows: torch.Tensor, first_page: torch.Tensor | int = 0
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        """Per extent the logical `rows` touch (row r in the pages of a table from its
        `first_page`): (extent, positions in `rows` or None for all, row indices within the
        extent). Vectorised: no Python loop over rows or pages."""
        page = first_page + rows // self.page_rows
        extent_of, local = page_extent[page], page_base[page] + rows % self.page_rows
        if len(extents) == 1:
            yield self._extents[extents[0]], None, local
            return
        for extent_id in extents:
            at = (extent_of == extent_id).nonzero().squeeze(1)
            if len(at):
                yield self._extents[extent_id], at, local[at]
