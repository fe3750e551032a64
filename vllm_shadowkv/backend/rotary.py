"""The model's rotary embedding as the table core/rope.py applies: cos/sin per position.

ShadowKV rebuilds keys with RoPE, so it must rotate exactly as the model did. vLLM's rotary
modules that index one table by position (``RotaryEmbedding`` and the subclasses that only
compute that table differently: linear, NTK, dynamic NTK, Llama 3, YaRN, partial rotary,
GPT-J's interleaved pairs) give it as ``cos_sin_cache``. Phi-3's LongRoPE keeps a short and a
long table in one buffer and reads the long one, at an offset, whenever the engine's context
is longer than the original one (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini). Other variants
take more than the token's position (multimodal M-RoPE's three position streams, dual-chunk
attention's, Fourier RoPE): refused, naming the module.
"""

from __future__ import annotations

import weakref

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
    Phi3LongRoPEScaledRotaryEmbedding,
)

from vllm_shadowkv.core.rope import RopeCache
from vllm_shadowkv.methods.base import SettingsError

_STANDARD_FORWARDS = ("forward_native", "forward_cuda", "forward_cpu", "forward_static")
# One fp32 table per rotary module, which vLLM shares between a model's layers: a copy per layer
# would be 2 GiB for Llama-3.1-8B's 128K positions (32 layers x 64 MiB).
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rope_of(rotary, method: str) -> RopeCache:
    """The table ``rotary`` (a layer's ``rotary_emb``) rotates keys with, as a RopeCache."""
    rope = _TABLES.get(rotary)
    if rope is None:
        rope = _TABLES[rotary] = _table(rotary, method)
    return rope


def _table(rotary, method: str) -> RopeCache:
    if isinstance(rotary, Phi3LongRoPEScaledRotaryEmbedding):
        short = rotary.original_max_position_embeddings
        table = rotary.long_short_cos_sin_cache
        table = table[short:] if rotary.use_long_rope else table[:short]
        return RopeCache(table.float(), rotary.rotary_dim, is_neox_style=True)
    if isinstance(rotary, RotaryEmbedding) and all(
            getattr(type(rotary), f, None) is getattr(RotaryEmbedding, f, None)
            for f in _STANDARD_FORWARDS):
        return RopeCache(rotary.cos_sin_cache.float(), rotary.rotary_dim, rotary.is_neox_style)
    raise SettingsError(
        f"the model's rotary embedding {type(rotary).__name__} rotates by more than the token's "
        f"position; the {method} backend rebuilds keys with RoPE and supports position-indexed "
        "rotary embeddings (default, linear, NTK, Llama 3, YaRN, LongRoPE, partial or "
        "interleaved)")
