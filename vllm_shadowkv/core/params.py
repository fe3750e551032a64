"""ShadowKV method settings, as the engine-independent core sees them."""

import math
from dataclasses import dataclass
from typing import Literal, get_args

# "landmarks": the paper's top-k over chunk landmarks. "sink_recent": a naive baseline that
# ignores the query: the first chunk (attention sinks) plus the most recent chunks.
Selection = Literal["landmarks", "sink_recent"]
SELECTIONS = get_args(Selection)


@dataclass(frozen=True)
class ShadowKVParams:
    """Paper defaults (§5.1): rank 160, chunk 8, 2048 selected tokens, 48 outlier chunks.

    `sparse_budget` counts only the dynamically selected tokens (k = sparse_budget // chunk_size
    chunks per KV head); outliers, the local window and generated tokens come on top, as in the
    paper and the authors' accuracy path. With `sparse_budget_ratio` each prompt's budget is that
    share of its tokens (the paper's 1.56 %), at most `sparse_budget`; with `outlier_ratio` its
    outlier chunks likewise (the paper's 48 chunks of 8 at 128K: 0.29 %), at most
    `outlier_chunks`.
    """

    rank: int = 160
    chunk_size: int = 8
    sparse_budget: int = 2048
    outlier_chunks: int = 48
    local_chunks: int = 4
    # Prompts shorter than this stay exact (the authors' code: dense up to 4096 tokens).
    min_compress_tokens: int = 4096
    selection: str = "landmarks"
    sparse_budget_ratio: float | None = None
    outlier_ratio: float | None = None

    @property
    def select_chunks(self) -> int:
        """Chunks selected per KV head: every prompt's, or the most any prompt's (a ratio)."""
        return self.sparse_budget // self.chunk_size

    def select_chunks_for(self, num_tokens: int) -> int:
        """Chunks a prompt of ``num_tokens`` selects per KV head: its share of whole chunks
        (at least one) where a ratio is set, at most ``select_chunks``."""
        if self.sparse_budget_ratio is None:
            return self.select_chunks
        share = int(self.sparse_budget_ratio * num_tokens) // self.chunk_size
        return min(max(share, 1), self.select_chunks)

    def outliers_for(self, num_tokens: int) -> int:
        """Outlier chunks a prompt of ``num_tokens`` keeps per KV head: its share of chunks
        (rounded half up, at least one) where a ratio is set, at most ``outlier_chunks``."""
        if self.outlier_ratio is None:
            return self.outlier_chunks
        share = math.floor(self.outlier_ratio * num_tokens / self.chunk_size + 0.5)
        return min(max(share, 1), self.outlier_chunks)

    def compressed_chunks(self, num_tokens: int) -> int:
        """Chunks of a prompt that go into the low-rank pool; 0 means the prompt stays exact.

        The local window is the last `local_chunks` full chunks plus the `num_tokens % chunk_size`
        leftover tokens, fixed at prefill (the authors' accuracy path; no multiple-of-8 rounding).
        A prompt is compressed only when it reaches `min_compress_tokens` and has more chunks than
        outliers + local, otherwise there is nothing left to select from.
        """
        n_chunks = num_tokens // self.chunk_size - self.local_chunks
        if num_tokens < self.min_compress_tokens or n_chunks <= self.outliers_for(num_tokens):
            return 0
        return n_chunks
