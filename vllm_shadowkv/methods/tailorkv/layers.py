"""Which layers are quantization-friendly: ``q_layers: "auto"`` resolved per model.

First the paper's sets (Table 9 and its code's ``model2quantlayer.json``, digest §3), by model
family; a family is told apart by its model type and vocabulary (Llama-2, Llama-3.x and Yi are
all ``llama``). Otherwise the layer-profiling command's result for that model
(``python -m vllm_shadowkv.methods.tailorkv.profile --model PATH``), which it writes under
``$SHADOWKV_CACHE_DIR/tailorkv`` (default ``~/.cache/vllm_shadowkv/tailorkv``) unless told
otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from vllm_shadowkv.methods.base import SettingsError

# (model_type, vocab_size) -> (family, quantization-friendly layers)
FAMILY_LAYERS: dict[tuple[str, int], tuple[str, tuple[int, ...]]] = {
    ("llama", 128256): ("Llama-3.x", (0,)),
    ("llama", 32000): ("Llama-2", (0, 1)),
    ("llama", 64000): ("Yi", (0, 1)),
    ("mistral", 32768): ("Mistral-v0.3", (0,)),
}


def family_layers(hf_config: Any) -> tuple[str, tuple[int, ...]] | None:
    """The paper's layer set for the model's family, or None for a family it did not profile."""
    return FAMILY_LAYERS.get((getattr(hf_config, "model_type", None),
                              getattr(hf_config, "vocab_size", None)))


def profile_path(model: str | os.PathLike) -> Path:
    """Where the profiling command writes a model's layer set by default (one file per model
    directory)."""
    model = Path(model).expanduser().resolve()
    root = Path(os.environ.get("SHADOWKV_CACHE_DIR", "~/.cache/vllm_shadowkv")).expanduser()
    digest = hashlib.sha256(str(model).encode()).hexdigest()[:12]
    return root / "tailorkv" / f"{model.name}-{digest}.json"


def auto_q_layers(hf_config: Any, model: str | os.PathLike) -> tuple[int, ...]:
    """``q_layers: "auto"`` for this model: the family table, else the profiled layer set."""
    known = family_layers(hf_config)
    if known is not None:
        return known[1]
    path = profile_path(model)
    if not path.exists():
        raise SettingsError(
            f"tailorkv.q_layers 'auto': no shipped layer set for this model family (model_type "
            f"{getattr(hf_config, 'model_type', None)!r}, vocab_size "
            f"{getattr(hf_config, 'vocab_size', None)}) and no profile at {path}; run "
            f"`python -m vllm_shadowkv.methods.tailorkv.profile --model {model}` or set "
            f"tailorkv.q_layers to a list of layers")
    return tuple(json.loads(path.read_text())["q_layers"])
