"""KIVI quantization (core/kivi.py) and attention over quantized token groups: the torch path
(core/quant_attention.py), the C kernel (csrc/quant_attention.c) and the Triton kernel
(interpreted on the CPU) against dequantize-then-attend. Fresh random inputs each test."""

import importlib
import os
import sys

import pytest
import torch
from torch_threads import torch_threads

from vllm_shadowkv.core import native
from vllm_shadowkv.core import quant_attention as torch_path
from vllm_shadowkv.core.attention import attention_with_lse, merge_attention
from vllm_shadowkv.core.kivi import (KiviFormat, QuantizedGroups, dequantize_groups, pack_codes,
                                     quantize_groups, unpack_codes)

KERNEL_MODULE = "vllm_shadowkv.triton_kernels.quant_kernels"


def _import_kernels():
    """As conftest.py does for the other kernel modules: decorated under TRITON_INTERPRET=1 on
    a CPU-only machine, with the variable restored right after."""
    if torch.cuda.is_available():
        return importlib.import_module(KERNEL_MODULE)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("triton.experimental.gluon")
        module = sys.modules.get(KERNEL_MODULE)
        return importlib.reload(module) if module else importlib.import_module(KERNEL_MODULE)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


quant_kernels = _import_kernels()


def _kv(tokens, h_kv, head_dim, dtype, device="cpu"):
    """Keys with a few large fixed channels (KIVI's reason for per-channel keys), values plain."""
    k = torch.randn(tokens, h_kv, head_dim, device=device)
    k[..., ::7] = k[..., ::7] * 4 + 3
    return k.to(dtype), torch.randn(tokens, h_kv, head_dim, device=device).to(dtype)


# --- packing and quantization -------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 128), dtype=torch.int32)
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 5, 128 * bits // 32)
    assert torch.equal(unpack_codes(words, bits), codes)
    one = torch.zeros(32 // bits, dtype=torch.int32)
    one[1] = 1  # code i of a word sits at bits [i*bits, (i+1)*bits)
    assert pack_codes(one, bits).item() == 1 << bits


def _reference_round_trip(x: torch.Tensor, fmt: KiviFormat) -> torch.Tensor:
    """One group's values (1-D) quantized and dequantized by the formulas, with the scale and
    zero rounded to x's dtype as stored."""
    lo, hi = x.min().float(), x.max().float()
    if fmt.bits == 1 and fmt.midpoint_one_bit:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    else:
        zero, scale = lo, (hi - lo) / fmt.max_code
    zero, scale = zero.to(x.dtype).float(), scale.to(x.dtype).float()
    codes = torch.round((x.float() - zero) / (scale if scale > 0 else 1)).clamp(0, fmt.max_code)
    return codes * scale + zero


FORMATS = [KiviFormat(2, 16, 64, 16), KiviFormat(1, 32, 64, 32), KiviFormat(4, 16, 128, 16),
           KiviFormat(1, 64, 64, 64, midpoint_one_bit=False), KiviFormat(2, 64, 128, 16)]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_matches_reference(fmt, dtype):
    n, h_kv = 2, 2
    k, v = _kv(n * fmt.group, h_kv, fmt.head_dim, dtype)
    q = quantize_groups(k, v, fmt)
    words, vg = fmt.words_per_token, fmt.head_dim // fmt.value_group
    assert [tuple(t.shape) for t in q] == [
        (n, h_kv, fmt.group, words), (n, h_kv, fmt.head_dim), (n, h_kv, fmt.head_dim),
        (n, h_kv, fmt.group, words), (n, h_kv, fmt.group, vg), (n, h_kv, fmt.group, vg)]
    assert q.key_scale.dtype == q.value_zero.dtype == dtype
    k_hat, v_hat = dequantize_groups(q, fmt, torch.float32)
    for g in range(n):
        rows = slice(g * fmt.group, (g + 1) * fmt.group)
        for h in range(h_kv):
            for c in range(fmt.head_dim):  # keys: per channel across the group's tokens
                want = _reference_round_trip(k[rows, h, c], fmt)
                torch.testing.assert_close(k_hat[rows, h, c], want, atol=0, rtol=1e-6)
            for t in range(g * fmt.group, (g + 1) * fmt.group):  # values: per token
                for c0 in range(0, fmt.head_dim, fmt.value_group):
                    cols = slice(c0, c0 + fmt.value_group)
                    want = _reference_round_trip(v[t, h, cols], fmt)
                    torch.testing.assert_close(v_hat[t, h, cols], want, atol=0, rtol=1e-6)
    k16, _ = dequantize_groups(q, fmt)
    assert k16.dtype == dtype and torch.equal(k16, k_hat.to(dtype))


def _max_error_in_steps(x, x_hat, scale):
    return ((x.float() - x_hat) / scale.float().clamp_min(1e-6)).abs().max().item()


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_error_within_half_a_step(bits):
    fmt = KiviFormat(bits, 32, 128, 32)
    k, v = _kv(4 * fmt.group, 2, 128, torch.float16)
    q = quantize_groups(k, v, fmt)
    k_hat, v_hat = dequantize_groups(q, fmt, torch.float32)
    key_steps = q.key_scale.repeat_interleave(fmt.group, dim=0)  # [tokens, h, d]
    value_steps = q.value_scale.transpose(1, 2).flatten(0, 1).repeat_interleave(32, dim=-1)
    # Half a step, plus the fp16 rounding of the stored scale and zero.
    assert _max_error_in_steps(k, k_hat, key_steps) <= 0.5 + 1e-2
    assert _max_error_in_steps(v, v_hat, value_steps) <= 0.5 + 1e-2


def test_more_bits_smaller_error():
    k, v = _kv(64, 2, 128, torch.bfloat16)
    errors = []
    for bits in (1, 2, 4):
        fmt = KiviFormat(bits, 16, 128, 16)
        k_hat, v_hat = dequantize_groups(quantize_groups(k, v, fmt), fmt, torch.float32)
        errors.append((k.float() - k_hat).abs().mean() + (v.float() - v_hat).abs().mean())
    assert errors[2] < errors[1] / 3 < errors[0] / 3


def test_one_bit_midpoint_quantizer():
    """SpeCache §6: levels at the midpoints of the two half-ranges, threshold at the middle."""
    fmt = KiviFormat(1, 32, 64, 32)
    v = torch.randn(32, 1, 64, dtype=torch.float32)  # values: groups of 32 channels per token
    _, v_hat = dequantize_groups(quantize_groups(v, v, fmt), fmt)
    groups, groups_hat = v.view(32, 2, 32), v_hat.view(32, 2, 32)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    low, high = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    want = torch.where(groups < (lo + hi) / 2, low, high)
    torch.testing.assert_close(groups_hat, want, atol=1e-5, rtol=1e-5)
    assert ((groups - groups_hat).abs() <= (hi - lo) / 4 + 1e-5).all()
    plain = KiviFormat(1, 32, 64, 32, midpoint_one_bit=False)
    _, v_plain = dequantize_groups(quantize_groups(v, v, plain), plain)
    want = torch.where(groups < (lo + hi) / 2, lo, hi)  # KIVI: min or max
    torch.testing.assert_close(v_plain.view(32, 2, 32), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [1, 2])
def test_constant_group_is_exact(bits):
    fmt = KiviFormat(bits, 16, 64, 16)
    k = torch.full((16, 1, 64), 0.75, dtype=torch.bfloat16)
    k_hat, v_hat = dequantize_groups(quantize_groups(k, k, fmt), fmt)
    assert torch.equal(k_hat, k) and torch.equal(v_hat, k)


def test_group_bytes_llama_3_1_8b():
    # Per token per layer, 8 KV heads x 128 channels, bf16 scales: MiniKV spec §7 (1 KiB) and
    # SpeCache/TailorKV (1 bit, g = 64: 12 KiB over 32 layers = 384 B).
    assert KiviFormat(2, 16, 128, 16).group_bytes() * 8 // 16 == 1024
    assert KiviFormat(1, 64, 128, 64).group_bytes() * 8 // 64 == 384


# --- attention over quantized groups -------------------------------------------------------

def dequantized_attention_reference(q, pool, group_table, group_count, fmt, scale):
    """Dequantize each request's whole context, then exact attention."""
    outs, lses = [], []
    for b, count in enumerate(group_count.tolist()):
        if count == 0:
            outs.append(torch.zeros_like(q[b]))
            lses.append(torch.full(q.shape[1:3], float("-inf")))
            continue
        ids = group_table[b, :count].long()
        k, v = dequantize_groups(QuantizedGroups(*(t[ids] for t in pool)), fmt, torch.float32)
        out, lse = attention_with_lse(q[b:b + 1], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                      None, scale)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def _batch(fmt, h_kv, gqa, s_q, counts, dtype, device="cpu"):
    """A pool of token groups with spare groups, a non-contiguous group table with garbage
    past each request's count, and the queries."""
    n_pool = sum(counts) + 3
    k, v = _kv(n_pool * fmt.group, h_kv, fmt.head_dim, dtype, device)
    pool = quantize_groups(k, v, fmt)
    width = max(counts) + 2
    ids = torch.randperm(n_pool, device=device)
    table = torch.full((width, len(counts)), 10**6, dtype=torch.int32, device=device)
    start = 0
    for b, count in enumerate(counts):
        table[:count, b] = ids[start:start + count].to(torch.int32)
        start += count
    table = table.T  # [B, width], non-contiguous
    count_t = torch.tensor(counts, dtype=torch.int32, device=device)
    q = torch.randn(len(counts), h_kv * gqa, s_q, fmt.head_dim, device=device)
    q = q.to(dtype).transpose(1, 2)  # [B, s_q, h_q, d], non-contiguous
    return q, pool, table, count_t


# (format, h_kv, GQA group, s_q, counts): head_dim 64/96/128, GQA 1/4/8, ragged counts with 0,
# 1 to 3 splits of the group table in the kernel.
def _case_id(case):
    fmt, h_kv, gqa, s_q, _ = case
    return f"{fmt.bits}b-G{fmt.group}-d{fmt.head_dim}-hkv{h_kv}-gqa{gqa}-sq{s_q}"


ATTENTION_CASES = [
    (KiviFormat(2, 16, 64, 16), 1, 1, 1, [5, 0, 2, 7]),
    (KiviFormat(1, 32, 128, 32), 2, 4, 2, [3, 1, 0]),
    (KiviFormat(4, 16, 128, 16), 1, 8, 1, [0, 4, 9]),
    (KiviFormat(1, 64, 64, 64, midpoint_one_bit=False), 2, 4, 1, [2, 3]),
    (KiviFormat(2, 16, 128, 16), 2, 8, 2, [1, 6, 0, 2]),
    (KiviFormat(2, 32, 64, 16), 1, 8, 9, [2, 1]),  # 72 query rows: two row blocks
    (KiviFormat(2, 16, 96, 24), 1, 4, 1, [3, 2]),  # value groups across words, not tiling 128
]


def _two_group_blocks(monkeypatch, fmt, h_kv, batch):
    """Blocks of two groups per request: several per batch."""
    fp32_keys = 2 * fmt.group * batch * h_kv * fmt.head_dim * 4
    monkeypatch.setattr(torch_path, "BLOCK_BYTES", fp32_keys)


def _check_attention(impl, case, dtype, device="cpu"):
    fmt, h_kv, gqa, s_q, counts = case
    q, pool, table, count = _batch(fmt, h_kv, gqa, s_q, counts, dtype, device)
    scale = fmt.head_dim ** -0.5
    out, lse = impl(q, pool, table, count, fmt, scale)
    want_out, want_lse = dequantized_attention_reference(q.cpu(), [t.cpu() for t in pool],
                                                         table.cpu(), count.cpu(), fmt, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.cpu(), want_out, **tol)
    # On CUDA 16-bit queries take 16-bit dots (FlashAttention's precision): the bf16 keys move
    # the logits by up to 0.02 (an H200, 2026-11-28).
    lse_tol = dict(atol=4e-2, rtol=5e-3) if q.is_cuda and dtype != torch.float32 else \
        dict(atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), want_lse, **lse_tol)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_in_blocks(case, dtype, monkeypatch):
    _two_group_blocks(monkeypatch, case[0], case[1], len(case[-1]))
    _check_attention(torch_path.quant_attention, case, dtype)


_needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler")


@_needs_native
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_c_kernel(case, dtype):
    _check_attention(native.quant_attention, case, dtype)


@_needs_native
@_needs_native
def test_c_kernel_on_two_threads_gives_the_one_thread_bits():
    """Each (request, KV head) on one of torch's threads: 2 threads give the 1-thread bits."""
    fmt, h_kv, gqa, s_q, counts = ATTENTION_CASES[4]
    q, pool, table, count = _batch(fmt, h_kv, gqa, s_q, counts, torch.bfloat16)
    runs = []
    for threads in (1, 2):
        with torch_threads(threads):
            runs.append(native.quant_attention(q, pool, table, count, fmt, 0.1, 0))
    for x, y in zip(*runs, strict=True):
        assert torch.equal(x, y)


def test_c_kernel_refuses_a_table_entry_outside_the_pool():
    fmt, h_kv, gqa, s_q, counts = ATTENTION_CASES[0]
    q, pool, table, count = _batch(fmt, h_kv, gqa, s_q, counts, torch.bfloat16)
    table = table.clone()
    table[3, counts[3] - 1] = len(pool.key_codes)  # one past the last group
    with pytest.raises(IndexError, match="outside the pool"):
        native.quant_attention(q, pool, table, count, fmt, 0.1)
    table[3, counts[3] - 1] = -1
    with pytest.raises(IndexError, match="outside the pool"):
        native.quant_attention(q, pool, table, count, fmt, 0.1)


def _interleaved(pool: QuantizedGroups) -> QuantizedGroups:
    """The pool as the engine's pages hold it: each group's six fields side by side in one unit
    of int32 words (methods/minikv/pages.py: unit_pool), so fields are strided views."""
    words = [f.view(torch.int32).flatten(1) for f in pool]  # [n, h_kv * field words]
    units = torch.cat(words, dim=1)
    views, at = [], 0
    for f, w in zip(pool, words):
        part = units[:, at:at + w.shape[1]].view(f.dtype).view(f.shape)
        views.append(part)
        at += w.shape[1]
    assert not views[1].is_contiguous()
    return QuantizedGroups(*views)


@_needs_native
@pytest.mark.parametrize("case", ATTENTION_CASES[1:3], ids=_case_id)
def test_c_kernel_reads_strided_pool_fields(case):
    fmt, h_kv, gqa, s_q, counts = case
    q, pool, table, count = _batch(fmt, h_kv, gqa, s_q, counts, torch.bfloat16)
    want = native.quant_attention(q, pool, table, count, fmt, 0.1, 0)
    got = native.quant_attention(q, _interleaved(pool), table, count, fmt, 0.1, 0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel(case, dtype, kernel_device):
    _check_attention(quant_kernels.quant_attention, case, dtype, kernel_device)


def test_merged_with_residual_equals_attention_over_both():
    """The caller's decode: quantized groups + 16-bit residual merged by LSE."""
    fmt = KiviFormat(2, 16, 64, 16)
    q, pool, table, count = _batch(fmt, 2, 4, 1, [3, 0, 2], torch.float32)
    residual_k, residual_v = _kv(5, 2, 64, torch.float32)
    quant = torch_path.quant_attention(q, pool, table, count, fmt, 0.125)
    exact = attention_with_lse(q, residual_k.transpose(0, 1).expand(3, -1, -1, -1),
                               residual_v.transpose(0, 1).expand(3, -1, -1, -1), None, 0.125)
    out, lse = merge_attention([quant[0], exact[0]], [quant[1], exact[1]])
    for b, n in enumerate(count.tolist()):
        k, v = dequantize_groups(QuantizedGroups(*(t[table[b, :n].long()] for t in pool)), fmt)
        k, v = torch.cat([k, residual_k]), torch.cat([v, residual_v])
        want = attention_with_lse(q[b:b + 1], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                  None, 0.125)
        torch.testing.assert_close(out[b], want[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b], want[1][0], atol=1e-5, rtol=1e-5)
