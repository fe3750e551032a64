"""The ``tailorkv`` settings: the paper's long-context defaults (digest §6: RULER/InfiniteBench,
128 local tokens split 8 sink + 120 recent, 896 selected, 12 critical channels).

``q_layers: "auto"`` names the quantization-friendly layers from the shipped table per model
family, or from the layer-profiling command's output (``layers.py``); it needs the model's
config, so the method resolves it, not ``resolved(shapes)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, get_args

from vllm_shadowkv.methods.base import (EngineSettings, KVShapes, SettingsError, at_least,
                                        one_of)
from vllm_shadowkv.methods.minikv.settings import EveryTokenQuantized
from vllm_shadowkv.methods.tailorkv.layers import auto_q_layers

AUTO = "auto"
ChannelQuery = Literal["current", "predicted"]
CHANNEL_QUERIES = get_args(ChannelQuery)


@dataclass(frozen=True)
class TailorKVSettings(EveryTokenQuantized, EngineSettings):
    """(Its Q-layers are MiniKV's pages with every token kept: ``EveryTokenQuantized``.)"""

    method: ClassVar[str] = "tailorkv"

    q_layers: tuple[int, ...] | Literal["auto"] = AUTO
    """Quantization-friendly layers (KIVI-quantized on the GPU pages): a list of layer indices,
    or "auto" (the paper's set for the model's family, else the layer-profiling command's
    result). Every other layer is sparsity-friendly (offloaded, top-k at decode)."""
    bits: int = 1
    """Bits per quantized key and value in the Q-layers: 1 (TailorKV-1) or 2 (TailorKV-2)."""
    group_size: int = 64
    """KIVI group: 32 or 64 (tokens per key group, channels per value group)."""
    residual: int = 128
    """Generated tokens held in the 16-bit ring before they are folded together: quantized in
    a Q-layer, into 16-bit rows in an S-layer (a multiple of group_size)."""
    sink: int = 8
    """First prompt tokens of an S-layer kept on the GPU pages, always attended."""
    recent: int = 120
    """Last prompt tokens of an S-layer kept on the GPU pages, always attended."""
    top_k: int = 896
    """Prompt tokens selected per KV head at each decode step in an S-layer, from those between
    the sink and the recent window."""
    top_k_ratio: float | None = None
    """If set, replaces top_k: the selected tokens as a share of the prompt, in (0, 1]."""
    critical_channels: int = 12
    """Key channels d_s per KV head that score the tokens (largest |q| x max|K|)."""
    channel_query: ChannelQuery = "current"
    """Which query picks the critical channels: "current" (the layer's own query) or
    "predicted" (the paper's: the layer's q_proj applied to the previous layer's hidden state)."""

    def __post_init__(self) -> None:
        # JSON gives a list; a tuple keeps the frozen settings hashable.
        if isinstance(self.q_layers, list):
            object.__setattr__(self, "q_layers", tuple(self.q_layers))

    def check(self) -> None:
        super().check()
        layers = self.q_layers
        if isinstance(layers, str):
            if layers != AUTO:
                raise SettingsError(f"tailorkv.q_layers must be a list of layer indices or "
                                    f"{AUTO!r}, got {layers!r}")
        elif not isinstance(layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
            raise SettingsError(f"tailorkv.q_layers must be a list of layer indices (ints >= 0) "
                                f"or {AUTO!r}, got {layers!r}")
        elif len(set(layers)) != len(layers):
            twice = sorted({i for i in layers if layers.count(i) > 1})
            raise SettingsError(f"tailorkv.q_layers lists layer(s) {twice} more than once: "
                                f"{list(layers)}")
        at_least(self, "sink", 0)
        at_least(self, "recent", 0)
        at_least(self, "top_k", 1)
        if self.top_k_ratio is not None and not 0.0 < self.top_k_ratio <= 1.0:
            raise SettingsError(f"tailorkv.top_k_ratio must be in (0, 1] (a share of the "
                                f"prompt) or unset, got {self.top_k_ratio}")
        at_least(self, "critical_channels", 1)
        one_of(self, "channel_query", CHANNEL_QUERIES)


    def check_engine(self, shapes: KVShapes) -> None:
        super().check_engine(shapes)  # (bits against the head size: EveryTokenQuantized)
        d = shapes.head_size
        if self.critical_channels > d:
            raise SettingsError(f"tailorkv.critical_channels ({self.critical_channels}) exceeds "
                                f"the head size ({d}); allowed: 1..{d}")
        if isinstance(self.q_layers, tuple):
            outside = [i for i in self.q_layers if i >= shapes.num_layers]
            if outside:
                raise SettingsError(
                    f"tailorkv.q_layers {outside} are not layers of this model: it has "
                    f"{shapes.num_layers} attention layers (allowed: 0..{shapes.num_layers - 1})")

    def for_model(self, model_config) -> TailorKVSettings:
        if self.channel_query == "predicted":  # refused here, before the model loads
            from vllm.model_executor.models import ModelRegistry

            from vllm_shadowkv.patches.predicted_query import check_model_class

            check_model_class(*ModelRegistry.resolve_model_cls(model_config.architectures,
                                                               model_config))
        if self.q_layers != AUTO:
            return self
        return replace(self, q_layers=auto_q_layers(model_config.hf_config, model_config.model))

    def top_k_for(self, prompt_len: int) -> int:
        """Prompt tokens selected per KV head for a prompt of this length."""
        if self.top_k_ratio is None:
            return self.top_k
        return max(1, math.ceil(self.top_k_ratio * prompt_len))
