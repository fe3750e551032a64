"""TailorKV's pages: quantized Q-layers and small 16-bit S-layers under one block table.

**What a compressed request keeps.** A Q-layer keeps every prompt token, KIVI-quantized
(MiniKV's groups, ``P // G`` per KV head, and the last ``P % G`` tokens as 16-bit rows). An
S-layer keeps only 16-bit rows per KV head: the sink and recent tokens, then ``k`` slots for the
top-k tokens each decode step fetches from the host store (the whole prompt lives there). Both
fold generated tokens out of the engine's ring every ``residual`` tokens: into quantized groups
in a Q-layer, into 16-bit rows in an S-layer (the paper keeps them on the GPU, unquantized).

**Page sizes: one spec that states each layer's bytes** (``token_bytes`` per layer; vLLM gives
each layer its own page size under the one block table), not two KV-cache groups: vLLM's hybrid
groups would need equal page sizes and equal layer counts per group, neither of which holds
(Llama-3.x has one Q-layer and 31 S-layers). The block count of a request is shared, so the
layers' page sizes are chosen to make every layer's region fill the same blocks:

* an S-layer's page is one exact page (``block_size`` tokens of 16-bit K and V): its region
  is ``ceil((sink + recent + k) / block_size)`` blocks, whatever the prompt length;
* a Q-layer's page is ``m`` exact pages, ``m`` the integer that makes a max-length request
  take the fewest bytes over all layers (both kinds' regions then fill about the same blocks),
  capped so that the exact staging of one prompt (whose tokens every layer stores at the
  smallest page's density) costs at most ``STAGING_FACTOR`` times its dense size.

A shorter prompt leaves part of the Q-layers' region unused (the S-layers' fixed region sets
the blocks); the Q-layers are few (one or two of 32 in the paper's models), so that costs little.
"""

from __future__ import annotations

from functools import cached_property

import torch

from vllm_shadowkv.methods.base import KVShapes
from vllm_shadowkv.methods.minikv.pages import LayerShape, MiniKVPages
from vllm_shadowkv.methods.tailorkv.settings import TailorKVSettings

STAGING_FACTOR = 2  # most a staged prompt may cost over its dense KV (Q pages are larger)


class TailorKVPages(MiniKVPages):
    def __init__(self, settings: TailorKVSettings, shapes: KVShapes) -> None:
        assert isinstance(settings.q_layers, tuple), "tailorkv: q_layers resolved at start-up"
        self.q_layers = frozenset(settings.q_layers)
        super().__init__(settings, shapes)

    # -- what each layer keeps -----------------------------------------------------------------
    def quantized(self, layer: int) -> bool:
        return layer in self.q_layers

    def local(self, prompt_len: int) -> tuple[int, int]:
        """(sink, recent) tokens an S-layer keeps on its pages."""
        sink = min(self.settings.sink, prompt_len)
        return sink, min(self.settings.recent, prompt_len - sink)

    def local_positions(self, prompt_len: int) -> torch.Tensor:
        """Positions of the sink and recent tokens, in the order of an S-layer's first rows."""
        sink, recent = self.local(prompt_len)
        return torch.cat([torch.arange(sink), torch.arange(prompt_len - recent, prompt_len)])

    def top_k(self, prompt_len: int) -> int:
        """Slots per KV head of an S-layer: the selected tokens, at most the prompt's middle."""
        return min(self.settings.top_k_for(prompt_len), prompt_len - sum(self.local(prompt_len)))

    def kept(self, layer: int, prompt_len: int) -> tuple[int, int]:
        """Prompt tokens per KV head held on the pages at every step: all of them in a Q-layer,
        the sink and recent tokens in an S-layer (the slots change every step)."""
        return 0, prompt_len if self.quantized(layer) else sum(self.local(prompt_len))

    def shape(self, layer: int, prompt_len: int) -> LayerShape:
        if self.quantized(layer):
            groups, tail = divmod(prompt_len, self.settings.group_size)
            return LayerShape(self.q_units, self.rows_per_page(layer), groups, tail)
        # The slots are rows after the sink and recent ones (``slots`` stays 0: the exact part
        # of the decode attends every row of the plan, slots included).
        return LayerShape(0, self.rows_per_page(layer), 0,
                          sum(self.local(prompt_len)) + self.top_k(prompt_len))

    # -- page sizes ----------------------------------------------------------------------------
    @cached_property
    def exact_page_bytes(self) -> int:
        return self.shapes.block_size * 2 * self.shapes.key_width * self.shapes.elem_bytes

    def _page_units(self, layer: int) -> int:
        return self.q_units if self.quantized(layer) else 0

    def page_bytes(self, layer: int) -> int:
        if self.quantized(layer):
            return self.q_units * self.unit_bytes
        return self.exact_page_bytes

    def _q_units_for(self, multiple: int) -> int:
        return self.whole_units(-(-multiple * self.exact_page_bytes // self.unit_bytes))

    @cached_property
    def q_units(self) -> int:
        """Units per Q-layer page (module docstring)."""
        n_q = len(self.q_layers)
        n_s = self.shapes.num_layers - n_q
        if not n_q or not n_s:
            return self._q_units_for(1)
        max_len, h = self.shapes.max_model_len, self.shapes.num_kv_heads
        groups, tail = divmod(max_len, self.settings.group_size)
        s_blocks = -(-(sum(self.local(max_len)) + self.top_k(max_len)) // self.shapes.block_size)
        best = (None, self._q_units_for(1))
        for multiple in range(1, STAGING_FACTOR * (n_q + n_s) // n_q + 1):
            units = self._q_units_for(multiple)
            page = units * self.unit_bytes
            if n_s * self.exact_page_bytes + n_q * page > (
                    STAGING_FACTOR * (n_q + n_s) * self.exact_page_bytes):
                break
            rows_per_page = page // self.row_bytes
            q_blocks = (-(-h * groups // units) if groups else 0) + -(-2 * h * tail // rows_per_page)
            cost = max(s_blocks, q_blocks) * (n_s * self.exact_page_bytes + n_q * page)
            if best[0] is None or cost < best[0]:
                best = (cost, units)
        return best[1]
