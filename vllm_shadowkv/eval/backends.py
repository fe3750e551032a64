"""Backend specs of the accuracy runner: a short string per engine configuration.

    default                          vLLM's own attention backend for the platform
    shadowkv                         this plugin's backend with the papers' defaults
    shadowkv:{"sparse_budget":64}    ... with settings (``--additional-config`` {"shadowkv": ...})
    shadowkv-naive:{...}             the same budget spent on sink + local window only
                                     (settings gain "selection": "naive")
    NAME[-VARIANT][:{json}]          any other registered backend, the same way
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackendSpec:
    label: str                       # the spec as written: names columns, files and plot lines
    attention_backend: str | None    # None: leave vLLM's choice
    settings: dict = field(default_factory=dict)

    def llm_kwargs(self) -> dict:
        """Keyword arguments for ``vllm.LLM`` (and, flag by flag, for ``vllm serve``)."""
        if self.attention_backend is None:
            return {}
        kwargs: dict = {"attention_backend": self.attention_backend}
        if self.settings:
            kwargs["additional_config"] = {self.attention_backend: dict(self.settings)}
        return kwargs


def parse(spec: str) -> BackendSpec:
    name, _, raw = spec.partition(":")
    name = name.strip()
    settings = json.loads(raw) if raw.strip() else {}
    if not isinstance(settings, dict):
        raise ValueError(f"backend spec {spec!r}: settings must be a JSON object")
    if name == "default":
        if settings:
            raise ValueError("the default backend takes no settings")
        return BackendSpec(spec, None)
    base, _, variant = name.partition("-")
    if not base:
        raise ValueError(f"backend spec {spec!r} has no backend name")
    if variant:
        settings = {"selection": variant, **settings}
    return BackendSpec(spec, base, settings)
