"""Where the host rows a method fetches back live during decode.

The real store (vllm_shadowkv/store/) is a bounded pinned CPU pool; the core only needs this
protocol. A row is the unit that moves, of the method's ``store_row_shape``: ShadowKV's one
chunk of one KV head's values ``[chunk_size, head_dim]`` (the shapes below), SpeCache's and
TailorKV's one token's key and value ``[2, head_dim]``.
"""

from collections.abc import Hashable
from typing import Protocol

import torch


class ValueStore(Protocol):
    def put(self, key: Hashable, values: torch.Tensor) -> None:
        """Keep `values` [h_kv, n_chunks, chunk_size, d] of one request (one layer) under `key`."""

    def gather_many(self, keys: list[Hashable], heads: torch.Tensor, chunks: torch.Tensor,
                    counts: list[int], out: torch.Tensor,
                    out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (heads[i], chunks[i]) into host tensor `out` [M, chunk_size, d], for several keys
        at once: key j owns the next counts[j] rows. Row i goes to out[i], or to
        out[out_rows[i]] (the CPU decode gathers straight into its slots); with out_rows
        [n, chunk_size], `out` is [M, d] and token t of row i goes to out[out_rows[i, t]] (the
        CPU decode's slots, row by row in the pages: a chunk may straddle two pages)."""

    def free(self, key: Hashable) -> None:
        """Give back everything held for `key`."""


class InMemoryValueStore:
    """Unbounded dict of tensors, for tests and benchmarks."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._values: dict[Hashable, torch.Tensor] = {}

    def put(self, key: Hashable, values: torch.Tensor) -> None:
        self._values[key] = values.to(self.device).contiguous()

    def gather(self, key: Hashable, heads: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        values = self._values[key]
        return values[heads.to(self.device).long(), chunks.to(self.device).long()]

    def gather_many(self, keys: list[Hashable], heads: torch.Tensor, chunks: torch.Tensor,
                    counts: list[int], out: torch.Tensor,
                    out_rows: torch.Tensor | None = None) -> torch.Tensor:
        parts = zip(keys, heads.split(counts), chunks.split(counts))
        rows = torch.cat([self.gather(k, h, c) for k, h, c in parts if len(h)] or [out[:0]])
        if out_rows is None:
            return out.copy_(rows)
        if out_rows.dim() == 2:  # token rows
            rows = rows.flatten(0, 1)
        return out.index_copy_(0, out_rows.to(out.device).long().flatten(), rows.to(out.device))

    def free(self, key: Hashable) -> None:
        self._values.pop(key, None)

    def __len__(self) -> int:
        return len(self._values)
