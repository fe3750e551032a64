"""Synthetic keys with the structure ShadowKV relies on (paper §3, Fig. 1-5):
low-rank pre-RoPE keys whose energy sits in the slowly rotating RoPE pairs (so post-RoPE keys
are locally smooth), a few incoherent outlier chunks, and a planted needle chunk that the
query looks for, plus a few partially relevant chunks."""

from dataclasses import dataclass

import torch

from vllm_shadowkv.core.rope import RopeCache, apply_rope

from core_rope_util import default_rope


@dataclass
class Synthetic:
    rope: RopeCache
    keys: torch.Tensor  # [T, h_kv, d] post-RoPE
    values: torch.Tensor
    positions: torch.Tensor
    query: torch.Tensor  # [1, h_q, d] at position T
    needle_chunk: int
    outlier_chunks: list[int]


def make_synthetic(num_tokens=8192, h_kv=2, group=4, head_dim=64, chunk=8, latent=16,
                   n_outliers=4, n_relevant=12, strength=2.2, seed=0) -> Synthetic:
    g = torch.Generator().manual_seed(seed)
    rope = default_rope(head_dim, num_tokens + 64)
    n_chunks = num_tokens // chunk
    width = h_kv * head_dim
    # Energy sits in the slowly rotating RoPE pairs (neox pair i = dims i, i + d/2 turns by
    # base^(-2i/d) per token, so high i is slow), as in real keys.
    pair = torch.arange(head_dim) % (head_dim // 2)
    decay = torch.exp(-(head_dim // 2 - 1 - pair).float() / 6).repeat(h_kv)
    mixing = torch.randn(latent, width, generator=g) * decay
    # Latent states drift slowly along the sequence: smooth within a chunk.
    steps = torch.randn(num_tokens, latent, generator=g) * 0.15
    drift = torch.randn(num_tokens // 256 + 1, latent, generator=g)
    z = drift.repeat_interleave(256, dim=0)[:num_tokens] + steps
    needle_dir = torch.randn(latent, generator=g)
    needle_dir = 3.0 * needle_dir / needle_dir.norm() * latent ** 0.5
    chunks = torch.randperm(n_chunks - 8, generator=g)[: 1 + n_relevant + n_outliers] + 1
    needle, relevant = int(chunks[0]), chunks[1:1 + n_relevant].tolist()
    outliers = [0] + chunks[1 + n_relevant:].tolist()[: n_outliers - 1]  # chunk 0 = sink
    tok = lambda c: slice(c * chunk, (c + 1) * chunk)  # noqa: E731
    z[tok(needle)] = needle_dir + 0.05 * torch.randn(chunk, latent, generator=g)
    for i, c in enumerate(relevant):
        z[tok(c)] = needle_dir * (0.35 + 0.03 * i) + z[tok(c)] * 0.5
    mean = torch.randn(width, generator=g) * decay * 2
    keys_pre = (mean + z @ mixing).view(num_tokens, h_kv, head_dim)
    keys_pre += 0.02 * torch.randn(keys_pre.shape, generator=g)  # full-rank noise floor
    for c in outliers:  # incoherent chunks: large random directions
        keys_pre[tok(c)] = 4 * torch.randn(chunk, h_kv, head_dim, generator=g)
    positions = torch.arange(num_tokens)
    keys = apply_rope(keys_pre, positions, rope)
    values = torch.randn(num_tokens, h_kv, head_dim, generator=g)
    # The query looks for the needle: its post-RoPE direction, per KV group, plus noise.
    target = keys[tok(needle)].mean(0)  # [h_kv, d]
    target = target / target.norm(dim=-1, keepdim=True)
    query = (target.repeat_interleave(group, dim=0) * strength * head_dim ** 0.5
             + torch.randn(h_kv * group, head_dim, generator=g)).unsqueeze(0)
    return Synthetic(rope, keys, values, positions, query, needle, outliers)
