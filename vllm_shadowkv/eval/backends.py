"""Backend specs of the accuracy runner: a short string per engine configuration.

    default                           vLLM's own attention backend for the platform
    shadowkv                          this plugin's backend with its defaults (vllm_shadowkv/config.py)
    shadowkv:{"sparse_budget":64}     ... with fixed settings (``--additional-config`` {"shadowkv": ...})
    shadowkv@1.56%                    a sparse budget of 1.56 % of each context length: one engine
                                      per length, with sparse_budget = 1.56 % of the length rounded
                                      down to whole chunks (at least one chunk) and outlier_chunks
                                      scaled with the length like the paper's 48 chunks at 128K
    shadowkv@1.56%:{"rank":160}       ... plus fixed settings (not sparse_budget/outlier_chunks)
    sink_recent@1.56%                 the naive baseline at the same attended-token count: shadowkv
                                      with selection "sink_recent" (first chunk + most recent
                                      chunks, no landmark selection) and no outliers, their tokens
                                      added to its budget instead
    minikv:{"heavy_ratio":0,"recent_ratio":0.5}
                                      any other method of this plugin (or registered backend)
                                      with fixed settings under its own key, the same way; e.g.
                                      this one is MiniKV's recent-window-only baseline
    LABEL=SPEC                        SPEC, labelled LABEL in tables, files and plots

The settings keys are the backend's own (for shadowkv ``rank``, ``chunk_size``,
``sparse_budget``, ``outlier_chunks``, ``local_window``, ``min_sparse_len``, ...; for minikv
``bits``, ``heavy_ratio``, ``recent_ratio``, ...); the engine refuses unknown ones at start-up.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace

SHADOWKV = "shadowkv"
SINK_RECENT = "sink_recent"  # shorthand for shadowkv with {"selection": "sink_recent"}
# The paper's outlier share: 48 chunks of 8 tokens at 128K tokens (0.29 % of the context).
PAPER_OUTLIER_CHUNKS, PAPER_CHUNK_SIZE, PAPER_CONTEXT = 48, 8, 128 * 1024
OUTLIER_RATIO = PAPER_OUTLIER_CHUNKS * PAPER_CHUNK_SIZE / PAPER_CONTEXT
DEFAULT_CHUNK_SIZE = 8  # ShadowKVSettings.chunk_size


@dataclass(frozen=True)
class BackendSpec:
    label: str                       # the spec as written: names columns, files and plot lines
    attention_backend: str | None    # None: leave vLLM's choice
    settings: dict = field(default_factory=dict)
    budget_ratio: float | None = None  # shadowkv@R%: sparse budget as a fraction of the context

    @property
    def per_length(self) -> bool:
        """One engine per context length (the settings depend on it)."""
        return self.budget_ratio is not None

    @property
    def is_shadowkv(self) -> bool:
        return self.method == SHADOWKV

    @property
    def method(self) -> str | None:
        """The plugin method this engine runs (its stats and sparse checks apply), or None."""
        from vllm_shadowkv.methods import METHODS

        name = (self.attention_backend or "").lower()
        return name if name in METHODS else None

    def with_shadowkv_settings(self, common: dict) -> BackendSpec:
        """``common`` shadowkv settings under this spec's own (the spec's keys win); other
        backends are returned unchanged. The label stays as written."""
        if not self.is_shadowkv or not common:
            return self
        if self.budget_ratio is not None:
            common = {k: v for k, v in common.items() if k not in ("sparse_budget", "outlier_chunks")}
        return replace(self, settings={**common, **self.settings})

    def resolve(self, length: int) -> BackendSpec:
        """The fixed-settings spec that serves prompts of ``length`` tokens."""
        if self.budget_ratio is None:
            return self
        chunk = int(self.settings.get("chunk_size", DEFAULT_CHUNK_SIZE))
        budget, outliers = budget_tokens(self.budget_ratio, length, chunk), outlier_chunks(length, chunk)
        if self.settings.get("selection") == SINK_RECENT:  # same tokens attended, none chosen
            budget, outliers = budget + outliers * chunk, 0
        return replace(self, budget_ratio=None, settings={
            **self.settings, "sparse_budget": budget, "outlier_chunks": outliers})

    def llm_kwargs(self) -> dict:
        """Keyword arguments for ``vllm.LLM`` (and, flag by flag, for ``vllm serve``)."""
        if self.budget_ratio is not None:
            raise ValueError(f"{self.label}: resolve(length) first (the budget depends on it)")
        if self.attention_backend is None:
            return {}
        kwargs: dict = {"attention_backend": self.attention_backend}
        if self.settings:
            kwargs["additional_config"] = {self.attention_backend.lower(): dict(self.settings)}
        return kwargs


def budget_tokens(ratio: float, length: int, chunk_size: int) -> int:
    """``ratio`` x ``length`` rounded down to whole chunks, at least one chunk."""
    return max(chunk_size, math.floor(ratio * length / chunk_size) * chunk_size)


def outlier_chunks(length: int, chunk_size: int) -> int:
    """The paper's outlier share (48 chunks of 8 tokens at 128K) of ``length``, at least one
    chunk (rounded half up)."""
    return max(1, math.floor(OUTLIER_RATIO * length / chunk_size + 0.5))


def parse(spec: str) -> BackendSpec:
    label, eq, rest = spec.partition("=")
    if eq and re.fullmatch(r"[\w.%@+-]+", label.strip()):  # LABEL=SPEC: the label names columns
        return replace(parse(rest), label=label.strip())
    head, _, raw = spec.partition(":")
    head = head.strip()
    try:
        settings = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"backend spec {spec!r}: settings are not JSON: {e}") from e
    if not isinstance(settings, dict):
        raise ValueError(f"backend spec {spec!r}: settings must be a JSON object")
    name, at, ratio_text = head.partition("@")
    name = name.strip()
    if not name:
        raise ValueError(f"backend spec {spec!r} has no backend name")
    if name == "default":
        if settings or at:
            raise ValueError("the default backend takes no settings")
        return BackendSpec(spec, None)
    if name.lower() == SINK_RECENT:
        name, settings = SHADOWKV, {**settings, "selection": SINK_RECENT}
    ratio = None
    if at:
        if name.lower() != SHADOWKV:
            raise ValueError(f"backend spec {spec!r}: a budget ratio (@R%) is for {SHADOWKV} and {SINK_RECENT} only")
        ratio_text = ratio_text.strip()
        if not ratio_text.endswith("%"):
            raise ValueError(f"backend spec {spec!r}: write the budget as a percentage, e.g. @1.56%")
        try:
            ratio = float(ratio_text[:-1]) / 100.0
        except ValueError as e:
            raise ValueError(f"backend spec {spec!r}: bad percentage {ratio_text!r}") from e
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"backend spec {spec!r}: the budget must be in (0, 100] %")
        fixed = sorted({"sparse_budget", "outlier_chunks"} & set(settings))
        if fixed:
            raise ValueError(f"backend spec {spec!r}: {', '.join(fixed)} come from the ratio")
    return BackendSpec(spec, name, settings, ratio)
