"""Where a request's data sits in its vLLM blocks: one set of rules for the scheduler and workers.

Pages are sized by the method (``KVMethod.token_bytes``: the bytes of one *compressed* token), so
vLLM's block accounting counts compressed tokens, which is what makes its reported capacity grow
by the compression ratio. Everything a request keeps is placed in its pages, so vLLM's accounting
sees every byte:

* **exact tokens** (short requests, the prompt while it is prefilled, generated tokens):
  ``exact_per_page`` tokens of K and V per page;
* **compressed requests** (prompt length P that the method compresses), block list positions:
  ``[0, staging)``           the prompt's exact K/V while it is prefilled; freed at prompt end;
  ``[staging, +region)``     the method's region (its compressed pages and per-request state);
  ``[.., +generated)``       generated tokens (positions >= P), exact: all of them, or a ring of
                             the last ``generated_ring`` for a method that folds older ones;
  ``[.., ...)``              growth pages the method folds generated tokens into (ring only).

The manager (scheduler side) and the attention backend (workers) both derive this from P and
the method alone, so nothing but vLLM's block table has to travel between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_shadowkv.methods.base import KVMethod


@dataclass(frozen=True, eq=False)
class PageLayout:
    method: "KVMethod"

    @property
    def shapes(self):
        return self.method.shapes

    @property
    def block_size(self) -> int:
        return self.shapes.block_size

    @cached_property  # read for every exact token slot: the hot path of the metadata builder
    def page_bytes(self) -> int:
        """The smallest page of any layer: what the shared block counts are computed for."""
        return self.block_size * min(self.method.token_bytes(layer)
                                     for layer in range(max(self.shapes.num_layers, 1)))

    @property
    def exact_token_bytes(self) -> int:
        return 2 * self.shapes.key_width * self.shapes.elem_bytes

    @cached_property
    def exact_per_page(self) -> int:
        return self.page_bytes // self.exact_token_bytes

    # -- per request --------------------------------------------------------------------------
    def is_sparse(self, prompt_len: int) -> bool:
        return self.method.is_sparse(prompt_len)

    def exact_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.exact_per_page)

    def region_blocks(self, prompt_len: int) -> int:
        return self.method.region_blocks(prompt_len)

    def exact_generated(self, num_generated: int) -> int:
        """Generated tokens held exact: all, or the method's ring."""
        ring = self.method.generated_ring
        return num_generated if ring is None else min(num_generated, ring)

    def blocks_needed(self, prompt_len: int, num_tokens: int) -> int:
        """Length of the request's block list once it holds ``num_tokens`` tokens."""
        if not self.is_sparse(prompt_len) or num_tokens < prompt_len:
            return self.exact_blocks(num_tokens)  # exact request, or one still prefilling
        generated = num_tokens - prompt_len
        return (self.exact_blocks(prompt_len) + self.region_blocks(prompt_len)
                + self.exact_blocks(self.exact_generated(generated))
                + self.method.growth_blocks(prompt_len, generated))

    def peak_blocks(self, prompt_len: int) -> int:
        """Blocks a request holds in the step its prompt is finalized (staging + region)."""
        return self.blocks_needed(prompt_len, prompt_len)

    def steady_blocks(self, prompt_len: int) -> int:
        """Blocks a request holds after finalize (its staging freed)."""
        if not self.is_sparse(prompt_len):
            return self.exact_blocks(prompt_len)
        return self.region_blocks(prompt_len)

    def store_bytes(self, prompt_len: int) -> int:
        """Host-store bytes of a request, every layer of this worker (0 when not compressed)."""
        if not self.is_sparse(prompt_len):
            return 0
        return sum(self.method.store_bytes(layer, prompt_len)
                   for layer in range(self.shapes.num_layers))

    def region_ids(self, prompt_len: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Block ids of the method's region of a compressed request."""
        start = self.exact_blocks(prompt_len)
        return block_ids[start: start + self.region_blocks(prompt_len)].long()

    def growth_ids(self, prompt_len: int, num_generated: int,
                   block_ids: torch.Tensor) -> torch.Tensor:
        """Block ids of the growth pages (a method with a generated-token ring)."""
        ring = self.method.generated_ring
        assert ring is not None, "growth pages come with a generated-token ring"
        start = (self.exact_blocks(prompt_len) + self.region_blocks(prompt_len)
                 + self.exact_blocks(ring))
        return block_ids[start: start + self.method.growth_blocks(prompt_len, num_generated)]

    def ring_segments(self, prompt_len: int, first: int, end: int) -> list[tuple[int, int]]:
        """Positions [first, end) of one request's step, cut after each position that fills
        the generated-token ring (one segment without a ring). A step longer than the ring's
        free slots (vLLM recomputing a preempted request) would overwrite tokens not folded
        yet: the engine writes and decodes it one segment at a time."""
        ring = self.method.generated_ring
        if ring is None or not self.is_sparse(prompt_len) or end <= prompt_len + ring:
            return [(first, end)]
        cut = prompt_len + (max(first - prompt_len, 0) // ring + 1) * ring
        segments = []
        while cut < end:
            segments.append((first, cut))
            first, cut = cut, cut + ring
        return segments + [(first, end)]

    def exact_token_slots(self, prompt_len: int, block_ids: torch.Tensor,
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, slot in page) of exact tokens at ``positions`` of one request: the prompt
        in the staging pages, generated tokens of a compressed request after its region (at
        their place in the ring, for a method with one)."""
        blocks, slots = self.exact_token_slots_batch([prompt_len], block_ids[None],
                                                     positions[None])
        return blocks[0], slots[0]

    def exact_token_slots_batch(self, prompt_lens: list[int], block_table: torch.Tensor,
                                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``exact_token_slots`` of several requests at once: their block table rows
        ``[B, n]`` and positions ``[B, T]`` -> blocks, slots ``[B, T]``."""
        ne = self.exact_per_page
        index, offset = positions // ne, positions % ne
        sparse = [self.is_sparse(p) for p in prompt_lens]
        if any(sparse):
            def per_row(values: list):  # a scalar for one request: the builder's hot path
                return values[0] if len(values) == 1 else torch.tensor(
                    values, device=positions.device).view(-1, 1)
            prompt = per_row(prompt_lens)
            generated = positions >= prompt
            if not all(sparse):
                generated &= per_row(sparse)
            base = per_row([self.exact_blocks(p) + self.region_blocks(p) if s else 0
                            for p, s in zip(prompt_lens, sparse)])
            rel = positions - prompt
            if self.method.generated_ring is not None:
                rel = rel % self.method.generated_ring
            index = torch.where(generated, base + rel // ne, index)
            offset = torch.where(generated, rel % ne, offset)
        return block_table.gather(1, index.long()).long(), offset
