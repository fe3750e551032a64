"""The ``shadowkv`` settings: the paper's defaults (§5.1), the rank scaled to the model."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from vllm_shadowkv.core.params import SELECTIONS, Selection, ShadowKVParams
from vllm_shadowkv.methods.base import (EngineSettings, KVShapes, SettingsError, at_least,
                                        multiple_of, one_of)

# The paper's rank: 160 of Llama-3.1-8B's 1024 key channels (8 KV heads x 128).
PAPER_RANK, PAPER_KEY_WIDTH = 160, 1024


def default_rank(key_width: int) -> int:
    """The paper's share of the key channels, at least 1: 160 of 1024 (40 of 256, 20 of 128)."""
    return max(1, math.ceil(PAPER_RANK * key_width / PAPER_KEY_WIDTH))


@dataclass(frozen=True)
class ShadowKVSettings(EngineSettings):
    method: ClassVar[str] = "shadowkv"

    rank: int | None = None
    """Rank r of the low-rank pre-RoPE key factorisation (A [tokens, r] x B [kv_heads, r, d]).
    Unset: the paper's share of the key width per worker, 160 of 1024 channels."""
    chunk_size: int = 8
    """Tokens per chunk; one landmark (mean post-RoPE key) per chunk. Must divide the block size."""
    sparse_budget: int = 2048
    """Tokens selected per KV head at each decode step (top sparse_budget/chunk_size chunks);
    outliers, the local window and generated tokens come on top of it."""
    sparse_budget_ratio: float | None = None
    """Each prompt's budget as a share of its tokens instead, the paper's definition (its
    1.56 % = 0.0156), in whole chunks (at least one) and at most sparse_budget tokens. A
    request's selection slots are sized for its own budget, so shorter prompts hold less.
    Unset: sparse_budget for every prompt."""
    outlier_chunks: int = 48
    """Chunks per KV head with the lowest within-chunk cosine similarity, attended exactly."""
    outlier_ratio: float | None = None
    """Each prompt's outlier chunks as a share of its tokens instead, the paper's proportion (48
    chunks of 8 tokens at 128K: 0.0029), rounded half up, at least one and at most
    outlier_chunks. Unset: outlier_chunks for every prompt."""
    local_window: int = 32
    """Last prompt tokens always attended exactly."""
    selection: Selection = "landmarks"
    """Which chunks a decode step attends: "landmarks" (ShadowKV: top-k landmark scores for the
    query) or "sink_recent" (a naive baseline for accuracy studies: the first chunk and the most
    recent chunks, whatever the query; set outlier_chunks 0 to give it the whole budget)."""

    def check(self) -> None:
        super().check()
        if self.rank is not None:
            at_least(self, "rank", 1)
        at_least(self, "chunk_size", 1)
        at_least(self, "sparse_budget", self.chunk_size)
        at_least(self, "outlier_chunks", 0)
        at_least(self, "local_window", 0)
        if self.sparse_budget_ratio is not None and not 0.0 < self.sparse_budget_ratio <= 1.0:
            raise SettingsError(
                f"shadowkv.sparse_budget_ratio must be in (0, 1] (a share of each prompt, the "
                f"paper's 1.56 % is 0.0156) or unset, got {self.sparse_budget_ratio}")
        if self.outlier_ratio is not None and not 0.0 < self.outlier_ratio <= 1.0:
            raise SettingsError(
                f"shadowkv.outlier_ratio must be in (0, 1] (a share of each prompt, the paper's "
                f"48 chunks of 8 tokens at 128K are 0.0029) or unset, got {self.outlier_ratio}")
        multiple_of(self, "sparse_budget", "chunk_size", "tokens are selected in whole chunks")
        one_of(self, "selection", SELECTIONS)

    def check_engine(self, shapes: KVShapes) -> None:
        if shapes.block_size % self.chunk_size:
            divisors = [d for d in range(1, shapes.block_size + 1) if shapes.block_size % d == 0]
            raise SettingsError(
                f"shadowkv.chunk_size ({self.chunk_size}) must divide the KV block size "
                f"({shapes.block_size}); allowed chunk sizes here: {divisors}")
        if self.rank is not None and self.rank > shapes.key_width:
            raise SettingsError(
                f"shadowkv.rank ({self.rank}) exceeds the key width of this model: num_kv_heads "
                f"({shapes.num_kv_heads}) x head_dim ({shapes.head_size}) = {shapes.key_width}"
                f"; "
                f"allowed: 1..{shapes.key_width}")

    def resolved(self, shapes: KVShapes) -> ShadowKVSettings:
        if self.rank is not None:
            return self
        return replace(self, rank=default_rank(shapes.key_width))

    @property
    def params(self) -> ShadowKVParams:
        """The core algorithm's parameters for these (resolved) settings."""
        assert self.rank is not None, "resolve the settings against the model first"
        return ShadowKVParams(
            rank=self.rank, chunk_size=self.chunk_size, sparse_budget=self.sparse_budget,
            outlier_chunks=self.outlier_chunks,
            local_chunks=math.ceil(self.local_window / self.chunk_size),
            min_compress_tokens=self.min_sparse_len, selection=self.selection,
            sparse_budget_ratio=self.sparse_budget_ratio, outlier_ratio=self.outlier_ratio)
