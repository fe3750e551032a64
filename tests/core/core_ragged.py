"""Test helpers: ragged (varlen-packed) compression and the plain A·B key rebuild."""

import torch

from vllm_shadowkv.core.compress import compress_prompt


def compress_prompts(keys, values, positions, cu_seqlens, rope, params, store, store_keys):
    """Request i owns rows [cu_seqlens[i], cu_seqlens[i+1]) of keys/values/positions."""
    assert len(cu_seqlens) == len(store_keys) + 1
    return [compress_prompt(keys[s:e], values[s:e], positions[s:e], rope, params, store, key)
            for s, e, key in zip(cu_seqlens[:-1], cu_seqlens[1:], store_keys)]


def rebuild_pre_rope(a_rows: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A rows [T, r] x B [h_kv, r, d] -> pre-RoPE keys [T, h_kv, d], fp32."""
    return torch.einsum("tr,hrd->thd", a_rows.float(), b.float())
