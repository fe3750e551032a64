"""A plain (default-scaling) RoPE cache for tests that do not need vLLM."""

import torch

from vllm_shadowkv.core.rope import RopeCache


def default_rope(head_dim: int, max_position: int, rotary_dim: int | None = None,
                 neox: bool = True, base: float = 10000.0) -> RopeCache:
    rotary_dim = rotary_dim or head_dim
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return RopeCache(torch.cat((freqs.cos(), freqs.sin()), dim=-1), rotary_dim, neox)
