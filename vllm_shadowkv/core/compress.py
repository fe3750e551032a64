"""Prefill compression of one layer: what each request keeps for sparse decode.

Prefill attention itself is exact and not done here. After it, per request:
  tokens [0, n_c*c)   -> low-rank pre-RoPE keys (A rows, B), one landmark per chunk, values to
                         the value store; per KV head the `outlier_chunks` least coherent chunks
                         are also kept exact and removed from the selectable landmarks;
  tokens [n_c*c, T)   -> the local window, exact (last `local_chunks` chunks + T mod c tokens).
A prompt below the compression point (`ShadowKVParams.compressed_chunks` == 0) keeps all its
tokens in the exact region and has no landmarks, so decode is dense attention for it.
"""

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from . import ops
from .landmarks import outlier_chunks, selectable_landmarks
from .lowrank import factorize_keys
from .params import ShadowKVParams
from .rope import RopeCache
from .store import ValueStore


@dataclass
class CompressedPrompt:
    """One request, one layer, after prefill. Tensors are in the keys' dtype unless noted."""

    num_tokens: int
    a: torch.Tensor  # [n_c*c, r] A rows of the compressed tokens
    a_positions: torch.Tensor  # [n_c*c] int32 true positions (RoPE on rebuild)
    b: torch.Tensor  # [h_kv, r, d]
    landmarks: torch.Tensor  # [n_sel, h_kv, d] selectable landmarks, ascending chunk id
    landmark_chunks: torch.Tensor  # [n_sel, h_kv] int32 chunk id of each landmark
    outliers: torch.Tensor  # [h_kv, o] int32 chunk ids kept exact
    exact_k: torch.Tensor  # [h_kv, o*c + local, d] post-RoPE: outlier chunks, then local window
    exact_v: torch.Tensor  # [h_kv, o*c + local, d]

    @property
    def compressed_tokens(self) -> int:
        return self.a.shape[0]

    @property
    def is_exact(self) -> bool:
        return self.compressed_tokens == 0


def compress_prompt(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeCache,
    params: ShadowKVParams,
    store: ValueStore,
    store_key: Hashable,
) -> CompressedPrompt:
    """keys (post-RoPE), values [T, h_kv, d]; positions [T]. Values of compressed chunks go to
    `store` under `store_key` (all of them, outliers included, so a chunk id is a row index)."""
    num_tokens, num_heads, head_dim = keys.shape
    c = params.chunk_size
    n_chunks = params.compressed_chunks(num_tokens)
    rank = min(params.rank, num_heads * head_dim)
    dtype, device = keys.dtype, keys.device
    if n_chunks == 0:
        return CompressedPrompt(
            num_tokens=num_tokens,
            a=keys.new_zeros(0, rank),
            a_positions=torch.zeros(0, dtype=torch.int32, device=device),
            b=keys.new_zeros(num_heads, rank, head_dim),
            landmarks=keys.new_zeros(0, num_heads, head_dim),
            landmark_chunks=torch.zeros(0, num_heads, dtype=torch.int32, device=device),
            outliers=torch.zeros(num_heads, 0, dtype=torch.int32, device=device),
            exact_k=keys.transpose(0, 1).contiguous(),
            exact_v=values.transpose(0, 1).contiguous(),
        )

    split = n_chunks * c
    a, b = factorize_keys(ops.invert_rope(keys[:split], positions[:split], rope), params.rank)
    landmarks, min_cos = ops.chunk_geometry(keys[:split], c)  # [n_c, h, d], [n_c, h]
    outliers = outlier_chunks(min_cos, params.outliers_for(num_tokens))  # [h, o]

    sel_landmarks, sel_ids = selectable_landmarks(landmarks.to(dtype), outliers)

    def exact(x: torch.Tensor) -> torch.Tensor:
        per_head_chunks = x[:split].view(n_chunks, c, num_heads, head_dim).permute(2, 0, 1, 3)
        picked = per_head_chunks.gather(
            1, outliers.view(num_heads, -1, 1, 1).expand(-1, -1, c, head_dim))
        return torch.cat((picked.flatten(1, 2), x[split:].transpose(0, 1)), dim=1).contiguous()

    store.put(store_key, values[:split].view(n_chunks, c, num_heads, head_dim).permute(2, 0, 1, 3))
    return CompressedPrompt(
        num_tokens=num_tokens,
        a=a.to(dtype),
        a_positions=positions[:split].to(torch.int32),
        b=b.to(dtype),
        landmarks=sel_landmarks,
        landmark_chunks=sel_ids,
        outliers=outliers.to(torch.int32),
        exact_k=exact(keys),
        exact_v=exact(values),
    )

