"""ShadowKV's one-call CPU step (methods/shadowkv/cpu_step.py) against the composed step it
replaces, through the method's hooks, without vLLM."""

import dataclasses
import re

import pytest
import torch

from vllm_shadowkv.backend.exact_attention import write_exact
from vllm_shadowkv.backend.worker_state import RequestStats
from vllm_shadowkv.core import native
from vllm_shadowkv.core.rope import apply_rope
from vllm_shadowkv.methods.base import RequestRows
from vllm_shadowkv.methods.shadowkv.method import ShadowKVMethod
from vllm_shadowkv.store import CpuValueStore

from pages_util import SETTINGS, context, make_layout, rope_for, write_step

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler")


def test_the_struct_mirrors_the_c_one():
    """``native.SparseStep`` lists ``struct sparse_step``'s fields in its order."""
    source = (native.CSRC / "sparse_step.c").read_text()
    body = re.search(r"struct sparse_step \{(.*?)\n\};", source, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = []
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        first, *rest = declaration.split(",")
        names += [first.split()[-1].lstrip("*")] + [r.strip().lstrip("*") for r in rest]
    assert names == [name for name, _ in native.SparseStep._fields_]


def _run(dtype, layout, prompts, steps, rope=None):
    """Decodes a ragged batch (prompt lengths differ, request c takes two query rows a step, b
    finishes after two steps), with the one-call step on unless the caller turned it off.
    -> outputs per request, the pages, the stats and whether the one-call step ran."""
    g = torch.Generator().manual_seed(4)
    method, rope = layout.method, rope or rope_for()
    h, d, hq = layout.shapes.num_kv_heads, layout.shapes.head_size, 8
    lengths = {r: p + 2 * steps for r, p in prompts.items()}
    needed = {r: layout.blocks_needed(p, lengths[r]) for r, p in prompts.items()}
    cache = torch.zeros(sum(needed.values()) + 3, 1, layout.block_size,
                        layout.page_bytes // layout.block_size // dtype.itemsize, dtype=dtype)
    ids = (torch.randperm(len(cache) - 1, generator=g) + 1).split(list(needed.values()) + [2])
    blocks = dict(zip(prompts, ids))
    kv = {r: (apply_rope(torch.randn(n, h, d, generator=g), torch.arange(n), rope).to(dtype),
              torch.randn(n, h, d, generator=g).to(dtype)) for r, n in lengths.items()}
    store = CpuValueStore(sum(method.store_bytes(0, p) for p in prompts.values()), dtype,
                          method.store_row_shape(0))
    stats = {r: RequestStats() for r in prompts}
    ctx = dataclasses.replace(context(cache, layout, rope, store, None), stats=stats.__getitem__)
    for r, p in prompts.items():
        k, v = kv[r]
        write_exact(cache, layout, *layout.exact_token_slots(p, blocks[r], torch.arange(p)),
                    k[:p], v[:p])
        method.finalize(ctx, RequestRows(r, p, p, 0, 0, blocks[r]), k[:p], v[:p])
    outs, seq, ran = {r: [] for r in prompts}, dict(prompts), False
    gq = torch.Generator().manual_seed(5)
    for step in range(steps):
        live = [r for r in prompts if not (r == "b" and step >= 2)]
        rows = {r: 2 if r == "c" else 1 for r in live}
        reqs, key, value = write_step(cache, layout, prompts, blocks, kv, seq, rows)
        query = torch.randn(sum(rows.values()), hq, d, generator=gq).to(dtype)
        out = torch.zeros_like(query)
        method.decode(ctx, reqs, query, key, value, out)
        ran |= any(plan.cpu_steps for plan in method._batch_plans.values())
        for req in reqs:
            outs[req.req_id].append(out[req.start: req.end].clone())
        if step == 1:
            method.release("b")
            store.free(("b", 0))
        for r in live:
            seq[r] += rows[r]
    return outs, cache, stats, ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [32, 40])
@pytest.mark.parametrize("ratio", [None, 0.05])
def test_one_call_step_equals_the_composed_step(dtype, block_size, ratio, monkeypatch):
    """Same outputs, same pages (slots, ids), same hit counts, bit for bit: the same kernels in
    the same order; also with a budget and outliers per prompt (``sparse_budget_ratio``: 3, 6
    and 4 slots, ``outlier_ratio``: 2, 4 and 3 outlier chunks, the batch's smaller ones
    padded)."""
    prompts = {"a": 600, "b": 1000, "c": 777}
    settings = dataclasses.replace(SETTINGS, rank=64, sparse_budget_ratio=ratio,
                                   outlier_ratio=ratio and 0.03)
    layout = make_layout(block_size=block_size, dtype=dtype, settings=settings)
    assert layout.method.pages.slots_in_place
    one = _run(dtype, layout, prompts, steps=4)
    monkeypatch.setattr(ShadowKVMethod, "_cpu_step", lambda *args: None)
    layout = make_layout(block_size=block_size, dtype=dtype, settings=settings)
    composed = _run(dtype, layout, prompts, steps=4)
    assert one[3] and not composed[3]
    for r in prompts:
        assert len(one[0][r]) == len(composed[0][r])
        for got, want in zip(one[0][r], composed[0][r]):
            assert torch.equal(got, want)
    assert torch.equal(one[1].view(torch.int16), composed[1].view(torch.int16)) \
        if dtype == torch.bfloat16 else torch.equal(one[1].view(torch.int32),
                                                    composed[1].view(torch.int32))
    for r in prompts:
        a, b = one[2][r], composed[2][r]
        assert (a.decode_steps, a.selected, a.hits, a.bytes_fetched) == \
            (b.decode_steps, b.selected, b.hits, b.bytes_fetched)
        assert a.hits < a.selected  # some slots were refilled


@pytest.mark.parametrize("rotary_dim, neox", [(32, False), (16, True), (16, False)],
                         ids=["interleaved", "partial", "partial interleaved"])
def test_one_call_step_with_other_rotary_embeddings(rotary_dim, neox, monkeypatch):
    """GPT-J's interleaved pairs and a rotary part narrower than the head (Phi-3 style): the
    one-call step rebuilds keys with the layer's own RoPE, as the composed step does."""
    from vllm_shadowkv.core.rope import RopeCache

    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(4096).float(), inv)
    rope = RopeCache(torch.cat([freqs.cos(), freqs.sin()], dim=-1), rotary_dim, neox)
    prompts = {"a": 600, "b": 1000, "c": 777}
    settings = dataclasses.replace(SETTINGS, rank=64)
    layout = make_layout(block_size=32, dtype=torch.bfloat16, settings=settings)
    one = _run(torch.bfloat16, layout, prompts, steps=3, rope=rope)
    monkeypatch.setattr(ShadowKVMethod, "_cpu_step", lambda *args: None)
    layout = make_layout(block_size=32, dtype=torch.bfloat16, settings=settings)
    composed = _run(torch.bfloat16, layout, prompts, steps=3, rope=rope)
    assert one[3] and not composed[3]
    for r in prompts:
        for got, want in zip(one[0][r], composed[0][r], strict=True):
            assert torch.equal(got, want)
