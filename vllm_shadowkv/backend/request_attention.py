"""Attention of one request in one layer, in whichever phase the request is.

* exact: short requests, and long ones while their prompt is prefilled (staging pages);
* compress: the step that completes a long prompt also compresses it (after its exact attention);
* sparse: later steps decode with the core's ShadowKV ``decode_step`` over the request's pages.
"""

from __future__ import annotations

import torch

from vllm_shadowkv.backend import pages
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.backend.worker_state import RequestStats
from vllm_shadowkv.core.compress import compress_prompt
from vllm_shadowkv.core.decode import DecodeBatch, decode_step
from vllm_shadowkv.core.fidelity import attended_chunks, chunk_attention_mass, measure_fidelity
from vllm_shadowkv.core.rope import RopeCache
from vllm_shadowkv.core.store import ValueStore


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The last ``q`` positions of a sequence attend all its ``s`` keys, causally.

    query ``[q, Hq, d]``; key, value ``[s, Hkv, d]`` -> ``[q, Hq, d]``, computed in fp32.
    """
    q_len, s_len = query.shape[0], key.shape[0]
    mask = None
    if 1 < q_len < s_len:  # a later prefill chunk: query i sits at position s - q + i
        rows = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        mask = torch.arange(s_len, device=query.device)[None, :] <= rows
    # A whole prompt in one step takes the is_causal path: no mask, so SDPA's fused kernels.
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).float(), key.transpose(0, 1).float(),
        value.transpose(0, 1).float(), attn_mask=mask, is_causal=1 < q_len == s_len,
        scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1).to(query.dtype)


def exact_attention(kv_cache, layout: PageLayout, prompt_len: int, block_ids, seq_len: int,
                    query: torch.Tensor, scale: float) -> torch.Tensor:
    positions = torch.arange(seq_len, device=query.device)
    key, value = pages.read_exact(kv_cache, layout, prompt_len, block_ids, positions)
    return causal_attention(query, key, value, scale)


def compress(kv_cache, layout: PageLayout, prompt_len: int, block_ids, rope: RopeCache,
             store: ValueStore, store_key) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress a completed prompt from its staging pages into its compressed and state pages
    (values to the store); the staging pages are freed by the block manager afterwards. Returns
    the exact prompt keys and values (post-RoPE), e.g. for a fidelity reference."""
    positions = torch.arange(prompt_len, device=kv_cache.device)
    keys, values = pages.read_exact(kv_cache, layout, prompt_len, block_ids, positions)
    prompt = compress_prompt(keys, values, positions, rope, layout.params, store, store_key)
    pages.write_compressed(kv_cache, layout, prompt_len, block_ids, prompt, keys)
    return keys, values


def sparse_attention(kv_cache, layout: PageLayout, prompt_len: int, block_ids, seq_len: int,
                     query, key, value, rope: RopeCache, store: ValueStore, store_key,
                     scale: float, stats: RequestStats, reference=None) -> torch.Tensor:
    """ShadowKV decode: query ``[s_q, Hq, d]``; key/value ``[s_q, Hkv, d]`` are this step's
    tokens (already written to the generated-token pages). ``reference``: the exact prompt
    (keys, values) to measure this step's fidelity against, or None."""
    s_q = query.shape[0]
    state = pages.read_sparse_state(kv_cache, layout, prompt_len, block_ids)
    gen_positions = torch.arange(prompt_len, seq_len - s_q, device=query.device)
    gen_k, gen_v = pages.read_exact(kv_cache, layout, prompt_len, block_ids, gen_positions)
    batch = DecodeBatch.build([state.prompt], [store_key], rope, layout.params,
                              gen_capacity=len(gen_positions) + s_q)
    batch.slot_chunks, batch.slot_k, batch.slot_v = (
        state.slot_chunks[None], state.slot_k[None], state.slot_v[None])
    batch.gen_k[0, :, : len(gen_positions)] = gen_k.transpose(0, 1)
    batch.gen_v[0, :, : len(gen_positions)] = gen_v.transpose(0, 1)
    batch.gen_len[0] = len(gen_positions)
    before = state.slot_chunks
    out, _ = decode_step(batch, query[None], key[None], value[None], store, scale)
    state.slot_chunks, state.slot_k, state.slot_v = (
        batch.slot_chunks[0], batch.slot_k[0], batch.slot_v[0])
    pages.write_slots(kv_cache, layout, prompt_len, block_ids, state)

    selected = int((state.slot_chunks >= 0).sum())
    hits = int(((state.slot_chunks == before) & (before >= 0)).sum())
    chunk_bytes = layout.config.chunk_size * layout.head_size * layout.elem_bytes
    stats.decode_steps += 1
    stats.selected += selected
    stats.hits += hits
    stats.bytes_fetched += (selected - hits) * chunk_bytes
    if reference is not None:
        _record_fidelity(layout, state, reference, gen_k, gen_v, query, key, value, out[0],
                         scale, stats, store_key[1])
    return out[0]


def _record_fidelity(layout, state, reference, gen_k, gen_v, query, key, value, out, scale,
                     stats: RequestStats, layer: int, top: int = 8) -> None:
    """Dense attention over the exact prompt + generated tokens vs the sparse output, and the
    recall of each KV head's ``top`` chunks of largest dense attention mass."""
    ref_k, ref_v = (t.to(query.device) for t in reference)
    all_k, all_v = torch.cat([ref_k, gen_k, key]), torch.cat([ref_v, gen_v, value])
    dense = causal_attention(query, all_k, all_v, scale)
    mass = chunk_attention_mass(query, ref_k, layout.config.chunk_size, scale)
    attended = attended_chunks(state.prompt, state.slot_chunks, layout.params)
    fid = measure_fidelity(out, dense, mass, attended, min(top, mass.shape[1]))
    stats.record_fidelity(layer, fid.relative_error, fid.chunk_recall)
