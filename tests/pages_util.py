"""ShadowKV's pages without vLLM: a layout, a paged cache, a layer context (tests/unit and
tests/core)."""

import torch

from vllm_shadowkv.backend.exact_attention import write_exact
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.core.rope import RopeCache
from vllm_shadowkv.methods.base import KVShapes, LayerContext, RequestRows
from vllm_shadowkv.methods.shadowkv import ShadowKVMethod, ShadowKVSettings

SETTINGS = ShadowKVSettings(rank=64, sparse_budget=64, outlier_chunks=4, local_window=16,
                            min_sparse_len=256)


def make_layout(h=2, d=32, block_size=32, settings=SETTINGS, dtype=torch.float32):
    shapes = KVShapes(h, d, dtype, block_size, num_layers=1, max_model_len=4096)
    return PageLayout(ShadowKVMethod(settings.resolved(shapes), shapes))


def context(cache, layout, rope, store, stats):
    return LayerContext(index=0, kv_cache=cache, layout=layout, rope=rope, store=store,
                        store_for=None, scale=layout.shapes.head_size ** -0.5,
                        stats=lambda _: stats, reference_kv={})


def pages_for(layout, prompt_len, total, generator):
    n = layout.blocks_needed(prompt_len, total)
    shapes = layout.shapes
    cache = torch.zeros(n + 7, 1, layout.block_size, layout.page_bytes // layout.block_size
                        // shapes.elem_bytes, dtype=shapes.dtype)
    block_ids = torch.randperm(n + 6, generator=generator)[:n] + 1  # block 0: vLLM's null block
    return cache, block_ids


def rope_for(d=32, max_pos=4096):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return RopeCache(torch.cat([freqs.cos(), freqs.sin()], dim=-1), d, True)


def write_step(cache, layout, prompts, blocks, kv, seq, rows):
    """One decode step of a ragged batch: each request's ``rows[r]`` new tokens (from ``kv[r]``,
    after its ``seq[r]``) written into its pages. -> its RequestRows, and the step's keys and
    values, request-major."""
    reqs, at = [], 0
    for r, n in rows.items():
        k, v = kv[r]
        positions = torch.arange(seq[r], seq[r] + n)
        write_exact(cache, layout, *layout.exact_token_slots(prompts[r], blocks[r], positions),
                    k[positions], v[positions])
        reqs.append(RequestRows(r, prompts[r], seq[r] + n, at, at + n, blocks[r]))
        at += n
    key = torch.cat([kv[r][0][seq[r]: seq[r] + n] for r, n in rows.items()])
    value = torch.cat([kv[r][1][seq[r]: seq[r] + n] for r, n in rows.items()])
    return reqs, key, value
