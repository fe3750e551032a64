"""Prefill compression: factorisation, landmarks, outliers, local window, short prompts, store."""

import subprocess
import sys

import pytest
import torch

from vllm_shadowkv.core.compress import compress_prompt
from core_ragged import compress_prompts, rebuild_pre_rope
from vllm_shadowkv.core.landmarks import chunk_geometry, outlier_chunks
from vllm_shadowkv.core import lowrank
from vllm_shadowkv.core.lowrank import factorize_keys
from vllm_shadowkv.core.params import ShadowKVParams
from vllm_shadowkv.core.rope import apply_rope
from vllm_shadowkv.core.store import InMemoryValueStore

from core_rope_util import default_rope


def test_full_rank_factorisation_is_exact():
    keys = torch.randn(300, 2, 16, dtype=torch.float64).float()
    for rank in (32, 500):  # == h_kv*d, and above it (clamped)
        a, b = factorize_keys(keys, rank)
        assert a.shape == (300, 32) and b.shape == (2, 32, 16)
        torch.testing.assert_close(rebuild_pre_rope(a, b), keys, atol=1e-4, rtol=1e-4)


def test_rank_r_is_the_svd_optimum():
    keys = torch.randn(400, 4, 8) @ torch.diag(torch.linspace(3, 0.1, 8))
    a, b = factorize_keys(keys, 10)
    flat = keys.reshape(400, -1).double()
    s = torch.linalg.svdvals(flat)
    best = s[10:].pow(2).sum().sqrt()  # Eckart-Young error of the best rank-10 approximation
    err = (rebuild_pre_rope(a, b).reshape(400, -1).double() - flat).norm()
    torch.testing.assert_close(err, best, rtol=1e-4, atol=1e-4)
    # B's rows are orthonormal (B = Psi^T), so A = K Psi projects new keys (ShadowKV+).
    basis = b.transpose(0, 1).reshape(10, -1)
    torch.testing.assert_close(basis @ basis.T, torch.eye(10), atol=1e-5, rtol=0)


def test_factorisation_at_engine_sizes_is_the_svd_optimum():
    """Shapes where torch's CPU GEMM is oneDNN's, which multiplies fp32 matrices in its bf16
    mode on CPUs with bf16 dot products (lowrank._fp32_products_as_bf16): still the optimum, and
    torch's global setting is left as it was."""
    torch.manual_seed(0)
    keys = torch.randn(4096, 4, 64) @ torch.diag(torch.linspace(3, 0.1, 64))
    flat = keys.reshape(4096, -1).double()
    s = torch.linalg.svdvals(flat)
    before = torch.backends.mkldnn.matmul.fp32_precision
    for rank in (40, 256):
        err = (rebuild_pre_rope(*factorize_keys(keys, rank)).reshape(4096, -1).double()
               - flat).norm()
        assert err <= s[rank:].pow(2).sum().sqrt() * (1 + 1e-6) + 1e-5 * flat.norm()
    assert torch.backends.mkldnn.matmul.fp32_precision == before


@pytest.mark.parametrize("tokens,width", [(1, 256), (777, 256), (2051, 384), (1000, 1021),
                                          (513, 1024), (300, 7)])
def test_gram_from_the_blocks_above_the_diagonal_is_the_whole_product(tokens, width):
    """The CPU's Gram multiplies only the blocks on and above its diagonal: the whole product,
    exactly symmetric, for widths that do and do not split evenly (and narrow ones unsplit)."""
    flat = torch.randn(tokens, width)
    gram = lowrank._gram(flat)
    torch.testing.assert_close(gram, flat.T @ flat, atol=1e-4, rtol=1e-5)
    if width >= lowrank.MIN_BLOCKED_WIDTH:
        assert torch.equal(gram, gram.T)


@pytest.mark.parametrize("failure", ["nan", "not_orthonormal", "no_convergence"])
def test_eigh_falls_back_to_float64_when_fp32_fails(monkeypatch, failure):
    """fp32 eigh (MKL) has returned NaN eigenvectors and failed to converge on low-rank Grams:
    each failure is caught and the basis computed in float64, the same as fp32's when it works."""
    torch.manual_seed(0)
    keys = torch.randn(300, 2, 16) @ torch.diag(torch.linspace(3, 0.1, 16))
    want = rebuild_pre_rope(*factorize_keys(keys, 10))
    real, calls = torch.linalg.eigh, []

    def failing(matrix):
        calls.append(matrix.dtype)
        result = real(matrix)
        if matrix.dtype == torch.float64:
            return result
        if failure == "no_convergence":
            raise torch.linalg.LinAlgError("failed to converge")
        bad = result.eigenvectors.clone()
        bad[:, -1] = float("nan") if failure == "nan" else 2.0
        return type(result)((result.eigenvalues, bad))

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    got = rebuild_pre_rope(*factorize_keys(keys, 10))  # (eigenvectors: unique up to sign)
    assert calls == [torch.float32, torch.float64]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_landmarks_and_outliers():
    keys = torch.randn(6 * 4, 2, 8) * 0.01 + torch.randn(1, 2, 8)  # coherent chunks
    keys[8:12, 0] = torch.randn(4, 8)  # chunk 2 of head 0 incoherent
    keys[20:24, 1] = torch.randn(4, 8)  # chunk 5 of head 1 incoherent
    landmarks, min_cos = chunk_geometry(keys, 4)
    torch.testing.assert_close(landmarks[3], keys[12:16].mean(0))
    assert outlier_chunks(min_cos, 1).tolist() == [[2], [5]]


def _prompt(num_tokens, h_kv=2, d=16, seed=0):
    torch.manual_seed(seed)
    rope = default_rope(d, 8192)
    positions = torch.arange(num_tokens) + 5
    keys = apply_rope(torch.randn(num_tokens, h_kv, d), positions, rope)
    return keys, torch.randn(num_tokens, h_kv, d), positions, rope


def test_compressed_layout():
    params = ShadowKVParams(rank=8, chunk_size=4, sparse_budget=8, outlier_chunks=3,
                            local_chunks=2, min_compress_tokens=64)
    keys, values, positions, rope = _prompt(103)  # 25 chunks + 3 leftover tokens
    store = InMemoryValueStore()
    p = compress_prompt(keys, values, positions, rope, params, store, "r")
    n_c = 103 // 4 - 2
    assert p.compressed_tokens == n_c * 4 and p.a.shape == (n_c * 4, 8)
    assert torch.equal(p.a_positions, positions[: n_c * 4].int())
    assert p.landmarks.shape == (n_c - 3, 2, 16) and p.exact_k.shape == (2, 3 * 4 + 2 * 4 + 3, 16)
    for h in range(2):
        ids = set(p.landmark_chunks[:, h].tolist())
        assert ids.isdisjoint(p.outliers[h].tolist()) and len(ids | set(p.outliers[h].tolist())) == n_c
        first = int(p.outliers[h, 0])
        torch.testing.assert_close(p.exact_k[h, :4], keys[first * 4:first * 4 + 4, h])
        torch.testing.assert_close(p.exact_v[h, -11:], values[-11:, h])  # local window, last
        chunk = int(p.landmark_chunks[0, h])
        torch.testing.assert_close(p.landmarks[0, h], keys[chunk * 4:chunk * 4 + 4, h].mean(0))
    rows = store.gather("r", torch.tensor([1]), torch.tensor([7]))
    torch.testing.assert_close(rows[0], values[28:32, 1])


def test_short_prompts_stay_exact_and_ragged_batch():
    params = ShadowKVParams(rank=8, chunk_size=4, sparse_budget=8, outlier_chunks=3,
                            local_chunks=2, min_compress_tokens=64)
    parts = [_prompt(n, seed=n) for n in (63, 64, 21)]  # below threshold, at it, tiny
    keys, values, positions = (torch.cat([p[i] for p in parts]) for i in range(3))
    store = InMemoryValueStore()
    out = compress_prompts(keys, values, positions, [0, 63, 127, 148], parts[0][3], params,
                           store, ["a", "b", "c"])
    assert [p.is_exact for p in out] == [True, False, True]
    assert len(store) == 1
    torch.testing.assert_close(out[0].exact_k, parts[0][0].transpose(0, 1))
    assert params.compressed_chunks(4 * (3 + 2) + 3) == 0  # no chunk left beyond outliers


def test_core_does_not_import_vllm():
    code = ("import sys, vllm_shadowkv.core.decode, vllm_shadowkv.core.fidelity, "
            "vllm_shadowkv.core.ops; assert not [m for m in sys.modules if m.startswith('vllm.')"
            " or m == 'vllm'], 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_budget_and_outliers_as_shares_of_each_prompt():
    """The paper's proportions (2048 selected tokens and 48 outlier chunks of 8 at 128K) held
    at any prompt length: whole chunks, the budget rounded down and the outliers half up, at
    least one chunk each, at most the fixed settings; a prompt compresses only with chunks
    left beyond its own outliers."""
    params = ShadowKVParams(sparse_budget=4096, outlier_chunks=64, min_compress_tokens=0,
                            sparse_budget_ratio=2048 / 131072, outlier_ratio=48 * 8 / 131072)
    assert (params.select_chunks_for(131072), params.outliers_for(131072)) == (256, 48)
    assert (params.select_chunks_for(32768), params.outliers_for(32768)) == (64, 12)
    assert (params.select_chunks_for(2048), params.outliers_for(2048)) == (4, 1)  # 0.75 -> 1
    assert (params.select_chunks_for(100), params.outliers_for(100)) == (1, 1)  # at least one
    assert (params.select_chunks_for(1 << 20), params.outliers_for(1 << 20)) == (512, 64)  # caps
    assert params.outliers_for(128 * 1024 * 3 // 96) == 2  # 1.5 chunks: half up
    fixed = ShadowKVParams(outlier_chunks=5, local_chunks=1, min_compress_tokens=0)
    shared = ShadowKVParams(outlier_chunks=5, local_chunks=1, min_compress_tokens=0,
                            outlier_ratio=0.01)
    assert fixed.compressed_chunks(48) == 0 and shared.compressed_chunks(48) == 5
    keys, values, positions, rope = _prompt(800)
    prompt = compress_prompt(keys, values, positions, rope, shared, InMemoryValueStore(), "r")
    assert prompt.outliers.shape == (2, 1)  # 800 x 1 % / 8 = 1 chunk, not 5
