"""Where a request's data sits in its vLLM blocks: one set of rules for the scheduler and workers.

Pages are sized for *compressed* tokens: a page of ``block_size`` token slots holds, for
``block_size`` prompt tokens, their A rows ``[block_size, r]`` and the landmarks of their chunks
``[block_size / c, h_kv, d]``. vLLM's block accounting therefore counts compressed tokens, which is
what makes its reported capacity grow by the compression ratio. Everything else is placed in the
same pages, so vLLM's accounting sees every byte:

* **exact tokens** (short requests, the prompt while it is prefilled, generated tokens):
  ``exact_per_page`` tokens of K and V per page;
* **sparse requests** (prompt length P long enough to compress), block list positions:
  ``[0, staging)``        the prompt's exact K/V while it is prefilled; freed once compressed;
  ``[staging, +packed)``  compressed pages: A rows and landmarks of the compressed prompt tokens;
  ``[.., +state)``        per-request state: B, outlier ids, the exact region (outlier chunks +
                          local window), the selection slots (ids, K, V);
  ``[.., ...)``           generated tokens (positions >= P), exact.

The manager (scheduler side) and the attention backend (workers) both derive this from P and
the settings alone, so nothing but vLLM's block table has to travel between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_shadowkv.config import ShadowKVConfig
from vllm_shadowkv.core.params import ShadowKVParams
from vllm_shadowkv.store import paged_bytes

ALIGN = 16  # bytes; keeps every state field aligned for any dtype view


@dataclass(frozen=True)
class StateLayout:
    """Byte offsets of one sparse request's per-request state (one layer)."""

    num_outliers: int  # o: outlier chunks per KV head
    exact_tokens: int  # o*c outlier tokens + the local window
    num_slots: int  # k: selected chunks per KV head
    b: int
    outliers: int
    exact_k: int
    exact_v: int
    slot_chunks: int
    slot_k: int
    slot_v: int
    nbytes: int


@dataclass(frozen=True)
class PageLayout:
    config: ShadowKVConfig
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    # -- sizes --------------------------------------------------------------------------------
    @property
    def params(self) -> ShadowKVParams:
        """The core algorithm's parameters for these settings."""
        c = self.config
        return ShadowKVParams(
            rank=c.rank, chunk_size=c.chunk_size, sparse_budget=c.sparse_budget,
            outlier_chunks=c.outlier_chunks, local_chunks=math.ceil(c.local_window / c.chunk_size),
            min_compress_tokens=c.min_sparse_len, selection=c.selection,
        )

    @property
    def elem_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def key_width(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def slot_bytes(self) -> int:
        """Bytes of one compressed token: its A row and its share of a chunk landmark."""
        elems = self.config.rank + math.ceil(self.key_width / self.config.chunk_size)
        return elems * self.elem_bytes

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.slot_bytes

    @property
    def exact_token_bytes(self) -> int:
        return 2 * self.key_width * self.elem_bytes

    @property
    def exact_per_page(self) -> int:
        return self.page_bytes // self.exact_token_bytes

    # -- per request --------------------------------------------------------------------------
    def compressed_tokens(self, prompt_len: int) -> int:
        """Prompt tokens that go to the low-rank pool; 0 means the request stays exact."""
        return self.params.compressed_chunks(prompt_len) * self.config.chunk_size

    def is_sparse(self, prompt_len: int) -> bool:
        return self.compressed_tokens(prompt_len) > 0

    def exact_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.exact_per_page)

    def packed_blocks(self, prompt_len: int) -> int:
        return -(-self.compressed_tokens(prompt_len) // self.block_size)

    def state(self, prompt_len: int) -> StateLayout:
        p, c = self.params, self.config.chunk_size
        n_chunks = p.compressed_chunks(prompt_len)
        o = min(p.outlier_chunks, n_chunks)
        k = p.select_chunks  # the core keeps a fixed slot count (unused slots stay empty)
        exact = o * c + prompt_len - n_chunks * c
        e, h, d = self.elem_bytes, self.num_kv_heads, self.head_size
        sizes = {
            "b": h * p.rank * d * e,
            "outliers": h * o * 4,
            "exact_k": h * exact * d * e,
            "exact_v": h * exact * d * e,
            "slot_chunks": h * k * 4,
            "slot_k": h * k * c * d * e,
            "slot_v": h * k * c * d * e,
        }
        offsets, at = {}, 0
        for name, size in sizes.items():
            offsets[name] = at
            at += -(-size // ALIGN) * ALIGN
        return StateLayout(num_outliers=o, exact_tokens=exact, num_slots=k, nbytes=at, **offsets)

    def state_blocks(self, prompt_len: int) -> int:
        return -(-self.state(prompt_len).nbytes // self.page_bytes)

    def blocks_needed(self, prompt_len: int, num_tokens: int) -> int:
        """Length of the request's block list once it holds ``num_tokens`` tokens."""
        if not self.is_sparse(prompt_len) or num_tokens < prompt_len:
            return self.exact_blocks(num_tokens)  # exact request, or sparse one still prefilling
        return (self.exact_blocks(prompt_len) + self.packed_blocks(prompt_len)
                + self.state_blocks(prompt_len) + self.exact_blocks(num_tokens - prompt_len))

    def peak_blocks(self, prompt_len: int) -> int:
        """Blocks a request holds in the step its prompt is compressed (staging + compressed)."""
        return self.blocks_needed(prompt_len, prompt_len)

    def steady_blocks(self, prompt_len: int) -> int:
        """Blocks a request holds after compression (its staging freed)."""
        if not self.is_sparse(prompt_len):
            return self.exact_blocks(prompt_len)
        return self.packed_blocks(prompt_len) + self.state_blocks(prompt_len)

    def value_store_bytes(self, prompt_len: int, num_layers: int) -> int:
        """CPU value-store bytes of a request: every compressed chunk's values, per KV head, in
        the store's whole pages (what ``CpuValueStore.put`` takes), every layer."""
        rows = self.compressed_tokens(prompt_len) // self.config.chunk_size * self.num_kv_heads
        row_bytes = self.config.chunk_size * self.head_size * self.elem_bytes
        return paged_bytes(rows, row_bytes) * num_layers

    def token_block(self, prompt_len: int, position: int) -> tuple[int, int]:
        """(index in the request's block list, exact slot in that page) of an exact token."""
        if self.is_sparse(prompt_len) and position >= prompt_len:
            base = (self.exact_blocks(prompt_len) + self.packed_blocks(prompt_len)
                    + self.state_blocks(prompt_len))
            position -= prompt_len
        else:
            base = 0
        return base + position // self.exact_per_page, position % self.exact_per_page
