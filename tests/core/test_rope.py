"""Inverse RoPE recovers the keys captured before vLLM's own rotary embedding, for each scaling
variant vLLM builds (the module from vLLM's get_rope, its table read as the engine reads it:
backend/rotary.py)."""

from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers import rotary_embedding
from vllm.model_executor.layers.rotary_embedding import get_rope, phi3_long_rope_scaled_rope

from vllm_shadowkv.backend.rotary import rope_of
from vllm_shadowkv.core.rope import apply_rope, invert_rope
from vllm_shadowkv.methods.base import SettingsError

VARIANTS = {
    "default": (True, 1.0, {"rope_type": "default", "rope_theta": 10000.0}),
    "llama3": (True, 1.0, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 1024}),
    "linear": (True, 1.0, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "yarn": (True, 1.0, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024}),
    "gptj_partial": (False, 0.5, {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}),
}
# Phi-3's LongRoPE (partial, as Phi-4-mini): the short table while the engine's context fits
# the original one, the long table (read at an offset) beyond it.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 1024,
            "short_factor": [1.0 + 0.05 * i for i in range(24)],
            "long_factor": [1.0 + 0.5 * i for i in range(24)]}
VARIANTS |= {"longrope_short": (True, 0.75, LONGROPE), "longrope_long": (True, 0.75, LONGROPE)}


def _vllm_rope(kind: str, head_dim: int, dtype: torch.dtype, monkeypatch):
    neox, _, params = VARIANTS[kind]
    # LongRoPE picks its table by the engine's context (vLLM's current model config).
    context = 4096 if kind == "longrope_long" else 1024
    monkeypatch.setattr(phi3_long_rope_scaled_rope, "get_current_vllm_config", lambda: (
        SimpleNamespace(model_config=SimpleNamespace(max_model_len=context))))
    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})  # get_rope's cache ignores that
    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps read it when built
        emb = get_rope(head_dim, max_position=4096, is_neox_style=neox,
                       rope_parameters=params, dtype=dtype)
    return emb, rope_of(emb, "shadowkv"), context


@pytest.mark.parametrize("kind", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_rope_recovers_pre_rope_keys(kind, dtype, monkeypatch):
    head_dim, heads, tokens = 64, 3, 257
    emb, rope, context = _vllm_rope(kind, head_dim, dtype, monkeypatch)
    assert rope.rotary_dim == int(head_dim * VARIANTS[kind][1])
    keys_pre = torch.randn(tokens, heads, head_dim).to(dtype)
    positions = torch.randperm(context)[:tokens]  # true positions, not 0..T-1
    query = torch.zeros(tokens, heads * head_dim, dtype=dtype)
    forward = getattr(emb, "forward_native", emb.forward)  # LongRoPE is a plain module
    _, keys_post = forward(positions, query, keys_pre.reshape(tokens, -1).clone())
    recovered = invert_rope(keys_post.view(tokens, heads, head_dim), positions, rope)
    # bf16: vLLM rounds the rotated key to bf16 (relative 2^-8 per element); the inverse itself
    # is fp32.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(recovered, keys_pre.float(), **tol)
    # And the forward rotation here matches vLLM's.
    again = apply_rope(keys_pre, positions, rope)
    torch.testing.assert_close(again.float(), keys_post.view(tokens, heads, head_dim).float(), **tol)


def test_yarn_cache_is_not_orthogonal(monkeypatch):
    # Guards the reason invert_rope divides by cos^2 + sin^2: yarn scales both by mscale.
    _, rope, _ = _vllm_rope("yarn", 64, torch.float32, monkeypatch)
    cos, sin = rope.cos_sin_cache.chunk(2, dim=-1)
    assert not torch.allclose(cos ** 2 + sin ** 2, torch.ones_like(cos))


def test_layers_sharing_a_rotary_module_share_its_table(monkeypatch):
    """vLLM gives every layer of a model one rotary module: one fp32 table for all of them (a
    copy per layer was 64 MiB each for Llama-3.1-8B's 128K positions)."""
    emb, rope, _ = _vllm_rope("llama3", 64, torch.bfloat16, monkeypatch)
    assert rope_of(emb, "shadowkv") is rope


def test_a_rotary_embedding_that_takes_more_than_positions_is_refused():
    """Multimodal M-RoPE rotates by three position streams: ShadowKV cannot rebuild its keys
    from token positions, so the layer's table is refused with the module named."""
    with set_current_vllm_config(VllmConfig()):
        emb = get_rope(64, max_position=4096, is_neox_style=True, dtype=torch.float32,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "mrope_section": [8, 12, 12]})
    with pytest.raises(SettingsError, match=r"rotary embedding MRotaryEmbedding rotates by more "
                                            r"than the token's position; the shadowkv backend"):
        rope_of(emb, "shadowkv")


def test_a_layer_without_a_rotary_module_is_refused(monkeypatch):
    """A model implementation whose attention has no ``rotary_emb`` (not vLLM's own classes):
    ShadowKV cannot rebuild its keys, and says so naming the module, before any step runs."""
    from types import SimpleNamespace

    from vllm_shadowkv.backend import attention
    from vllm_shadowkv.methods.shadowkv import ShadowKVMethod

    model = torch.nn.Module()
    model.add_module("attn", torch.nn.Module())  # no rotary_emb beside the attention layer
    runner = SimpleNamespace(get_model=lambda: model)
    monkeypatch.setattr(type(attention.STATE), "runner", property(lambda self: runner))
    impl = SimpleNamespace(_rope=None)
    layer = SimpleNamespace(layer_name="attn.attn")
    with pytest.raises(SettingsError, match=r"attn has no rotary_emb module"):
        attention.EngineImpl._rope_of(impl, layer, SimpleNamespace(needs_rope=True,
                                                                    name="shadowkv"))
    assert ShadowKVMethod.needs_rope
