"""Sparse decode: the slot policy, and exactness when nothing is approximated."""

import pytest
import torch

from vllm_shadowkv.core import native, ops
from vllm_shadowkv.core.attention import (attention_with_lse, attention_with_lse_reference,
                                          merge_attention)
from core_ragged import compress_prompts
from vllm_shadowkv.core.decode import DecodeBatch, decode_step
from vllm_shadowkv.core.params import ShadowKVParams
from vllm_shadowkv.core.rope import apply_rope
from vllm_shadowkv.core.select import assign_slots
from vllm_shadowkv.core.store import InMemoryValueStore

from core_dense import dense_attention
from core_rope_util import default_rope
from test_kernels import needs_native


ASSIGN = [pytest.param(assign_slots, id="torch"),
          pytest.param(native.assign_slots, id="c", marks=needs_native)]


@pytest.mark.parametrize("assign_slots", ASSIGN)
def test_assign_slots_keeps_hits_in_place(assign_slots):
    resident = torch.tensor([[[5, 9, -1, 2]]], dtype=torch.int32)
    selected = torch.tensor([[[2, 7, 5, 8]]], dtype=torch.int32)
    slots, miss_slots, miss_count = assign_slots(resident, selected)
    assert slots.tolist() == [[[5, 7, 8, 2]]]  # 5 and 2 stay; 7, 8 take slots 1, 2 in order
    assert miss_count.tolist() == [[2]] and miss_slots.tolist() == [[[1, 2, -1, -1]]]
    # Fewer selected than slots: evicted slots are emptied, not left stale.
    slots, miss_slots, miss_count = assign_slots(slots, torch.tensor([[[8, 3, -1, -1]]],
                                                                     dtype=torch.int32))
    assert slots.tolist() == [[[3, -1, 8, -1]]] and miss_count.tolist() == [[1]]
    assert miss_slots[0, 0, 0] == 0


def _assign_slots_by_loops(resident: list[int], selected: list[int]):
    """The policy row by row: hits stay, misses take the freed slots (lowest first) in
    selection order, slots no longer selected are emptied."""
    wanted = [c for c in selected if c >= 0]
    new = [c if c in wanted else -1 for c in resident]
    misses = [c for c in wanted if c not in resident]
    free = [i for i, c in enumerate(resident) if c not in wanted]
    for slot, chunk in zip(free, misses):
        new[slot] = chunk
    return new, free[:len(misses)] + [-1] * (len(resident) - len(misses)), len(misses)


@pytest.mark.parametrize("assign_slots", ASSIGN)
@pytest.mark.parametrize("k", [1, 7, 64])
def test_assign_slots_matches_the_policy_on_random_rows(k, assign_slots):
    gen = torch.Generator().manual_seed(k)
    batch, h_kv, chunks = 3, 4, 2 * k + 5

    def rows():  # distinct chunk ids per row, some slots empty (-1), in random places
        out = torch.full((batch, h_kv, k), -1, dtype=torch.int32)
        for b in range(batch):
            for h in range(h_kv):
                n = int(torch.randint(0, k + 1, (1,), generator=gen))
                out[b, h, torch.randperm(k, generator=gen)[:n]] = (
                    torch.randperm(chunks, generator=gen)[:n].to(torch.int32))
        return out

    for _ in range(5):
        resident, selected = rows(), rows()
        slots, miss_slots, miss_count = assign_slots(resident, selected)
        for b in range(batch):
            for h in range(h_kv):
                want = _assign_slots_by_loops(resident[b, h].tolist(), selected[b, h].tolist())
                assert (slots[b, h].tolist(), miss_slots[b, h].tolist(),
                        int(miss_count[b, h])) == want


def test_merge_of_split_key_sets_is_attention_over_their_union():
    q, k, v = torch.randn(2, 3, 8, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    full = attention_with_lse(q, k, v, None, 0.25)
    parts = [attention_with_lse(q, k[:, :, s], v[:, :, s], None, 0.25)
             for s in (slice(0, 13), slice(13, 40))]
    empty = attention_with_lse(q, k, v, torch.zeros(1, 1, 1, 40, dtype=torch.bool), 0.25)
    assert torch.isinf(empty[1]).all() and (empty[0] == 0).all()
    out, lse = merge_attention([p[0] for p in parts] + [empty[0]], [p[1] for p in parts] + [empty[1]])
    torch.testing.assert_close(out, full[0])
    torch.testing.assert_close(lse, full[1])


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_attention_matches_reference(group, s_q, dtype):
    """The CPU flash path against the explicit computation: odd widths, non-contiguous K/V,
    masks of every broadcast shape decode uses, rows with no key at all."""
    g = torch.Generator().manual_seed(group * 10 + s_q)
    batch, h_kv, width, d = 3, 2, 37, 24
    q = torch.randn(batch, s_q, h_kv * group, d, generator=g).to(dtype)
    k = torch.randn(batch, h_kv, width + 5, d, generator=g).to(dtype)[:, :, :width]
    v = torch.randn(batch, h_kv, width + 5, d, generator=g).to(dtype)[:, :, :width]
    lengths = torch.tensor([width, 11, 0])  # the last request has no key
    visible = torch.arange(width) < lengths.view(-1, 1)
    masks = [None, visible.view(batch, 1, 1, width),
             torch.rand(batch, h_kv, 1, width, generator=g) < 0.6,  # per KV head (slots)
             visible.view(batch, 1, 1, width)
             & (torch.arange(width) < width - s_q + torch.arange(1, s_q + 1).view(-1, 1))]
    for mask in masks:
        out, lse = attention_with_lse(q, k, v, mask, 0.3)
        ref_out, ref_lse = attention_with_lse_reference(q, k, v, mask, 0.3)
        tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out, ref_out, **tol)
        torch.testing.assert_close(lse, ref_lse, **(tol or dict(atol=1e-5, rtol=1e-5)))


@pytest.mark.parametrize("mask", [False, True])
def test_fused_cpu_attention_over_no_keys(mask):
    """A key set of width 0 (a batch whose requests all lack an exact region): out 0 and lse
    -inf, as the reference gives, where torch's kernel would divide by zero."""
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 2, 0, 8)
    key_mask = torch.ones(2, 1, 1, 0, dtype=torch.bool) if mask else None
    out, lse = attention_with_lse(q, k, k, key_mask, 0.3)
    ref_out, ref_lse = attention_with_lse_reference(q, k, k, key_mask, 0.3)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert not out.any() and bool((lse == float("-inf")).all())


def _batch_inputs(lengths, h_kv, group, d, seed):
    torch.manual_seed(seed)
    rope = default_rope(d, 4096)
    pos = [torch.arange(n) for n in lengths]
    keys = [apply_rope(torch.randn(n, h_kv, d), p, rope) for n, p in zip(lengths, pos)]
    values = [torch.randn(n, h_kv, d) for n in lengths]
    return rope, keys, values, pos


@pytest.mark.parametrize("group,s_q", [(1, 1), (4, 2), (8, 1)])
def test_full_rank_full_budget_is_dense_attention(group, s_q):
    h_kv, d = 2, 16
    lengths = [301, 130, 40]  # ragged; the last stays exact (below min_compress_tokens)
    rope, keys, values, pos = _batch_inputs(lengths, h_kv, group, d, seed=group)
    params = ShadowKVParams(rank=h_kv * d, chunk_size=8, sparse_budget=8 * 64, outlier_chunks=2,
                            local_chunks=2, min_compress_tokens=100)
    store = InMemoryValueStore()
    keys_ids = ["a", "b", "c"]
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    prompts = compress_prompts(torch.cat(keys), torch.cat(values), torch.cat(pos), cu, rope,
                               params, store, keys_ids)
    batch = DecodeBatch.build(prompts, keys_ids, rope, params, gen_capacity=2)
    for step in range(3):  # the generated region grows past its capacity
        q = torch.randn(3, s_q, h_kv * group, d)
        new_pos = [torch.arange(n + step * s_q, n + (step + 1) * s_q) for n in lengths]
        k_new = torch.stack([apply_rope(torch.randn(s_q, h_kv, d), p, rope) for p in new_pos])
        v_new = torch.randn(3, s_q, h_kv, d)
        out, lse = decode_step(batch, q, k_new, v_new, store)
        for i in range(3):
            keys[i], values[i] = torch.cat((keys[i], k_new[i])), torch.cat((values[i], v_new[i]))
            torch.testing.assert_close(out[i], dense_attention(q[i], keys[i], values[i]),
                                       atol=2e-5, rtol=2e-5)
    assert int(batch.lm_count.max()) <= params.select_chunks  # the budget covers every chunk


def _slots_by_chunk(batch, c):
    chunks, order = batch.slot_chunks.sort(dim=-1)
    rows = (order.long().unsqueeze(-1) * c + torch.arange(c)).flatten(2)
    pick = lambda t: t.gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]))  # noqa: E731
    return chunks, pick(batch.slot_k), pick(batch.slot_v)


def test_triton_path_matches_torch_path(interpreted):
    """The whole decode step through the interpreted kernels, bf16, at a budget below the
    context so selection, hits and misses all happen."""
    h_kv, group, d = 2, 4, 64
    lengths = [520, 300]
    rope, keys, values, pos = _batch_inputs(lengths, h_kv, group, d, seed=7)
    keys = [k.bfloat16() for k in keys]
    values = [v.bfloat16() for v in values]
    params = ShadowKVParams(rank=32, chunk_size=8, sparse_budget=64, outlier_chunks=2,
                            local_chunks=2, min_compress_tokens=100)
    ids = ["a", "b"]
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    store = InMemoryValueStore()
    prompts = compress_prompts(torch.cat(keys), torch.cat(values), torch.cat(pos), cu, rope,
                               params, store, ids)
    batches = [DecodeBatch.build(prompts, ids, rope, params) for _ in range(2)]
    for step in range(2):
        q = torch.randn(2, 1, h_kv * group, d).bfloat16()
        k_new, v_new = torch.randn(2, 1, h_kv, d).bfloat16(), torch.randn(2, 1, h_kv, d).bfloat16()
        ref = decode_step(batches[0], q, k_new, v_new, store)
        with ops.force_triton():
            got = decode_step(batches[1], q, k_new, v_new, store)
        # Selections are sets (slot order may differ): compare slot contents chunk by chunk.
        by_chunk = [_slots_by_chunk(b, params.chunk_size) for b in batches]
        assert torch.equal(by_chunk[0][0], by_chunk[1][0])
        torch.testing.assert_close(by_chunk[1][1], by_chunk[0][1], atol=2e-2, rtol=2e-2)
        assert torch.equal(by_chunk[1][2], by_chunk[0][2])
        torch.testing.assert_close(got[0], ref[0], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got[1], ref[1], atol=1e-3, rtol=1e-3)


def test_sink_recent_baseline_attends_first_and_latest_chunks_whatever_the_query():
    h_kv, group, d, c = 2, 2, 16, 8
    lengths = [400, 260]
    rope, keys, values, pos = _batch_inputs(lengths, h_kv, group, d, seed=3)
    params = ShadowKVParams(rank=h_kv * d, chunk_size=c, sparse_budget=5 * c, outlier_chunks=0,
                            local_chunks=2, min_compress_tokens=100, selection="sink_recent")
    ids = ["a", "b"]
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    store = InMemoryValueStore()
    prompts = compress_prompts(torch.cat(keys), torch.cat(values), torch.cat(pos), cu, rope,
                               params, store, ids)
    batch = DecodeBatch.build(prompts, ids, rope, params)
    for step in range(2):
        q = torch.randn(2, 1, h_kv * group, d) * (step + 1) * 10
        decode_step(batch, q, torch.randn(2, 1, h_kv, d), torch.randn(2, 1, h_kv, d), store)
        for i, n in enumerate(lengths):
            last = n // c - params.local_chunks - 1  # the newest compressed chunk
            want = {0, last - 3, last - 2, last - 1, last}
            for h in range(h_kv):
                assert set(batch.slot_chunks[i, h].tolist()) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernels, streams)")
def test_cuda_decode_from_pinned_store_matches_cpu():
    """The CUDA path end to end: compiled kernels, values gathered from a pinned CpuValueStore
    and copied on the copy stream while the keys are rebuilt."""
    from vllm_shadowkv.core import transfer
    from vllm_shadowkv.store import CpuValueStore

    h_kv, group, d, c = 2, 4, 128, 8
    lengths = [1300, 700]
    rope, keys, values, pos = _batch_inputs(lengths, h_kv, group, d, seed=11)
    params = ShadowKVParams(rank=64, chunk_size=c, sparse_budget=128, outlier_chunks=3,
                            local_chunks=2, min_compress_tokens=100)
    ids = ["a", "b"]
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    runs = {}
    for device in ("cpu", "cuda"):
        store = CpuValueStore(1 << 26, torch.bfloat16, (c, d), pin_memory=device == "cuda")
        args = [torch.cat(t).to(device) for t in (keys, values, pos)]
        args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
        prompts = compress_prompts(*args, cu, rope.to(device), params, store, ids)
        runs[device] = (DecodeBatch.build(prompts, ids, rope, params), store)
    torch.manual_seed(0)
    for step in range(3):
        q = torch.randn(2, 1, h_kv * group, d).bfloat16()
        k_new, v_new = torch.randn(2, 1, h_kv, d).bfloat16(), torch.randn(2, 1, h_kv, d).bfloat16()
        outs = {dev: decode_step(b, *(t.to(dev) for t in (q, k_new, v_new)), store)
                for dev, (b, store) in runs.items()}
        torch.testing.assert_close(outs["cuda"][0].cpu(), outs["cpu"][0], atol=3e-2, rtol=3e-2)
    assert torch.device("cuda", torch.cuda.current_device()) in transfer._copy_streams
    assert runs["cuda"][1].bytes_fetched > 0
