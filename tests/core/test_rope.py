"""Inverse RoPE recovers the keys captured before vLLM's own rotary embedding, for each scaling
variant vLLM builds (the cos/sin cache is taken from vLLM's get_rope)."""

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

from vllm_shadowkv.core.rope import RopeCache, apply_rope, invert_rope

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


def _vllm_rope(kind: str, head_dim: int, dtype: torch.dtype):
    neox, _, params = VARIANTS[kind]
    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps read it when built
        emb = get_rope(head_dim, max_position=4096, is_neox_style=neox,
                       rope_parameters=params, dtype=dtype)
    return emb, RopeCache(emb.cos_sin_cache, emb.rotary_dim, emb.is_neox_style)


@pytest.mark.parametrize("kind", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_rope_recovers_pre_rope_keys(kind, dtype):
    head_dim, heads, tokens = 64, 3, 257
    emb, rope = _vllm_rope(kind, head_dim, dtype)
    assert rope.rotary_dim == int(head_dim * VARIANTS[kind][1])
    keys_pre = torch.randn(tokens, heads, head_dim).to(dtype)
    positions = torch.randperm(4096)[:tokens]  # true positions, not 0..T-1
    query = torch.zeros(tokens, heads * head_dim, dtype=dtype)
    _, keys_post = emb.forward_native(positions, query, keys_pre.reshape(tokens, -1).clone())
    recovered = invert_rope(keys_post.view(tokens, heads, head_dim), positions, rope)
    # bf16: vLLM rounds the rotated key to bf16 (relative 2^-8 per element); the inverse itself
    # is fp32.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(recovered, keys_pre.float(), **tol)
    # And the forward rotation here matches vLLM's.
    again = apply_rope(keys_pre, positions, rope)
    torch.testing.assert_close(again.float(), keys_post.view(tokens, heads, head_dim).float(), **tol)


def test_yarn_cache_is_not_orthogonal():
    # Guards the reason invert_rope divides by cos^2 + sin^2: yarn scales both by mscale.
    _, rope = _vllm_rope("yarn", 64, torch.float32)
    cos, sin = rope.cos_sin_cache.chunk(2, dim=-1)
    assert not torch.allclose(cos ** 2 + sin ** 2, torch.ones_like(cos))
