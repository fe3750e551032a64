"""Rotary position embedding from a vLLM-style cos/sin cache, forward and inverse.

The cache has rows `[cos(rotary_dim/2) | sin(rotary_dim/2)]` per position, exactly like
`vllm...RotaryEmbedding.cos_sin_cache`, so every scaling variant (default, linear, llama3, yarn,
partial rotary) is handled by the cache the engine already built.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeCache:
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]
    rotary_dim: int
    is_neox_style: bool

    def __post_init__(self):
        assert self.cos_sin_cache.dim() == 2 and self.cos_sin_cache.shape[1] == self.rotary_dim
        assert self.rotary_dim % 2 == 0

    def to(self, device: torch.device) -> "RopeCache":
        if self.cos_sin_cache.device == torch.device(device):
            return self
        return RopeCache(self.cos_sin_cache.to(device), self.rotary_dim, self.is_neox_style)


def _pairs(x: torch.Tensor, rope: RopeCache):
    rot = x[..., : rope.rotary_dim]
    if rope.is_neox_style:
        return rot.chunk(2, dim=-1)
    return rot[..., 0::2], rot[..., 1::2]


def _join(x: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, rope: RopeCache,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # The halves are converted before they are joined: compiled, each then writes its slice of
    # the output in ``dtype`` (joined first, the fp32 result took one more pass to convert).
    x1, x2 = x1.to(dtype), x2.to(dtype)
    if rope.is_neox_style:
        rot = torch.cat((x1, x2), dim=-1)
    else:
        rot = torch.stack((x1, x2), dim=-1).flatten(-2)
    return torch.cat((rot, x[..., rope.rotary_dim:].to(dtype)), dim=-1)


def _cos_sin(positions: torch.Tensor, rope: RopeCache):
    cos_sin = rope.cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cos_sin.chunk(2, dim=-1)
    return cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeCache,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, heads, head_dim] -> rotated at `positions` [T]; fp32 math, ``dtype`` out (x's by
    default)."""
    cos, sin = _cos_sin(positions, rope)
    x1, x2 = (p.float() for p in _pairs(x, rope))
    return _join(x, x1 * cos - x2 * sin, x2 * cos + x1 * sin, rope, dtype or x.dtype)


def invert_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeCache) -> torch.Tensor:
    """Undo `apply_rope`: post-RoPE x [T, heads, head_dim] -> pre-RoPE keys, fp32.

    Each 2x2 block [[c, -s], [s, c]] is inverted as [[c, s], [-s, c]] / (c^2 + s^2): yarn bakes
    its mscale into cos and sin, so the block is a scaled rotation, not an orthogonal one.
    """
    cos, sin = _cos_sin(positions, rope)
    det = cos * cos + sin * sin
    o1, o2 = (p.float() for p in _pairs(x, rope))
    return _join(x, (o1 * cos + o2 * sin) / det, (o2 * cos - o1 * sin) / det, rope)
