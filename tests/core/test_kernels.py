"""Every Triton kernel (interpreted on the CPU, see conftest.py), every compiled CPU kernel
(core/cpu_kernels.py) and every C kernel (core/native.py) against its torch reference: ragged
lengths (including empty requests), GQA groups 1/4/8, head_dim 64/128, bf16/fp32,
non-contiguous inputs, fresh random inputs each test."""

import os
import subprocess
import sys

import pytest
import torch

from vllm_shadowkv.core import (attention, cpu_kernels, heavy_hitters, landmarks, native, ops,
                                reconstruct, select)
from vllm_shadowkv.core import rope as rope_ops
from vllm_shadowkv.core.rope import RopeCache
from vllm_shadowkv.triton_kernels import (heavy_hitter_kernels, prefill_kernels, rebuild_kernels,
                                          select_kernels)

from core_rope_util import default_rope
from torch_threads import torch_threads

GRID = [(g, d, dt) for g in (1, 4, 8) for d in (64, 128) for dt in (torch.float32, torch.bfloat16)]
COUNTS = [37, 300, 0, 129]  # irregular, one request without landmarks


# per implementation: the modules of the landmark scores, the key rebuild, the value scatter
KERNELS = {"triton": (select_kernels, rebuild_kernels, rebuild_kernels),
           "cpu": (native, native, cpu_kernels)}
needs_native = pytest.mark.skipif(native.library() is None, reason="the C kernels need a compiler")


def _kernels(impl, device):
    if impl == "cpu" and (device.type != "cpu" or not cpu_kernels.available()
                          or native.library() is None):
        pytest.skip("CPU kernels: CPU tensors and a C/C++ compiler")
    return KERNELS[impl]


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _ragged_pool(counts, h_kv, width, dtype, device, gap=3):
    """Pool [NL, h_kv, width] (non-contiguous) with per-request starts, gaps between requests."""
    starts, pos = [], 0
    for n in counts:
        starts.append(pos)
        pos += n + gap
    pool = torch.randn(width, pos, h_kv, dtype=torch.float32, device=device).to(dtype).permute(1, 2, 0)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return pool, as_i32(starts), as_i32(counts)


@pytest.mark.parametrize("impl", list(KERNELS))
@pytest.mark.parametrize("group,head_dim,dtype", GRID)
def test_landmark_scores(group, head_dim, dtype, impl, kernel_device):
    h_kv, s_q = 2, 2
    landmarks, starts, counts = _ragged_pool(COUNTS, h_kv, head_dim, dtype, kernel_device)
    q = torch.randn(len(COUNTS), h_kv * group, s_q, head_dim, device=kernel_device).to(dtype)
    q = q.transpose(1, 2)  # [B, s_q, h_q, d], non-contiguous
    scale = head_dim ** -0.5
    # The pool's rows shuffled among the landmark rows (pages in the engine).
    rows = torch.randperm(landmarks.shape[0], device=kernel_device)
    scoring = _kernels(impl, kernel_device)[0]
    got = scoring.landmark_scores(q, landmarks, rows, starts, counts, max(COUNTS), scale)
    want = select.landmark_scores(q, landmarks, rows, starts, counts, max(COUNTS), scale)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("q_dtype,dtype", [(torch.bfloat16, torch.bfloat16),
                                           (torch.float32, torch.float32),
                                           (torch.float16, torch.float16),
                                           (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("group,head_dim,s_q", [(4, 128, 1), (8, 64, 2), (1, 96, 3), (3, 80, 1)])
def test_landmark_scores_read_the_pages_in_place(q_dtype, dtype, group, head_dim, s_q):
    """The C kernel reads the landmark rows where they lie in the pages, as the engine lays them
    out (each page: A rows, then 16 landmark rows at one stride, the blocks AMX multiplies):
    requests over whole pages, pages out of order, a partly filled last page, a single row,
    and rows in no page pattern; the rows no request owns are NaN and must not be read."""
    h_kv, per_page, a_elems = 2, 16, 40
    row = h_kv * head_dim + 8  # a landmark row's heads, then padding
    page = a_elems + per_page * row
    flat = torch.full((64 * page,), float("nan")).to(dtype)
    landmarks = torch.as_strided(flat, (flat.numel() - row + 1, h_kv, head_dim), (1, head_dim, 1))

    def rows_in(pages, count):
        ids = torch.tensor(pages, dtype=torch.long)
        lm = torch.arange(count)
        return ids[lm // per_page] * page + a_elems + lm % per_page * row

    requests = [rows_in([4, 5, 6, 7], 64), rows_in([10, 11, 20, 21, 22, 3], 90),
                rows_in([30], 1), rows_in([40, 41, 42], 40), torch.randperm(60)[:19] * page,
                rows_in([50, 49, 48], 37), rows_in([], 0)]
    lm_rows = torch.cat(requests)
    for r in lm_rows.tolist():
        flat[r: r + h_kv * head_dim] = torch.randn(h_kv * head_dim).to(dtype)
    counts = torch.tensor([len(r) for r in requests], dtype=torch.int32)
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    q = torch.randn(len(requests), s_q, h_kv * group, head_dim).to(q_dtype)
    args = q, landmarks, lm_rows, starts, counts, int(counts.max()), head_dim ** -0.5
    assert native.supports_scores(q, landmarks)
    got = native.landmark_scores(*args)
    torch.testing.assert_close(got, select.landmark_scores(*args), atol=1e-6, rtol=1e-5)


def test_native_library_is_optional(monkeypatch, caplog):
    """Without a C compiler (or with SHADOWKV_NATIVE=0) there is no library, a warning says why,
    and the scores come from the torch reference."""
    landmarks, _, _ = _ragged_pool([5], 1, 64, torch.float32, "cpu")
    q = torch.randn(1, 1, 4, 64)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(native.shutil, "which", lambda _: None)
            native.library.cache_clear()
            assert native.library() is None and "no C compiler" in caplog.text
            assert not native.supports_scores(q, landmarks)
        with monkeypatch.context() as patch:
            patch.setenv("SHADOWKV_NATIVE", "0")
            native.library.cache_clear()
            assert native.library() is None and not native.supports_scores(q, landmarks)
    finally:
        native.library.cache_clear()


_BUILD_SCRIPT = """
import os, sys
import torch
from vllm_shadowkv.core import native
lib = native.library()
assert lib is not None
# the process's floating-point mode is its own: subnormals survive the library's load
assert (torch.tensor([1e-40]) * 1.0).item() > 0, "loading the library turned on flush-to-zero"
print(sorted(os.listdir(native._cache_dir())))
"""


@needs_native
def test_native_library_is_built_once_per_cache(tmp_path):
    """The first process builds the library into the cache; the next loads the same file.
    Neither changes its floating-point mode (no flush-to-zero from -ffast-math's start file)."""
    env = dict(os.environ, SHADOWKV_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", _BUILD_SCRIPT], env=env, check=True,
                           capture_output=True, text=True, timeout=300).stdout for _ in range(2)]
    assert runs[0] == runs[1] and ".so" in runs[0]
    assert list((tmp_path / "native").glob("*.so"))


def _check_selection(got, scores, counts, k, owned=None):
    for b, n in enumerate(counts.tolist()):
        take = min(k, n, k if owned is None else int(owned[b]))
        assert (got[b, :, take:] == -1).all()
        for h in range(got.shape[1]):
            ids = got[b, h, :take].long()
            assert len(set(ids.tolist())) == take and (ids >= 0).all() and (ids < n).all()
            best = torch.topk(scores[b, h, :n], take).values
            torch.testing.assert_close(scores[b, h, ids].sort().values, best.sort().values)


def _owned_slots(k: int, device) -> torch.Tensor:
    """Each request's own slots of k (its budget, as with ``sparse_budget_ratio``): 1 to k."""
    return torch.randint(1, k + 1, (len(COUNTS),), dtype=torch.int32, device=device)


@pytest.mark.parametrize("k", [1, 16, 64])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("owned", [False, True])
def test_select_chunks(k, ties, owned, kernel_device):
    h_kv, max_n = 3, max(COUNTS)
    own = _owned_slots(k, kernel_device) if owned else None
    counts = torch.tensor(COUNTS, dtype=torch.int32, device=kernel_device)
    starts = torch.arange(len(COUNTS), dtype=torch.int32, device=kernel_device) * max_n
    if ties:  # many equal scores (softmax underflow gives exact zeros in long contexts)
        scores = torch.randint(0, 3, (len(COUNTS), max_n, h_kv), device=kernel_device).float() / 4
    else:
        scores = torch.rand(len(COUNTS), max_n, h_kv, device=kernel_device)
    scores = scores.transpose(1, 2)  # [B, h_kv, N], non-contiguous
    scores = torch.where(torch.arange(max_n, device=kernel_device) < counts.view(-1, 1, 1),
                         scores, -1.0)
    # Chunk id = landmark index within its request, so ids index `scores` directly.
    chunks = (torch.arange(max_n, device=kernel_device).repeat(len(COUNTS)).view(-1, 1)
              .expand(-1, h_kv).to(torch.int32))
    got = select_kernels.select_chunks(scores, chunks, starts, counts, k, own)
    want = select.select_chunks(scores, chunks, starts, counts, k, own)
    _check_selection(got, scores, counts, k, own)
    _check_selection(want, scores, counts, k, own)


@needs_native
@pytest.mark.parametrize("k", [1, 16, 64, 300])
@pytest.mark.parametrize("owned", [False, True])
def test_select_slots(k, owned):
    """The C selection and slot assignment against select_chunks + assign_slots, and the C
    listing of the misses against list_misses, over a few steps of drifting scores (hits kept
    in place, misses in order of score into the freed slots, evicted slots emptied): ragged
    landmark counts, one request with none, chunk ids that are not the landmark indices;
    distinct scores, so the top-k is one set. With ``owned``, each request owns its first
    1..k slots (a budget per request) and its padding slots after them stay empty."""
    h_kv, max_n = 3, max(COUNTS)
    own = _owned_slots(k, "cpu") if owned else None
    owned_k = torch.full((len(COUNTS),), k) if own is None else own
    padding = (torch.arange(k) >= owned_k.view(-1, 1, 1)).expand(-1, h_kv, k)
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    starts = torch.tensor([0] + COUNTS[:-1], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    chunks = torch.stack([torch.randperm(3 * sum(COUNTS))[:sum(COUNTS)] for _ in range(h_kv)],
                         1).to(torch.int32)
    valid = torch.arange(max_n) < counts.view(-1, 1, 1)
    scores = torch.rand(len(COUNTS), h_kv, max_n)
    slots = torch.full((len(COUNTS), h_kv, k), -1, dtype=torch.int32)
    for _ in range(4):
        scores = torch.where(valid, scores, -1.0)
        assert native.supports_select(scores)
        got = native.select_slots(scores, chunks, starts, counts, k, slots, own)
        want = select.select_slots(scores, chunks, starts, counts, k, slots, own)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert (want[0][padding] == -1).all()
        if own is not None:
            assert torch.equal(want[2], torch.minimum(want[2], own.view(-1, 1)))
        misses = native.list_misses(*want)  # the refill plan listed, as the value fetch reads it
        for g, w in zip(misses, select.list_misses(*want)):
            assert g == w if isinstance(w, list) else torch.equal(g, w)
        slots, scores = want[0], scores + 0.3 * torch.rand_like(scores)


@needs_native
def test_select_slots_among_ties_takes_a_best_set():
    """Equal scores (softmax underflow gives exact zeros in long contexts): the selected chunks'
    scores are the k best, whichever of the equal ones they are."""
    k, h_kv, max_n = 16, 3, max(COUNTS)
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    starts = torch.arange(len(COUNTS), dtype=torch.int32) * max_n
    scores = torch.randint(0, 3, (len(COUNTS), h_kv, max_n)).float() / 4
    scores = torch.where(torch.arange(max_n) < counts.view(-1, 1, 1), scores, -1.0)
    chunks = torch.arange(max_n).repeat(len(COUNTS)).view(-1, 1).expand(-1, h_kv)
    empty = torch.full((len(COUNTS), h_kv, k), -1, dtype=torch.int32)
    slots, miss_slots, miss_count = native.select_slots(scores, chunks, starts, counts, k, empty)
    assert torch.equal(miss_count, counts.clamp(max=k).view(-1, 1).expand(-1, h_kv).int())
    filled = torch.arange(k, dtype=torch.int32) < miss_count.unsqueeze(-1)  # slots in order
    assert torch.equal(miss_slots, torch.where(filled, torch.arange(k, dtype=torch.int32), -1))
    assert torch.equal(slots >= 0, filled)
    _check_selection(slots, scores, counts, k)


def _miss_setup(batch, h_kv, k, n_chunks, device):
    """Random resident chunks (distinct per row) and a ragged miss list per (request, head)."""
    slot_chunks = torch.stack([torch.stack([torch.randperm(n_chunks[b])[:k] for _ in range(h_kv)])
                               for b in range(batch)]).to(torch.int32)
    miss_count = torch.randint(0, k + 1, (batch, h_kv), dtype=torch.int32)
    miss_count[0, 0], miss_count[-1, -1] = 0, k
    miss_slots = torch.stack([torch.stack([torch.randperm(k) for _ in range(h_kv)])
                              for _ in range(batch)]).to(torch.int32)
    miss_slots = torch.where(torch.arange(k) < miss_count.unsqueeze(-1), miss_slots, -1)
    return [t.to(device) for t in (slot_chunks, miss_slots, miss_count)]


ROPES = {"neox": dict(neox=True), "gptj": dict(neox=False), "partial": dict(rotary_frac=0.5)}


@pytest.mark.parametrize("head_dim", [64, 72, 128])  # (72: not whole AMX tiles)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_kind", list(ROPES))
@pytest.mark.parametrize("layout", ["column-major", "row-major"])
@pytest.mark.parametrize("rank", [37, 40])  # (37: the C kernels' last pair of the rank half empty)
@pytest.mark.parametrize("impl", list(KERNELS))
def test_rebuild_keys(head_dim, dtype, rope_kind, layout, rank, impl, kernel_device):
    # The GQA group does not enter this kernel (keys are per KV head).
    batch, h_kv, k, c = 3, 2, 6, 8
    n_chunks = [9, 20, 6]
    conf = ROPES[rope_kind]
    rotary = int(head_dim * conf.get("rotary_frac", 1.0))
    rope = default_rope(head_dim, 4096, rotary, neox=conf.get("neox", True))
    rope = RopeCache(rope.cos_sin_cache.to(kernel_device, dtype), rotary, rope.is_neox_style)
    a_counts = [n * c for n in n_chunks]
    pool = sum(a_counts) + 5
    # Column-major, and the pool's rows shuffled among more rows of `a` (pages in the engine).
    a = torch.randn(rank, 2 * pool, device=kernel_device).to(dtype).T
    if layout == "row-major":  # the engine's: rows of pages (unit stride along the rank)
        a = a.contiguous()
    a_rows = torch.randperm(2 * pool, device=kernel_device)[:pool]
    a_positions = torch.randint(0, 4096, (pool,), dtype=torch.int32, device=kernel_device)
    a_start = torch.tensor([0, a_counts[0] + 2, a_counts[0] + a_counts[1] + 5],
                           dtype=torch.int32, device=kernel_device)
    b = torch.randn(batch, h_kv, head_dim, rank, device=kernel_device).to(dtype).transpose(-1, -2)
    slot_chunks, miss_slots, miss_count = _miss_setup(batch, h_kv, k, n_chunks, kernel_device)
    base = torch.randn(batch, k * c, h_kv, head_dim, device=kernel_device).to(dtype).transpose(1, 2)
    if layout == "row-major":  # the engine's slots are contiguous too
        base = base.contiguous()
    got, want = base.clone(), base.clone()
    args = (a, a_rows, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, rope)
    _kernels(impl, kernel_device)[1].rebuild_keys(*args, got)
    reconstruct.rebuild_keys(*args, want)
    tol = _tol(dtype)
    torch.testing.assert_close(got, want, **tol)
    written = torch.zeros(batch, h_kv, k + 1, dtype=torch.bool, device=kernel_device)
    written.scatter_(-1, torch.where(miss_slots >= 0, miss_slots, k).long(), True)
    stale = (~written[..., :k]).repeat_interleave(c, dim=-1)
    assert torch.equal(got[stale], base[stale])  # slots that did not miss are left alone
    if impl != "cpu":
        return
    # The engine's CPU step: slots are rows of the pages, anywhere ([N, d], slot_index
    # [B, h, k, c]: a chunk's rows need not follow each other, as where it straddles two pages).
    n_rows = 2 * batch * h_kv * k * c
    slot_index = torch.randperm(n_rows)[:batch * h_kv * k * c].view(batch, h_kv, k, c)
    pages = torch.randn(n_rows, head_dim).to(dtype)
    pages[slot_index] = base.unflatten(2, (k, c))
    got_pages, want_pages = pages.clone(), pages.clone()
    native.rebuild_keys(*args, got_pages, slot_index)
    reconstruct.rebuild_keys(*args, want_pages, slot_index)
    torch.testing.assert_close(got_pages, want_pages, **tol)
    torch.testing.assert_close(got_pages[slot_index], got.unflatten(2, (k, c)), **tol)
    others = torch.ones(len(pages), dtype=torch.bool)
    others[slot_index.flatten()] = False
    assert torch.equal(got_pages[others], pages[others])  # no other row written


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float32), (128, torch.bfloat16)])
@pytest.mark.parametrize("slots", ["contiguous", "strided"])
@pytest.mark.parametrize("impl", list(KERNELS))
@pytest.mark.parametrize("staged", ["packed", "spaced"])  # the decode step's, or a spare row each
def test_scatter_values(head_dim, dtype, slots, impl, staged, kernel_device):
    batch, h_kv, k, c = 3, 4, 7, 8
    _, miss_slots, miss_count = _miss_setup(batch, h_kv, k, [k, k, k], kernel_device)
    flat = miss_count.flatten()
    spare = int(staged == "spaced")
    staging_start = (flat.cumsum(0) - flat + spare * torch.arange(1, len(flat) + 1,
                                                                  device=kernel_device))
    staging_start = staging_start.view_as(miss_count).to(torch.int32)
    rows = int(flat.sum()) + spare * len(flat)
    staging = torch.randn(head_dim, rows, c, device=kernel_device).to(dtype).permute(1, 2, 0)
    base = torch.randn(batch, h_kv, k * c, head_dim, device=kernel_device).to(dtype)
    if slots == "strided":
        base = base.transpose(0, 1).contiguous().transpose(0, 1)
    got, want = base.clone(), base.clone()
    _kernels(impl, kernel_device)[2].scatter_values(staging, staging_start, miss_slots,
                                                    miss_count, got)
    reconstruct.scatter_values(staging, staging_start, miss_slots, miss_count, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", [0, 1, 2, 301])
@pytest.mark.parametrize("width,src_dtype,dst_dtype", [(64, torch.float32, torch.float32),
                                                       (128, torch.float32, torch.bfloat16),
                                                       (72, torch.bfloat16, torch.float16),
                                                       (1024, torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("gathered", [False, True])
def test_copy_rows(n, width, src_dtype, dst_dtype, gathered):
    """The C row scatter against index_copy_: rows in any order, a gather of the source rows or
    none, a dtype conversion; dst a view at an offset into a larger buffer (as a layer's pages
    are), nothing outside the written rows touched."""
    _kernels("cpu", torch.device("cpu"))
    buffer = torch.randn(3, 517 * width).to(dst_dtype)
    index = torch.randperm(517)[:n]
    src = torch.randn(n + 9 * gathered, width).to(src_dtype)
    src_index = torch.randperm(n + 9)[:n] if gathered else None
    got, want = buffer.clone(), buffer.clone()
    assert native.supports_copy(got[1].view(517, width), src)
    native.copy_rows(got[1].view(517, width), index, src, src_index)
    reconstruct.copy_rows(want[1].view(517, width), index, src, src_index)
    assert torch.equal(got, want)
    rows = src if src_index is None else src[src_index]
    assert torch.equal(want[1].view(517, width)[index], rows.to(dst_dtype))


def _decode_rows(batch, h_kv, s_q, exact_width, k, c, gen_width, n_rows):
    """Row ids of a decode step's attended keys or values [B, h_kv, E + k*c + G + s_q], the
    step's masks at random, and every masked row pointed at a NaN row (``n_rows`` on)."""
    width = exact_width + k * c + gen_width + s_q
    ids = torch.randperm(n_rows)[:batch * h_kv * width].view(batch, h_kv, width)
    exact_len = torch.randint(0, exact_width + 1, (batch,))
    slot_chunks = torch.randint(-1, 50, (batch, h_kv, k), dtype=torch.int32)
    gen_before = torch.randint(0, gen_width + 1, (batch,))
    col = torch.arange(width)
    gen = col - exact_width - k * c
    masked = torch.where(col < exact_width, col.view(1, 1, -1) >= exact_len.view(-1, 1, 1),
                         gen.view(1, 1, -1) >= gen_before.view(-1, 1, 1) + s_q)
    in_slots = (col >= exact_width) & (gen < 0)
    slot_of = ((col - exact_width) // c).clamp(0, max(k - 1, 0))
    if k:
        empty = (slot_chunks < 0).gather(-1, slot_of.expand(batch, h_kv, -1))
        masked = torch.where(in_slots, empty, masked)
    return ids.masked_fill(masked, n_rows), exact_len, slot_chunks, gen_before


@needs_native
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (8, 72), (4, 96)])
@pytest.mark.parametrize("q_dtype,dtype", [(torch.bfloat16, torch.bfloat16),
                                           (torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("s_q", [1, 3])
def test_decode_attention(group, head_dim, q_dtype, dtype, s_q):
    """The C attention over rows in place against the reference (one gather, the masks, the
    fused kernel): ragged exact lengths, empty slots, ragged generated tokens with the step's
    causal ones, and NaN in every row no visible key or value lies in."""
    batch, h_kv, exact_width, k, c, gen_width, n_rows = 3, 2, 11, 5, 8, 6, 4000
    k_rows, exact_len, slot_chunks, gen_before = _decode_rows(
        batch, h_kv, s_q, exact_width, k, c, gen_width, n_rows)
    v_rows, *_ = _decode_rows(batch, h_kv, s_q, exact_width, k, c, gen_width, n_rows)
    v_rows = torch.where(k_rows == n_rows, n_rows, v_rows.clamp(max=n_rows - 1))
    pages = torch.randn(n_rows + 1, head_dim + 8).to(dtype)
    q = torch.randn(batch, s_q, h_kv * group, head_dim).to(q_dtype)
    args = (k_rows, v_rows, exact_width, exact_len, slot_chunks, c, gen_before, 0.17)
    want, want_lse = attention.decode_attention(q, pages[:, 4:4 + head_dim], *args)
    pages[n_rows] = float("nan")  # the reference multiplies masked rows by 0: not the kernel
    rows = pages[:, 4:4 + head_dim]  # rows of a wider page: a row stride of its own
    assert native.supports_decode_attention(q, q.shape[1], rows)
    got, got_lse = native.decode_attention(q, rows, *args)
    assert got.dtype == want.dtype == q_dtype
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.float(), want.float(), **_tol(q_dtype))


@needs_native
def test_decode_attention_of_a_query_without_keys():
    """No valid exact row, no filled slot, no generated token: out 0 and lse -inf, as the
    reference gives."""
    q, rows = torch.randn(1, 1, 4, 64).to(torch.bfloat16), torch.randn(50, 64).to(torch.bfloat16)
    ids = torch.arange(2 * 8).view(1, 2, 8)  # 4 exact rows, one slot of 4 rows, no generated
    args = (q, rows, ids, ids + 20, 4, torch.tensor([0]), torch.full((1, 2, 1), -1,
            dtype=torch.int32), 4, torch.tensor([0]), 0.125)
    for impl in (native, attention):
        out, lse = impl.decode_attention(*args)
        assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


@needs_native
def test_c_kernels_on_more_threads_give_the_one_thread_bits():
    """The C kernels run on torch's OpenMP threads (native.OPENMP), each (request, KV head)
    on one of them: on 2 and 4 threads every output is bit for bit the 1-thread output."""
    with torch_threads(2):
        assert native.library().kernel_threads() == 2  # torch's thread pool, not one of its own
    h_kv, head_dim, dt = 2, 128, torch.bfloat16
    landmarks, starts, counts = _ragged_pool(COUNTS, h_kv, head_dim, dt, torch.device("cpu"))
    lm_rows = torch.randperm(landmarks.shape[0])
    q = torch.randn(len(COUNTS), 2, h_kv * 4, head_dim).to(dt)
    scores = native.landmark_scores(q, landmarks, lm_rows, starts, counts, max(COUNTS), 0.1)
    chunks = torch.cat([torch.randperm(n + 3) for n in COUNTS])  # each request's own (+ gap)
    chunks = chunks.view(-1, 1).expand(-1, h_kv).to(torch.int32)
    empty = torch.full((len(COUNTS), h_kv, 16), -1, dtype=torch.int32)
    slot_chunks, miss_slots, miss_count = native.select_slots(scores, chunks, starts, counts, 16,
                                                              empty)
    rank, c, rope = 40, 8, default_rope(head_dim, 4096, head_dim)
    a = torch.randn(landmarks.shape[0] * c, rank).to(dt)
    a_positions = torch.randint(0, 4096, (len(a),), dtype=torch.int32)
    b = torch.randn(len(COUNTS), h_kv, rank, head_dim).to(dt)
    rebuild_args = (a, torch.arange(len(a)), a_positions, starts * c, b, slot_chunks, miss_slots,
                    miss_count, rope)
    k_rows, exact_len, decode_slots, gen_before = _decode_rows(4, h_kv, 1, 11, 5, c, 6, 4000)
    pages = torch.randn(4001, head_dim).to(dt)
    decode_args = (q[:, :1], pages, k_rows, k_rows.clamp(max=3999), 11, exact_len, decode_slots,
                   c, gen_before, 0.17)

    def run():
        keys = torch.zeros(len(COUNTS), h_kv, 16 * c, head_dim, dtype=dt)
        native.rebuild_keys(*rebuild_args, keys)
        # (fewer requests than threads: the landmark rows are split, not the requests)
        few = [native.landmark_scores(q[at], landmarks, lm_rows, starts[at], counts[at], 300, 0.1)
               for at in (slice(1, 2), slice(1, 4))]
        return [native.landmark_scores(q, landmarks, lm_rows, starts, counts, max(COUNTS), 0.1),
                *few, *native.select_slots(scores, chunks, starts, counts, 16, empty), keys,
                *native.decode_attention(*decode_args)]

    with torch_threads(1):
        one = run()
    for threads in (2, 4):
        with torch_threads(threads):
            for x, y in zip(one, run(), strict=True):
                assert torch.equal(x, y), threads


def test_copy_rows_of_other_layouts_take_the_reference():
    """Rows that are not one run of memory each (a column slice) are not the C kernel's."""
    dst, src = torch.zeros(10, 8), torch.randn(10, 16)[:, ::2]
    assert not native.supports_copy(dst, src)
    cpu_kernels.copy_rows(dst, torch.tensor([3, 1]), src, torch.tensor([0, 5]))
    assert torch.equal(dst[[3, 1]], src[[0, 5]])


@pytest.mark.parametrize("tokens,h_kv,head_dim,rotary_dim,neox",
                         [(37, 1, 64, 64, True), (300, 3, 128, 64, False),
                          (2056, 8, 128, 128, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invert_rope(tokens, h_kv, head_dim, rotary_dim, neox, dtype):
    """The compiled RoPE inversion (ShadowKV's prompt end) against the reference: partial
    rotary, both pair layouts, positions not starting at 0, fp32 out."""
    _kernels("cpu", torch.device("cpu"))
    rope = default_rope(head_dim, 4096, rotary_dim, neox)
    keys = torch.randn(tokens, h_kv, head_dim).to(dtype)
    positions = torch.randperm(4096)[:tokens]
    got = cpu_kernels.invert_rope(keys, positions, rope)
    want = rope_ops.invert_rope(keys, positions, rope)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks,chunk_size,h_kv,head_dim", [(3, 8, 1, 64), (257, 8, 8, 128),
                                                             (41, 5, 3, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_geometry(chunks, chunk_size, h_kv, head_dim, dtype):
    """The compiled chunk landmarks and least-coherent-token cosines against the reference, on
    keys with a shared direction (as real keys have), odd chunk sizes and head counts."""
    _kernels("cpu", torch.device("cpu"))
    keys = (torch.randn(chunks * chunk_size, h_kv, head_dim) + torch.randn(h_kv, head_dim)
            ).to(dtype)
    got, want = cpu_kernels.chunk_geometry(keys, chunk_size), landmarks.chunk_geometry(
        keys, chunk_size)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_dispatch_routes_to_kernels(monkeypatch, interpreted):
    calls = []
    for name, module in (("triton", select_kernels), ("cpu", native), ("torch", select)):
        real = module.landmark_scores
        monkeypatch.setattr(module, "landmark_scores",
                            lambda *a, name=name, real=real: calls.append(name) or real(*a))
    q = torch.randn(1, 1, 4, 64)
    landmarks, starts, counts = _ragged_pool([5], 1, 64, torch.float32, "cpu")
    args = (q, landmarks, torch.arange(landmarks.shape[0]), starts, counts, 5, 0.125)
    ops.landmark_scores(*args)  # CPU tensors: the C kernel (with a compiler)
    with ops.force_triton():
        ops.landmark_scores(*args)
    with ops.kernel_mode("torch"):
        ops.landmark_scores(*args)
    native_ok = native.library() is not None
    assert calls == ["cpu" if native_ok else "torch", "triton", "torch"]


@needs_native
def test_c_kernels_need_no_cpp_compiler(monkeypatch, tmp_path):
    """A host with a C compiler but no C++ one (inductor's compiled kernels unavailable) still
    runs the C kernels: they are built by cc, here into an empty cache."""
    import shutil

    which = shutil.which
    monkeypatch.setattr(shutil, "which",
                        lambda name: None if name in ("g++", "c++") else which(name))
    monkeypatch.setenv("SHADOWKV_CACHE_DIR", str(tmp_path))
    cpu_kernels.available.cache_clear()
    native.library.cache_clear()
    try:
        q = torch.randn(1, 1, 4, 64)
        rows = torch.randn(10, 64)
        assert not ops.compiled_cpu(q) and ops.native_cpu(q)
        assert ops.decode_in_place(q, 1, rows)
        assert list((tmp_path / "native").glob("shadowkv_*.so"))  # built now, by cc
    finally:
        cpu_kernels.available.cache_clear()
        native.library.cache_clear()


@pytest.mark.parametrize("start, n", [(0, 97), (130, 70), (90, 1)])
@pytest.mark.parametrize("group,head_dim,dtype", GRID + [(4, 80, torch.bfloat16)])
@pytest.mark.parametrize("given_lse", [False, True])
def test_column_sums(start, n, group, head_dim, dtype, given_lse, kernel_device):
    """One prefill chunk's H2O column sums: n queries at positions [start, start + n) over
    start + n keys, several blocks of keys and rows (and a row alone), non-contiguous inputs,
    a head_dim that is no power of two."""
    h_kv, scale = 3, head_dim ** -0.5
    q = torch.randn(h_kv * group, n, head_dim, device=kernel_device).to(dtype).transpose(0, 1)
    k = torch.randn(start + n, h_kv, 2 * head_dim, device=kernel_device).to(dtype)[..., ::2]
    lse = None
    if given_lse:  # any LSE: the kernel must use the one it is handed
        lse = torch.randn(h_kv, group, n, device=kernel_device) + 4.0
    got = heavy_hitter_kernels.chunk_column_sums(q, k, scale, lse)
    want = heavy_hitters.chunk_column_sums_reference(q, k, scale, lse)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seq_len, q_len", [(150, 150), (203, 70), (90, 1)])
@pytest.mark.parametrize("group,head_dim,dtype", GRID + [(4, 80, torch.bfloat16)])
def test_paged_causal_attention(seq_len, q_len, group, head_dim, dtype, kernel_device):
    """The exact attention over pages: a whole prompt, a later chunk after a prefix, one decode
    row; the tokens scattered over shuffled pages and slots (as a block table puts them), a
    head_dim that is no power of two."""
    h_kv, per_page, scale = 3, 16, head_dim ** -0.5
    pages = -(-seq_len // per_page) + 2
    kv = torch.randn(pages, per_page, 2, h_kv, head_dim, device=kernel_device).to(dtype)
    where = torch.randperm(pages * per_page, device=kernel_device)[:seq_len]
    blocks, slots = where // per_page, where % per_page
    q = torch.randn(h_kv * group, q_len, head_dim, device=kernel_device).to(dtype).transpose(0, 1)
    got = prefill_kernels.paged_causal_attention(q, kv, blocks, slots, scale)
    want = attention.paged_causal_attention_reference(q, kv, blocks, slots, scale)
    torch.testing.assert_close(got[0], want[0], **_tol(dtype))
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    if kernel_device.type == "cpu":  # the CPU engine's own path: gathered tokens, flash kernel
        tokens = kv[blocks, slots]
        flash = attention.causal_attention_cpu(q, tokens[:, 0], tokens[:, 1], scale)
        torch.testing.assert_close(flash[0], want[0], **_tol(dtype))
        torch.testing.assert_close(want[1], flash[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("q_len", [1, 5])
def test_paged_causal_attention_split_over_the_keys(q_len, kernel_device):
    """Few query rows over a long context (a decode step): the keys are split over programs
    (flash-decoding) and the parts merged by LSE, including parts past some rows' causal limit."""
    h_kv, group, head_dim, per_page, s_len = 2, 2, 64, 16, 2600
    assert prefill_kernels._key_splits(h_kv * group, s_len, 64, kernel_device)[0] > 1
    pages = s_len // per_page + 3
    kv = torch.randn(pages, per_page, 2, h_kv, head_dim, device=kernel_device).bfloat16()
    where = torch.randperm(pages * per_page, device=kernel_device)[:s_len]
    q = torch.randn(q_len, h_kv * group, head_dim, device=kernel_device).bfloat16()
    got = prefill_kernels.paged_causal_attention(q, kv, where // per_page, where % per_page, 0.125)
    want = attention.paged_causal_attention_reference(q, kv, where // per_page,
                                                      where % per_page, 0.125)
    assert got[0].dtype == q.dtype and got[1].shape == (h_kv, group, q_len)
    torch.testing.assert_close(got[0], want[0], **_tol(torch.bfloat16))
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


def test_paged_causal_attention_takes_a_cache_of_another_dtype(kernel_device):
    """An fp16 model over a bf16 KV cache (kv_cache_dtype "bfloat16"): the query meets the
    cache in its dtype, the output keeps the query's."""
    kv = torch.randn(15, 16, 2, 2, 64, device=kernel_device).bfloat16()
    where = torch.randperm(240, device=kernel_device)[:203]
    q = torch.randn(70, 8, 64, device=kernel_device).half()
    got = prefill_kernels.paged_causal_attention(q, kv, where // 16, where % 16, 0.125)
    want = attention.paged_causal_attention_reference(q.bfloat16(), kv, where // 16, where % 16,
                                                      0.125)
    assert got[0].dtype == torch.float16
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


def test_compiles_names_the_paths_that_compile_on_first_use():
    cpu = torch.device("cpu")
    assert ops.compiles(cpu) == cpu_kernels.available()  # "auto": the compiled CPU kernels
    with ops.force_triton():
        assert not ops.compiles(cpu)  # the interpreter
    with ops.kernel_mode("torch"):
        assert not ops.compiles(cpu)


@pytest.mark.skipif(not cpu_kernels.available(), reason="inductor needs a C++ compiler")
def test_compiled_kernels_keep_one_graph_when_sizes_stop_coinciding():
    """A decode step's miss count changes every step. With duck sizing, a first trace where
    the rows happened to equal head_dim (128) guarded them equal and the next step recompiled
    (about 1 s mid-decode); the kernels trace without it."""
    from torch._dynamo.utils import counters

    product = cpu_kernels._compiled(lambda rows, b: torch.matmul(rows, b))
    product(torch.randn(2, 128, 16), torch.randn(2, 16, 128))  # rows == head_dim
    graphs = counters["stats"]["unique_graphs"]
    for n in (40, 128, 7, 300):
        got = product(torch.randn(2, n, 16), torch.randn(2, 16, 128))
        assert got.shape == (2, n, 128)
    assert counters["stats"]["unique_graphs"] == graphs
