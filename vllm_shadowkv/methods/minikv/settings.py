"""The ``minikv`` settings: the paper's defaults (§5.1), and the per-layer budgets they imply.

The prompt length from which a request is compressed is the engine's ``min_sparse_len``
(MiniKV's ``min_compress_len``): one threshold for every method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from vllm_shadowkv.core.heavy_hitters import layer_budgets
from vllm_shadowkv.core.kivi import KiviFormat
from vllm_shadowkv.methods.base import (EngineSettings, KVShapes, SettingsError, at_least,
                                        multiple_of, one_of)

EXACT_BITS = 16  # "quantization off": kept tokens and folded generated tokens stay 16-bit
BITS = (2, 4, EXACT_BITS)
LayerPolicy = Literal["pyramid", "uniform"]
LAYER_POLICIES = get_args(LayerPolicy)


@dataclass(frozen=True)
class MiniKVSettings(EngineSettings):
    method: ClassVar[str] = "minikv"

    bits: int = 2
    """Bits per quantized key and value (KIVI codes): 2 or 4; 16 turns quantization off (the
    kept tokens and the folded generated tokens are stored 16-bit: exact attention over them)."""
    group_size: int = 16
    """Tokens per key group (one scale and zero per channel) and channels per value group (one
    scale and zero per token); it must divide head_dim."""
    residual: int = 128
    """Generated tokens held 16-bit before they are quantized together (a multiple of
    group_size)."""
    heavy_ratio: float = 0.25
    """Heavy hitters kept per KV head, as a share of the prompt: the mean over the layers."""
    recent_ratio: float = 0.25
    """Recent window kept per KV head in every layer, as a share of the prompt."""
    layer_policy: LayerPolicy = "pyramid"
    """How the heavy-hitter budget is spread over the layers: "pyramid" (linear in the layer,
    the first layer largest, depth 7) or "uniform" (heavy_ratio in every layer)."""
    score_window: int = 0
    """Prompt queries whose attention scores the keys for the heavy hitters: 0, every one (H2O,
    the paper's choice); N > 0, only the last N (SnapKV's observation window: the question at
    the end of a prompt decides what is kept)."""

    pool: int = 1
    """Odd width of the max-pooling over the scores before the heavy hitters are taken: a
    token scores the most of the `pool` tokens centred on it, so the neighbours of a heavy
    token are kept with it (SnapKV's clustering); 1, no pooling (H2O)."""

    def check(self) -> None:
        super().check()
        at_least(self, "pool", 1)
        if self.pool % 2 == 0:
            raise SettingsError(f"minikv.pool must be odd (a window centred on the token), "
                                f"got {self.pool}")
        one_of(self, "bits", BITS, f" ({EXACT_BITS}: no quantization)")
        at_least(self, "group_size", 1)
        at_least(self, "score_window", 0)
        at_least(self, "residual", self.group_size)
        multiple_of(self, "residual", "group_size",
                    "generated tokens are quantized in whole groups")
        for name in ("heavy_ratio", "recent_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise SettingsError(f"minikv.{name} must be in [0, 1] (a share of the prompt), "
                                    f"got {value}")
        if self.heavy_ratio + self.recent_ratio <= 0.0:
            raise SettingsError("minikv.heavy_ratio + minikv.recent_ratio must be > 0: a "
                                "compressed prompt keeps some tokens")
        one_of(self, "layer_policy", LAYER_POLICIES)

    def check_engine(self, shapes: KVShapes) -> None:
        d = shapes.head_size
        if d % self.group_size:
            divisors = [g for g in range(1, d + 1) if d % g == 0]
            raise SettingsError(
                f"minikv.group_size ({self.group_size}) must divide the head size ({d}): "
                f"values are quantized in groups of channels; allowed here: {divisors}")
        if self.bits != EXACT_BITS and d % (32 // self.bits):
            raise SettingsError(
                f"minikv.bits {self.bits} packs {32 // self.bits} codes per int32 along the "
                f"channels, which must divide the head size ({d}); use bits {EXACT_BITS}")

    @property
    def quantized(self) -> bool:
        return self.bits != EXACT_BITS

    def kivi_format(self, head_dim: int) -> KiviFormat:
        assert self.quantized, "16 bits: nothing is quantized"
        return KiviFormat(bits=self.bits, group=self.group_size, head_dim=head_dim,
                          value_group=self.group_size, midpoint_one_bit=False)

    def heavy_budgets(self, num_layers: int) -> list[float]:
        """Heavy-hitter share of the prompt per layer (their mean is heavy_ratio)."""
        return layer_budgets(num_layers, self.heavy_ratio, self.layer_policy)


class EveryTokenQuantized:
    """What MiniKV's pages read from the settings of a method that keeps every prompt token
    KIVI-quantized (SpeCache; TailorKV's Q-layers), with ``bits`` and ``group_size`` fields: no
    heavy-hitter budget, a recent window of the whole prompt, and the 1-bit quantizer that
    does not collapse to min/max (SpeCache's midpoint levels, digest §6)."""

    quantized: ClassVar[bool] = True
    recent_ratio: ClassVar[float] = 1.0
    BITS: ClassVar[tuple[int, ...]] = (1, 2)
    GROUP_SIZES: ClassVar[tuple[int, ...]] = (32, 64)  # the quantized-attention kernels' groups

    def check(self) -> None:
        super().check()
        one_of(self, "bits", self.BITS)
        one_of(self, "group_size", self.GROUP_SIZES)
        at_least(self, "residual", self.group_size)
        multiple_of(self, "residual", "group_size", "tokens are quantized in whole groups")

    def check_engine(self, shapes: KVShapes) -> None:
        super().check_engine(shapes)
        d, per_word = shapes.head_size, 32 // self.bits
        if d % per_word:
            raise SettingsError(
                f"{self.key}.bits {self.bits} packs {per_word} codes per int32 along the "
                f"channels, which must divide the head size ({d}); allowed here: "
                f"{', '.join(str(b) for b in self.BITS if d % (32 // b) == 0) or 'none'}")

    def heavy_budgets(self, num_layers: int) -> list[float]:
        return [0.0] * num_layers

    def kivi_format(self, head_dim: int) -> KiviFormat:
        # Values are grouped by channels: a head narrower than the group is one value group.
        return KiviFormat(bits=self.bits, group=self.group_size, head_dim=head_dim,
                          value_group=math.gcd(self.group_size, head_dim), midpoint_one_bit=True)
