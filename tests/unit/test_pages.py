"""The engine's page layout and ShadowKV's pages, through the method's hooks, without vLLM."""

import dataclasses

import pytest
import torch

from vllm_shadowkv.backend.exact_attention import causal_attention, read_exact, write_exact
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.backend.worker_state import RequestStats
from vllm_shadowkv.core.attention import attention_with_lse
from vllm_shadowkv.core import ops
from vllm_shadowkv.core.compress import compress_prompt
from vllm_shadowkv.core.decode import DecodeBatch, decode_step
from vllm_shadowkv.core.rope import apply_rope
from vllm_shadowkv.core.store import InMemoryValueStore
from vllm_shadowkv.methods.base import KVShapes, RequestRows
from vllm_shadowkv.methods.shadowkv import ShadowKVMethod, ShadowKVSettings

from pages_util import SETTINGS, context, make_layout, pages_for, rope_for, write_step


def test_llama8b_shapes_compress_7x_per_token():
    layout = make_layout(8, 128, 128, ShadowKVSettings(), torch.bfloat16)
    assert layout.method.settings.rank == 160  # the paper's rank at its key width (1024)
    assert layout.page_bytes == 128 * (160 + 128) * 2  # A row + landmark share: 576 B/token
    assert layout.exact_token_bytes == 4096 and layout.exact_per_page == 18
    assert layout.exact_token_bytes * 128 / layout.page_bytes > 7
    # A 128K prompt after compression vs the same prompt held exactly (vLLM's default page):
    steady = layout.steady_blocks(131072) * layout.page_bytes
    assert 131072 * layout.exact_token_bytes / steady > 6


def test_phases_of_a_sparse_request():
    layout = make_layout()
    p = 1000
    assert layout.is_sparse(p) and not layout.is_sparse(255)
    pages = layout.method.pages
    stage, packed, state = layout.exact_blocks(p), pages.packed_blocks(p), pages.state_blocks(p)
    assert layout.region_blocks(p) == packed + state
    assert layout.blocks_needed(p, 500) == layout.exact_blocks(500)  # still prefilling
    assert layout.blocks_needed(p, p) == stage + packed + state  # compression step
    assert layout.blocks_needed(p, p + 1) == stage + packed + state + 1
    assert layout.steady_blocks(p) == packed + state
    # Generated tokens go after the region, prompt tokens to the staging pages.
    ids = torch.arange(layout.blocks_needed(p, p + 2 * layout.exact_per_page))
    slot = lambda prompt_len, pos: tuple(  # noqa: E731
        int(t) for t in layout.exact_token_slots(prompt_len, ids, torch.tensor([pos])))
    assert slot(p, p + layout.exact_per_page) == (stage + packed + state + 1, 0)
    assert slot(p, 5) == (0, 5)
    assert slot(100, 100) == divmod(100, layout.exact_per_page)  # exact request


def test_exact_tokens_round_trip_through_permuted_pages():
    g = torch.Generator().manual_seed(0)
    layout = make_layout()
    p, total = 700, 760
    cache, block_ids = pages_for(layout, p, total, g)
    positions = torch.arange(total)
    k, v = torch.randn(total, 2, 32, generator=g), torch.randn(total, 2, 32, generator=g)
    blocks, slots = layout.exact_token_slots(p, block_ids, positions)
    write_exact(cache, layout, blocks, slots, k, v)
    k2, v2 = read_exact(cache, layout, p, block_ids, positions)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert len(set(zip(blocks.tolist(), slots.tolist()))) == total  # no two tokens share a slot


# (block size, rank) -> whether the CPU step refills the slots in place. At rank 64 a token
# takes 72 elements: 32-token pages hold 72 state rows of 32 (whole chunks of 8), 40-token
# pages 90 (some chunks straddle two pages: refilled row by row all the same); at rank 61
# 16-token pages hold 34.5 rows, which do not tile the pages: the slots are copied out and back.
LAYOUTS = {(32, 64): True, (40, 64): True, (16, 61): False}


def _layout_case(block_size, rank, settings):
    return make_layout(block_size=block_size, settings=dataclasses.replace(settings, rank=rank))


@pytest.mark.parametrize("block_size, rank", LAYOUTS)
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("ratio", [None, 0.1])
def test_compress_then_sparse_decode_from_pages(full, block_size, rank, ratio):
    """The paged path is the core's decode: with state kept in pages between steps it matches
    ``DecodeBatch``/``decode_step`` step by step, with the slots refilled in place or copied;
    with full rank and a budget covering the context both are dense attention."""
    g = torch.Generator().manual_seed(1)
    h, hq, d, p, gen = 2, 8, 32, 600, 3
    settings = SETTINGS if not full else ShadowKVSettings(
        rank=h * d, sparse_budget=1024, outlier_chunks=4, local_window=16, min_sparse_len=256)
    if ratio is not None:  # a share of the prompt, or all of it (covering); outliers too
        settings = dataclasses.replace(settings, sparse_budget_ratio=1.0 if full else ratio,
                                       outlier_ratio=1.0 if full else ratio / 10)
    layout = _layout_case(block_size, rank, settings)
    assert layout.method.pages.slots_in_place == LAYOUTS[block_size, rank]
    method = layout.method
    rope = rope_for()
    total = p + gen
    cache, block_ids = pages_for(layout, p, total, g)
    positions = torch.arange(total)
    k = apply_rope(torch.randn(total, h, d, generator=g), positions, rope)
    v = torch.randn(total, h, d, generator=g)
    blocks, slots = layout.exact_token_slots(p, block_ids, positions)
    write_exact(cache, layout, blocks, slots, k, v)
    stats = RequestStats()
    ctx = context(cache, layout, rope, InMemoryValueStore(), stats)
    method.finalize(ctx, RequestRows("req", p, p, 0, 0, block_ids), k[:p], v[:p])
    core_store = InMemoryValueStore()
    prompt = compress_prompt(k[:p], v[:p], positions[:p], rope, method.params, core_store,
                             ("req", 0))
    batch = DecodeBatch.build([prompt], [("req", 0)], rope, method.params)
    for step in range(gen):
        seq_len = p + step + 1
        q = torch.randn(1, hq, d, generator=g)
        new_k, new_v = k[seq_len - 1: seq_len], v[seq_len - 1: seq_len]
        out = torch.zeros_like(q)
        method.decode(ctx, [RequestRows("req", p, seq_len, 0, 1, block_ids)], q, new_k, new_v,
                      out)
        core_out, _ = decode_step(batch, q[None], new_k[None], new_v[None], core_store, d ** -0.5)
        torch.testing.assert_close(out, core_out[0], atol=1e-5, rtol=1e-5)
        if full and rank == h * d:
            dense, _ = attention_with_lse(q[None], k[:seq_len].transpose(0, 1)[None],
                                          v[:seq_len].transpose(0, 1)[None], None, d ** -0.5)
            torch.testing.assert_close(out, dense[0], atol=1e-4, rtol=1e-4)
    assert stats.decode_steps == gen and stats.hits > 0  # the slots persisted between steps


# Budgets of 5 % of each prompt: 3, 6 and 4 chunks for the prompts of 600, 1000 and 777 tokens
# below, so a batch of them pads the smaller budgets' slots; with outliers of 3 % of each
# prompt also their outliers (2, 4 and 3 chunks).
RATIO = dataclasses.replace(SETTINGS, sparse_budget_ratio=0.05)
RATIOS = dataclasses.replace(RATIO, outlier_ratio=0.03)
# No outliers and no local window: the prompts of whole chunks (600, 1000) have no exact region.
NO_EXACT = dataclasses.replace(SETTINGS, outlier_chunks=0, local_window=0)


@pytest.mark.parametrize("block_size, rank", LAYOUTS)
@pytest.mark.parametrize("settings", [SETTINGS, RATIO, RATIOS, NO_EXACT],
                         ids=["budget", "ratio", "ratio+outliers", "no exact region"])
def test_batched_decode_equals_each_request_alone(block_size, rank, settings):
    """One ``decode`` call for a ragged batch (different prompt lengths and generated counts,
    one request with two query rows, one finishing mid-way) gives every request exactly what
    it gets decoded alone in its own pages, and leaves the same page contents behind; the
    same with the slots refilled in place and copied out and back, with a budget per prompt
    (``sparse_budget_ratio``: each request owns its own number of slots), outliers per
    prompt (``outlier_ratio``), and requests without an exact region beside one with it."""
    g = torch.Generator().manual_seed(4)
    h, hq, d, steps = 2, 8, 32, 4
    prompts = {"a": 600, "b": 1000, "c": 777}
    layout = _layout_case(block_size, rank, settings)
    owned = {r: layout.method.pages.state(p).num_slots for r, p in prompts.items()}
    outliers = {r: layout.method.pages.state(p).num_outliers for r, p in prompts.items()}
    assert owned == ({"a": 3, "b": 6, "c": 4} if settings.sparse_budget_ratio
                     else dict.fromkeys(prompts, 8))
    assert outliers == ({"a": 2, "b": 4, "c": 3} if settings.outlier_ratio
                        else dict.fromkeys(prompts, settings.outlier_chunks))
    exact = {r: layout.method.pages.state(p).exact_tokens for r, p in prompts.items()}
    if settings is NO_EXACT:
        assert exact == {"a": 0, "b": 0, "c": 1}
    assert layout.method.pages.slots_in_place == LAYOUTS[block_size, rank]
    method, rope = layout.method, rope_for()
    lengths = {r: p + 2 * steps for r, p in prompts.items()}
    needed = {r: layout.blocks_needed(p, lengths[r]) for r, p in prompts.items()}
    cache = torch.zeros(sum(needed.values()) + 3, 1, layout.block_size,
                        layout.page_bytes // layout.block_size // 4)
    ids = (torch.randperm(len(cache) - 1, generator=g) + 1).split(list(needed.values()) + [2])
    blocks = dict(zip(prompts, ids))
    kv = {r: (apply_rope(torch.randn(n, h, d, generator=g), torch.arange(n), rope),
              torch.randn(n, h, d, generator=g)) for r, n in lengths.items()}
    for r, p in prompts.items():
        k, v = kv[r]
        write_exact(cache, layout, *layout.exact_token_slots(p, blocks[r], torch.arange(p)),
                    k[:p], v[:p])
    runs = {}
    for mode in ("batched", "alone"):
        pages, store = cache.clone(), InMemoryValueStore()
        ctx = context(pages, layout, rope, store, RequestStats())
        for r, p in prompts.items():
            k, v = kv[r]
            method.finalize(ctx, RequestRows(r, p, p, 0, 0, blocks[r]), k[:p], v[:p])
        runs[mode] = (pages, store, ctx, {r: [] for r in prompts})
    gq = torch.Generator().manual_seed(5)
    seq = dict(prompts)
    for step in range(steps):
        live = [r for r in prompts if not (r == "b" and step >= 2)]  # b finishes after 2 steps
        rows = {r: 2 if r == "c" else 1 for r in live}
        q = {r: torch.randn(n, hq, d, generator=gq) for r, n in rows.items()}
        for mode, (pages, store, ctx, outs) in runs.items():
            reqs, key, value = write_step(pages, layout, prompts, blocks, kv, seq, rows)
            query = torch.cat([q[r] for r in live])
            out = torch.zeros_like(query)
            groups = [reqs] if mode == "batched" else [[req] for req in reqs]
            for group in groups:
                method.decode(ctx, group, query, key, value, out)
            for req in reqs:
                outs[req.req_id].append(out[req.start: req.end])
        if step == 1:
            method.release("b")
        for r in live:
            seq[r] += rows[r]
    (pages_a, _, _, outs_a), (pages_b, _, _, outs_b) = runs["batched"], runs["alone"]
    for r in prompts:
        for got, want in zip(outs_a[r], outs_b[r]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(outs_a["b"]) == 2 and len(outs_a["c"]) == steps
    torch.testing.assert_close(pages_a, pages_b, atol=1e-5, rtol=1e-5, equal_nan=True)  # ids -1


@pytest.mark.parametrize("q_len, s_len", [(1, 7), (5, 5), (3, 9), (64, 64), (17, 100)])
def test_causal_attention_matches_masked_sdpa(q_len, s_len):
    """Decode, whole-prompt prefill (is_causal path) and later chunks (explicit mask)."""
    g = torch.Generator().manual_seed(q_len * 1000 + s_len)
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((q_len, 8), (s_len, 2), (s_len, 2)))
    mask = torch.arange(s_len)[None] <= torch.arange(s_len - q_len, s_len)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        enable_gqa=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(causal_attention(q, k, v, 0.25), ref)


@pytest.mark.parametrize("q_len, s_len, h_q, h_kv, d", [
    (1, 777, 8, 2, 64), (300, 300, 9, 3, 64), (129, 1000, 32, 8, 128), (5, 5, 4, 1, 96)])
def test_vllm_cpu_kernel_path_matches_masked_sdpa(q_len, s_len, h_q, h_kv, d):
    """16-bit inputs at head sizes vLLM's CPU kernel takes go through it (prefill, a later
    chunk, dense decode) where the C kernel does not apply, against SDPA in fp32."""
    from vllm_shadowkv.backend.exact_attention import _vllm_cpu_attention

    g = torch.Generator().manual_seed(q_len + s_len + d)
    q, k, v = (torch.randn(n, h, d, generator=g).bfloat16()
               for n, h in ((q_len, h_q), (s_len, h_kv), (s_len, h_kv)))
    mask = torch.arange(s_len)[None] <= torch.arange(s_len - q_len, s_len)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, enable_gqa=True, scale=d ** -0.5).transpose(0, 1)
    direct = _vllm_cpu_attention(q, k, v, d ** -0.5)
    assert direct is not None  # the kernel took these shapes
    torch.testing.assert_close(direct.float(), ref, atol=2e-2, rtol=2e-2)
    with ops.kernel_mode("torch"):  # ("auto" runs the C kernel where it applies)
        torch.testing.assert_close(causal_attention(q, k, v, d ** -0.5), direct, atol=0, rtol=0)


def test_vllm_cpu_kernel_as_a_process_first_16_bit_work():
    """vLLM's CPU kernel runs AMX tiles where the CPU has them, which Linux grants a process
    only once asked: as the first 16-bit work of a fresh process (no oneDNN GEMM before it to
    ask) it died with SIGILL on an AMX machine. Passes trivially on CPUs without AMX."""
    import subprocess
    import sys

    script = ("import torch\n"
              "from vllm_shadowkv.backend.exact_attention import _vllm_cpu_attention\n"
              "q, k, v = (torch.randn(n, h, 128).bfloat16() for n, h in "
              "((4, 8), (40, 2), (40, 2)))\n"
              "print(_vllm_cpu_attention(q, k, v, 0.1) is not None)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_sparse_decode_on_cuda_matches_cpu():
    """The backend's per-request path as the engine runs it on a GPU (pages in device memory,
    compiled kernels, values in a pinned CpuValueStore fetched on the copy stream) against the
    same path on the CPU, at a budget below the context."""
    from vllm_shadowkv.store import CpuValueStore

    h, hq, d, p, gen = 2, 8, 64, 1500, 4
    settings = ShadowKVSettings(rank=96, sparse_budget=128, outlier_chunks=4, local_window=16,
                                min_sparse_len=256)
    layout = make_layout(h=h, d=d, settings=settings, dtype=torch.bfloat16)
    method = layout.method
    g = torch.Generator().manual_seed(3)
    cache, block_ids = pages_for(layout, p, p + gen, g)
    positions = torch.arange(p + gen)
    rope = rope_for(d)
    k = apply_rope(torch.randn(p + gen, h, d, generator=g), positions, rope).bfloat16()
    v = torch.randn(p + gen, h, d, generator=g).bfloat16()
    queries = torch.randn(gen, 1, hq, d, generator=g).bfloat16()
    outs = {}
    for device in ("cpu", "cuda"):
        dev_cache, dev_blocks = cache.clone().to(device), block_ids.to(device)
        store = CpuValueStore(1 << 26, torch.bfloat16, (settings.chunk_size, d),
                              pin_memory=device == "cuda")
        blocks, slots = layout.exact_token_slots(p, dev_blocks, positions.to(device))
        write_exact(dev_cache, layout, blocks, slots, k.to(device), v.to(device))
        ctx = context(dev_cache, layout, rope.to(device), store, RequestStats())
        req_id = f"r-{device}"  # the method caches each request's plan (on its device)
        method.finalize(ctx, RequestRows(req_id, p, p, 0, 0, dev_blocks), k[:p].to(device),
                        v[:p].to(device))
        outs[device] = []
        for i in range(gen):
            out = torch.zeros(1, hq, d, dtype=torch.bfloat16, device=device)
            method.decode(ctx, [RequestRows(req_id, p, p + i + 1, 0, 1, dev_blocks)],
                          queries[i].to(device), k[p + i: p + i + 1].to(device),
                          v[p + i: p + i + 1].to(device), out)
            outs[device].append(out.cpu())
    for got, ref in zip(outs["cuda"], outs["cpu"]):
        torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("rank", [62, 61])  # state rows tile a 16-token page, or do not
def test_state_rows_write_where_they_read(rank):
    """``write_rows`` puts each row where ``read_rows`` finds it and touches nothing else, both
    through the flat row index (rows tile the pages) and by (page, row in page)."""
    g = torch.Generator().manual_seed(rank)
    layout = make_layout(block_size=16, settings=ShadowKVSettings(
        rank=rank, sparse_budget=64, outlier_chunks=4, local_window=16, min_sparse_len=256))
    pages = layout.method.pages
    page_elems = pages.page_bytes // layout.shapes.elem_bytes
    assert (page_elems == pages.rows_per_page * 32) == (rank == 62)
    p = 1000
    cache, block_ids = pages_for(layout, p, p + 1, g)
    plan = pages.plan(p, layout.region_ids(p, block_ids))
    offsets = torch.cat([plan.slot_v, plan.b])[torch.randperm(plan.b.numel(), generator=g)]
    rows = torch.randn(offsets.numel(), 32, generator=g)
    before = cache.clone()
    pages.write_rows(cache, offsets, rows)
    torch.testing.assert_close(pages.read_rows(cache, offsets), rows, rtol=0, atol=0)
    changed = (cache != before).view(-1).nonzero().flatten()
    written = (offsets.unsqueeze(1) + torch.arange(32)).flatten()
    assert set(changed.tolist()) <= set(written.tolist())


def test_layers_with_different_pages_share_one_block_table():
    """Per-layer policy: a method whose layers keep different amounts (``token_bytes`` per
    layer) gets one spec per layer; vLLM groups them under one block table
    (``UniformTypeKVCacheSpecs``) as long as their block counts agree, which the engine's layout
    guarantees (the counts are the method's, the same for every layer)."""
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from vllm_shadowkv import plugin
    from vllm_shadowkv.backend.kv_spec import CompressedKVSpec
    from vllm_shadowkv.config import Stamp
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    plugin.register()
    stamp = Stamp("shadowkv", SETTINGS.resolved(make_layout().shapes), 1 << 30)
    base = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    spec = CompressedKVSpec.for_layer(base, stamp, 0, max_model_len=4096, num_layers=2)
    wider = replace(spec, state_content_bytes=2 * spec.state_content_bytes)
    group = UniformTypeKVCacheSpecs.from_specs({"layers.0.attn": spec, "layers.1.attn": wider})
    assert group is not None
    assert group.page_size_bytes == spec.page_size_bytes + wider.page_size_bytes
    assert group.max_num_blocks_per_req(None, 4096) == spec.max_num_blocks_per_req(None, 4096)


def test_a_generated_token_ring_and_growth_pages():
    """A method that folds generated tokens (a quantized format) keeps the last ``ring`` exact,
    in a ring after its region, and grows pages after the ring as groups are folded."""

    class FoldingMethod(ShadowKVMethod):
        generated_ring = 16

        def growth_blocks(self, prompt_len, num_generated):
            return num_generated // self.generated_ring  # one page per folded group

    shapes = KVShapes(2, 32, torch.float32, 32, num_layers=1, max_model_len=4096)
    layout = PageLayout(FoldingMethod(SETTINGS.resolved(shapes), shapes))
    p = 1000
    base = layout.exact_blocks(p) + layout.region_blocks(p)
    ring_pages = layout.exact_blocks(16)
    assert layout.blocks_needed(p, p + 5) == base + layout.exact_blocks(5)
    assert layout.blocks_needed(p, p + 16) == base + ring_pages + 1  # full ring: one group
    assert layout.blocks_needed(p, p + 40) == base + ring_pages + 2
    ids = torch.arange(layout.blocks_needed(p, p + 40))
    blocks, slots = layout.exact_token_slots(p, ids, torch.tensor([p, p + 16, p + 17]))
    assert blocks[0] == blocks[1] == base and slots[0] == slots[1] == 0  # the ring wraps
    assert slots[2] == 1
    assert layout.growth_ids(p, 40, ids).tolist() == [base + ring_pages, base + ring_pages + 1]
