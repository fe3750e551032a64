"""H2O column sums across prefill chunks, heavy-hitter selection per KV head, and the pyramid
layer budgets (core/heavy_hitters.py). Fresh random inputs each test."""

import pytest
import torch
from torch._dynamo.utils import counters

from vllm_shadowkv.core import cpu_kernels, heavy_hitters, native, ops
from vllm_shadowkv.core.attention import causal_attention_cpu
from vllm_shadowkv.core.heavy_hitters import (accumulate_column_sums, layer_budgets,
                                              select_heavy_hitters)


def _amx_tiles() -> bool:
    """Whether the C column sums run here (a CPU with AMX tiles, the library built)."""
    if native.library() is None:
        return False
    q, k = torch.zeros(1, 1, 64).bfloat16(), torch.zeros(1, 1, 64).bfloat16()
    return native.column_sums(q, k, 1.0) is not None


def _c_sums_with_lse(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the C column sums that take the rows' LSE run here on dtype inputs (AVX512-BF16:
    bf16; AVX2: bf16, fp16, fp32)."""
    q = torch.zeros(1, 1, 64, dtype=dtype)
    return native.library() is not None and native.supports_column_sums_lse(q, q)


def dense_column_sums(q, k, scale):
    """The whole causal softmax map, summed over query rows and the query heads of each KV
    head: q [L, h_q, d], k [L, h_kv, d] -> [h_kv, L]."""
    length, h_q, _ = q.shape
    h_kv = k.shape[1]
    k_heads = k.float().repeat_interleave(h_q // h_kv, dim=1)
    logits = torch.einsum("ihd,jhd->hij", q.float(), k_heads) * scale
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    return probs.sum(dim=1).view(h_kv, h_q // h_kv, length).sum(dim=1)


CHUNKS = [([97], 64), ([37, 1, 59], 80), ([64, 33], 128)]


# Only the Triton kernel uses a handed-over LSE; the tiles compute their rows' own (the C
# kernel that takes it: test_c_column_sums_from_the_lse_equal_one_pass).
@pytest.mark.parametrize("impl, given_lse", [("gemm", False), ("gemm-eager", False),
                                             ("tiles", False), ("triton", False),
                                             ("triton", True)])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("chunks, head_dim", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_column_sums_equal_one_pass(impl, gqa, chunks, head_dim, given_lse, dtype,
                                            monkeypatch, kernel_device):
    """The CPU's GEMM tiles (compiled, and eager as in "torch" mode), the fp32 tiles and the
    Triton kernel (what CUDA runs; interpreted on the CPU) against the dense map, with the rows'
    LSE computed inside or, for Triton, handed over from the prefill's exact attention."""
    if impl in ("gemm", "tiles"):  # not the C kernels (with the LSE; AMX's on bf16)
        monkeypatch.setattr(native, "supports_column_sums_lse", lambda q, k: False)
        monkeypatch.setattr(native, "supports_column_sums", lambda q, k: False)
    if impl == "tiles":
        monkeypatch.setattr(heavy_hitters, "gemm_column_sums",
                            lambda q, k, scale, tile: heavy_hitters.chunk_column_sums_reference(
                                q, k, scale))
    _check_chunked(impl, gqa, chunks, head_dim, given_lse, dtype, monkeypatch, kernel_device)


@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("chunks, head_dim", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_c_column_sums_from_the_lse_equal_one_pass(gqa, chunks, head_dim, dtype, monkeypatch):
    """The C kernel that takes the rows' LSE (chunks whose attention ran in C: bf16, or fp16
    and fp32 on AVX2), as the engine calls it."""
    if not _c_sums_with_lse(dtype):
        pytest.skip(f"the C column sums take no {dtype} inputs here (AVX512-BF16: bf16; AVX2: "
                    f"bf16, fp16, fp32)")
    _check_chunked("lse", gqa, chunks, head_dim, True, dtype, monkeypatch, torch.device("cpu"))


@pytest.mark.skipif(not _amx_tiles(), reason="needs AMX tiles")
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("chunks, head_dim", CHUNKS)
def test_amx_chunked_column_sums_equal_one_pass(gqa, chunks, head_dim, monkeypatch):
    """The C kernel on AMX tiles (bf16 chunks), as the engine calls it."""
    _check_chunked("amx", gqa, chunks, head_dim, False, torch.bfloat16, monkeypatch,
                   torch.device("cpu"))


def _check_chunked(impl, gqa, chunks, head_dim, given_lse, dtype, monkeypatch, kernel_device):
    # Small tiles, so that queries and keys are both split within a chunk.
    monkeypatch.setattr(heavy_hitters, "QUERY_BLOCK", 16)
    monkeypatch.setattr(heavy_hitters, "KEY_BLOCK", 24)
    monkeypatch.setattr(heavy_hitters, "TILE_BYTES", 2 * 24 * 97 * gqa)
    device = kernel_device if impl == "triton" else torch.device("cpu")
    mode = {"triton": "triton", "gemm-eager": "torch"}.get(impl, "auto")
    h_kv, length = 2, sum(chunks)
    q = torch.randn(length, h_kv * gqa, head_dim).to(dtype)
    k = torch.randn(length, h_kv, head_dim).to(dtype)
    scale = head_dim ** -0.5
    col_sums, start = None, 0
    calls = []
    if impl == "lse":
        c_sums = native.column_sums_lse
        monkeypatch.setattr(native, "column_sums_lse",
                            lambda *args: calls.append(1) or c_sums(*args))
    with ops.kernel_mode(mode):
        for n in chunks:
            lse = causal_attention_cpu(q[start:start + n], k[:start + n], k[:start + n],
                                       scale)[1].to(device) if given_lse else None
            col_sums = accumulate_column_sums(col_sums, q[start:start + n].to(device),
                                              k[:start + n].to(device), scale, lse)
            start += n
            assert col_sums.shape == (h_kv, start) and col_sums.dtype == torch.float32
    want = dense_column_sums(q, k, scale)
    # bf16 GEMM logits: each rounded to 2^-9 of its distance from the row's centring. (The
    # AMX tiles and the C kernel with the LSE sum bf16 products in fp32: as exact as the fp32
    # tiles.)
    tol = 2e-3 if impl.startswith("gemm") and dtype == torch.bfloat16 else 1e-4
    if impl == "lse":
        assert calls, "the C kernel with the LSE did not run"
    torch.testing.assert_close(col_sums.cpu(), want, atol=tol, rtol=tol)
    # Every query row's probabilities sum to 1.
    torch.testing.assert_close(col_sums.sum(dim=-1).cpu(),
                               torch.full((h_kv,), length * gqa * 1.0), rtol=1e-5, atol=0)


@pytest.mark.skipif(not _amx_tiles(), reason="needs AMX tiles")
def test_amx_rows_far_above_their_centre_are_summed_again():
    """A key whose logit lies far above both keys that centre a row (its own and the first):
    exp would overflow fp32, so the row is summed again centred on its largest logit."""
    q = torch.randn(40, 4, 64) * 0.1
    k = torch.randn(40, 1, 64) * 0.1
    q[:, :, 0], k[7, 0, 0] = 4.0, 40.0  # logits of 160 against key 7 (scale 1), ~0 elsewhere
    q, k = q.bfloat16(), k.bfloat16()
    got = native.column_sums(q[10:], k, 1.0)
    want = heavy_hitters.chunk_column_sums_reference(q[10:], k, 1.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got[0, 7] > 0.99 * 30 * 4  # every row of the chunk attends key 7


def test_gemm_tiles_redo_the_rows_whose_estimate_falls_short():
    """A key far above every key of the later rows' centring samples (their first and latest
    keys): those rows are done again, centred on their maxima, and the sums stay exact to the
    rounding of logits near 0."""
    length, head_dim, group = 300, 64, 4
    needle = torch.randn(head_dim)
    q = torch.randn(length, group, head_dim)
    q[151:] += needle  # the later rows all look for it
    q = q.bfloat16()
    k = torch.randn(length, 1, head_dim).bfloat16()
    k[150] = (needle * 1.5).bfloat16()  # its logit ~12 above the rows' others (scaled)
    scale = head_dim ** -0.5
    rows = []

    def tile(logits, scale):
        rows.append(len(logits))
        return heavy_hitters.column_sum_tile(logits, scale)

    got = heavy_hitters.gemm_column_sums(q, k, scale, tile)
    assert sum(rows) > length * group  # some rows again (and their first sums taken out)
    torch.testing.assert_close(got, dense_column_sums(q, k, scale), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("block", [5, 128])
@pytest.mark.parametrize("n, start, group", [(1, 0, 4), (7, 0, 1), (130, 0, 3), (33, 70, 4),
                                             (1, 200, 2), (64, 16, 8)])
def test_centring_estimates_are_the_sampled_keys_maxima(n, start, group, block, monkeypatch):
    """Each row's estimate is its largest logit over the first SAMPLE_FIRST keys and its own
    SAMPLE_RECENT latest ones (those it sees), whichever way the recent windows are blocked."""
    monkeypatch.setattr(heavy_hitters, "RECENT_BLOCK", block)
    head_dim = 16
    q, k = torch.randn(n, group, head_dim), torch.randn(start + n, head_dim)
    want = torch.empty(n, group)
    for i in range(n):
        pos = start + i
        sampled = sorted(set(range(min(heavy_hitters.SAMPLE_FIRST, pos + 1)))
                         | set(range(max(0, pos - heavy_hitters.SAMPLE_RECENT + 1), pos + 1)))
        want[i] = (q[i] @ k[sampled].T).amax(-1)
    torch.testing.assert_close(heavy_hitters._estimated_maxima(q, k, start), want)


def test_selection_per_kv_head_from_group_sums():
    h_kv, gqa, length, heavy, recent = 3, 4, 80, 10, 6
    q = torch.randn(length, h_kv * gqa, 32) * 3
    k = torch.randn(length, h_kv, 32)
    col_sums = accumulate_column_sums(None, q, k, 32 ** -0.5)
    kept = select_heavy_hitters(col_sums, length, heavy, recent)
    assert kept.shape == (h_kv, heavy + recent)
    for h in range(h_kv):
        row = kept[h]
        assert torch.equal(row, row.sort().values) and len(set(row.tolist())) == heavy + recent
        assert torch.equal(row[heavy:], torch.arange(length - recent, length))
        best = torch.topk(col_sums[h, :length - recent], heavy).values
        torch.testing.assert_close(col_sums[h, row[:heavy]].sort().values, best.sort().values)
    assert not all(torch.equal(kept[0], kept[h]) for h in range(1, h_kv))  # heads differ


def test_pooling_keeps_the_neighbours_of_a_heavy_token():
    length, heavy, recent, pool = 60, 7, 5, 7
    col_sums = torch.rand(2, length) * 0.1
    col_sums[0, 20] = col_sums[1, 3] = 5.0  # one heavy token per head, the rest noise
    kept = select_heavy_hitters(col_sums, length, heavy, recent, pool)
    assert torch.equal(kept[0, :heavy], torch.arange(17, 24))
    # Near the prompt's start: tokens 0-6 each have token 3 within 3 positions.
    assert torch.equal(kept[1, :heavy], torch.arange(0, 7))
    assert torch.equal(kept[:, heavy:], torch.arange(length - recent, length).expand(2, -1))
    # pool 1 is H2O's own column sums.
    assert torch.equal(select_heavy_hitters(col_sums, length, heavy, recent, 1),
                       select_heavy_hitters(col_sums, length, heavy, recent))


def test_selection_keeps_everything_when_the_budget_covers_the_prompt():
    col_sums = torch.rand(2, 12)
    kept = select_heavy_hitters(col_sums, 10, 6, 4)
    assert torch.equal(kept, torch.arange(10).expand(2, -1))


def test_pyramid_budgets():
    budgets = layer_budgets(32, 0.25)
    assert len(budgets) == 32 and sum(budgets) / 32 == pytest.approx(0.25)
    assert all(a > b for a, b in zip(budgets, budgets[1:]))  # layer 0 largest
    # MiniKV spec §5: 2x - x/7 at layer 0, x/7 at the last, 46.43 / 35.37 % at layers 0 / 8.
    assert budgets[0] == pytest.approx(0.5 - 0.25 / 7) and budgets[-1] == pytest.approx(0.25 / 7)
    assert budgets[8] == pytest.approx(0.3537, abs=1e-4)
    assert layer_budgets(5, 0.1, policy="uniform") == [0.1] * 5
    assert layer_budgets(1, 0.3) == [0.3]


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C++ compiler (torch.compile)")
def test_compiled_tile_is_one_graph_for_every_size():
    """The warm-up's short prompts compile the tile that a 16K prompt and a single row done
    again use too: nothing compiles while serving."""
    torch._dynamo.reset()
    counters.clear()

    def tile(rows, keys):
        logits = torch.randn(rows, keys).bfloat16()
        logits[:, -1] = float("-inf")  # a key not visible
        got = cpu_kernels.column_sum_tile(logits, 0.125)
        want = heavy_hitters.column_sum_tile(logits, 0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    tile(96, 600)
    compiled = counters["stats"]["unique_graphs"]
    for rows, keys in ((1, 700), (300, 9000), (5000, 5100)):
        tile(rows, keys)
    assert counters["stats"]["unique_graphs"] == compiled == 1
