"""Exact causal attention over packed sequences (FlashAttention's varlen contract): the torch
reference against per-sequence attention, the CUDA kernel against the reference, and the
engine's step of exact requests in one call against one call per request."""

import dataclasses

import pytest
import torch
from pages_util import SETTINGS, make_layout

from vllm_shadowkv.backend.exact_attention import (IN_PLACE_ROWS, exact_attention_step,
                                                   exact_view, write_exact)
from vllm_shadowkv.core import attention, native, ops
from vllm_shadowkv.core.attention import causal_attention_cpu
from vllm_shadowkv.methods.base import RequestRows

# (query rows, context) per sequence: a whole prompt, later chunks, a decode row, odd sizes.
SEQUENCES = [(37, 37), (16, 101), (1, 53), (64, 64), (5, 200), (1, 29)]


def _packed(group, head_dim, dtype, device, generator):
    h_kv = 2
    q_lens, k_lens = zip(*SEQUENCES)
    q = torch.randn(sum(q_lens), h_kv * group, head_dim, generator=generator)
    k, v = (torch.randn(sum(k_lens), h_kv, head_dim, generator=generator) for _ in range(2))
    cuts = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                         device=device) for n in (q_lens, k_lens)]
    return [t.to(device, dtype) for t in (q, k, v)], cuts, max(q_lens), max(k_lens)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [32, 72])
def test_reference_is_each_sequence_attended_alone(group, head_dim):
    g = torch.Generator().manual_seed(group * 100 + head_dim)
    (q, k, v), (cu_q, cu_k), max_q, max_k = _packed(group, head_dim, torch.float32, "cpu", g)
    out, lse = attention.varlen_causal_attention_reference(q, k, v, cu_q, cu_k, max_q, max_k,
                                                           0.3)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for i in range(len(SEQUENCES)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        want, want_lse = causal_attention_cpu(q[qs], k[ks], v[ks], 0.3)
        torch.testing.assert_close(out[qs], want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lse[:, qs], want_lse.flatten(0, 1), atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_kernel_matches_the_reference(dtype, group, head_dim):
    g = torch.Generator().manual_seed(group + head_dim)
    (q, k, v), cuts, max_q, max_k = _packed(group, head_dim, dtype, "cuda", g)
    assert ops.flash_varlen(q), "torch without FlashAttention on this GPU"
    out, lse = attention.varlen_causal_attention_flash(q, k, v, *cuts, max_q, max_k, 0.1)
    want, want_lse = attention.varlen_causal_attention_reference(q, k, v, *cuts, max_q, max_k,
                                                                 0.1)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


# ShadowKV's pages at rank 61, block 16: 1,104 elements, not whole rows of head_dim 32.
STRADDLING = dict(block_size=16, settings=dataclasses.replace(SETTINGS, rank=61))


def _step_world(device, dtype, generator, pages=None):
    """Short requests of one step on shared, permuted pages, rows of other requests between
    theirs; a chunk's rows are the last of its context."""
    layout = make_layout(h=2, d=32, dtype=dtype, **(pages or dict(block_size=32)))
    per_page = layout.exact_per_page
    blocks_each = [layout.exact_blocks(s) for _, s in SEQUENCES]
    cache = torch.zeros(sum(blocks_each) + 3, 1, layout.block_size,
                        layout.page_bytes // layout.block_size // layout.shapes.elem_bytes,
                        dtype=dtype)
    free = (torch.randperm(sum(blocks_each) + 2, generator=generator) + 1).tolist()
    reqs, start = [], 0
    for (q_len, s_len), n in zip(SEQUENCES, blocks_each):
        block_ids = torch.tensor([free.pop() for _ in range(n)])
        reqs.append(RequestRows(f"r{len(reqs)}", s_len, s_len, start, start + q_len,
                                block_ids))
        blocks, slots = block_ids[torch.arange(s_len) // per_page], torch.arange(s_len) % per_page
        kv = torch.randn(2, s_len, 2, 32, generator=generator)
        write_exact(cache, layout, blocks, slots, kv[0], kv[1])
        start += q_len + 3
    query = torch.randn(start, 8, 32, generator=generator, dtype=dtype)
    reqs = [RequestRows(r.req_id, r.prompt_len, r.seq_len, r.start, r.end,
                        r.block_ids.to(device)) for r in reqs]
    return layout, cache.to(device), reqs, query.to(device)


def _paged_reference(cache, layout, req, query):
    blocks, slots = layout.exact_token_slots(req.prompt_len, req.block_ids,
                                             torch.arange(req.seq_len, device=query.device))
    return attention.paged_causal_attention_reference(
        query[req.start:req.end], exact_view(cache, layout), blocks, slots, 0.2)


def test_step_in_one_call_equals_each_request_alone(monkeypatch):
    """The packed path's gathers, offsets and LSE layout, on the CPU through the reference."""
    layout, cache, reqs, query = _step_world("cpu", torch.float32, torch.Generator().manual_seed(7))
    with_lse = [True, False, True, True, False, True]
    monkeypatch.setattr(ops, "flash_varlen", lambda t: True)
    calls = []
    monkeypatch.setattr(attention, "varlen_causal_attention_flash",
                        lambda *a: calls.append(a) or
                        attention.varlen_causal_attention_reference(*a))
    got = exact_attention_step(cache, layout, reqs, query, 0.2, with_lse)
    assert len(calls) == 1
    for req, (out, lse), wanted in zip(reqs, got, with_lse):
        want_out, want_lse = _paged_reference(cache, layout, req, query)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
        if wanted:
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-4)
        else:
            assert lse is None


@pytest.mark.parametrize("pages", [None, STRADDLING], ids=["rows", "straddling"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_step_on_the_cpu_equals_each_request_alone(kernels, pages, monkeypatch):
    """Without FlashAttention: decode rows in place (one call per row count), chunks alone;
    where the pages are not whole rows of head_dim, every request gathers."""
    layout, cache, reqs, query = _step_world("cpu", torch.float32,
                                             torch.Generator().manual_seed(9), pages)
    with_lse = [True, True, False, True, True, False]
    calls = []
    decode = ops.decode_attention
    monkeypatch.setattr(ops, "decode_attention", lambda *a: calls.append(a[0].shape) or decode(*a))
    with ops.kernel_mode(kernels):
        got = exact_attention_step(cache, layout, reqs, query, 0.2, with_lse)
        in_place = ops.decode_in_place(query, 1, cache)
    assert in_place == (kernels == "auto" and native.library() is not None)
    in_place &= pages is None
    # (16, 101), (1, 53) with (1, 29), and (5, 200) attend in place, one call per row count;
    # the others gather for vLLM's kernel.
    assert calls == ([(1, 16, 8, 32), (2, 1, 8, 32), (1, 5, 8, 32)] if in_place else [])
    for req, (out, lse), wanted in zip(reqs, got, with_lse):
        want_out, want_lse = _paged_reference(cache, layout, req, query)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
        if in_place and req.end - req.start <= IN_PLACE_ROWS and wanted:
            assert lse is not None  # the in-place kernel always gives it
        if wanted and lse is not None:  # (vLLM's kernel, where a request gathers, gives none)
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-4)
        elif not wanted:
            assert lse is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention runs on CUDA")
def test_step_through_flash_matches_the_reference():
    g = torch.Generator().manual_seed(8)
    layout, cache, reqs, query = _step_world("cuda", torch.bfloat16, g)
    got = exact_attention_step(cache, layout, reqs, query, 0.2, [True] * len(reqs))
    for req, (out, lse) in zip(reqs, got):
        want_out, want_lse = _paged_reference(cache, layout, req, query)
        torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_step_hands_over_the_tokens_it_gathered():
    """``read``: a request whose tokens the CPU step gathers (a chunk past IN_PLACE_ROWS) gets
    them, its whole sequence as the pages hold it; one attended in place gets nothing."""
    layout, cache, reqs, query = _step_world("cpu", torch.float32, torch.Generator().manual_seed(5))
    read = {i: [] for i in range(len(reqs))}
    exact_attention_step(cache, layout, reqs, query, 0.2, [False] * len(reqs), read=read)
    in_place = ops.decode_in_place(query, 1, cache)
    for i, req in enumerate(reqs):
        if in_place and req.end - req.start <= IN_PLACE_ROWS:
            assert read[i] == []
            continue
        blocks, slots = layout.exact_token_slots(req.prompt_len, req.block_ids,
                                                 torch.arange(req.seq_len))
        pages = exact_view(cache, layout)
        assert torch.equal(read[i][0], pages[blocks, slots, 0])
        assert torch.equal(read[i][1], pages[blocks, slots, 1])
