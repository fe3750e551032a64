"""The C prefill attention (csrc/prefill_attention.c) against the fp32 torch reference: whole
prompts and later chunks after a prefix, lengths on and off its blocks (16 query tokens, 128
keys), GQA groups 1 to 16, head sizes 64/80/128, keys and values strided as the pages give them,
bf16 and (where the build takes them: AVX2) fp16 and fp32 inputs, fresh random inputs each test;
and the engine's CPU exact attention runs it where it applies."""

import pytest
import torch

from vllm_shadowkv.backend import exact_attention
from vllm_shadowkv.core import attention, native, ops

from torch_threads import torch_threads

pytestmark = pytest.mark.skipif(
    native.library() is None or not native.library().prefill_attention_dtypes(),
    reason="the C prefill attention needs a compiler and a CPU with AVX512-BF16 or AVX2")


def takes(dtype: torch.dtype) -> bool:
    """Whether this build's kernel takes inputs of dtype (bf16 everywhere; fp16, fp32 on AVX2)."""
    return bool(native.library().prefill_attention_dtypes() & 1 << native.DTYPES[dtype])


DTYPES = [torch.bfloat16] + [
    pytest.param(dtype, marks=pytest.mark.skipif(
        native.library() is None or not takes(dtype),
        reason=f"{dtype} inputs: AVX2 builds (AVX512-BF16 multiplies bf16)"))
    for dtype in (torch.float16, torch.float32)]

SHAPES = [(1, 1), (5, 5), (16, 16), (17, 17), (150, 150), (129, 129), (70, 203), (33, 257),
          (1, 90), (3, 1000)]


def _inputs(q_len, s_len, h_kv, group, head_dim, dtype=torch.bfloat16):
    """Query [q, Hq, d]; key and value [s, Hkv, d] as views of one [s, 2, Hkv, d] tensor (a
    token stride of 2 Hkv d, as the exact pages give them)."""
    q = torch.randn(q_len, h_kv * group, head_dim).to(dtype)
    kv = torch.randn(s_len, 2, h_kv, head_dim).to(dtype)
    return q, kv[:, 0], kv[:, 1]


def _reference(q, k, v, scale):
    """-> out [q, Hq, d] fp32, lse [Hq, q]: every query token i at position s - q + i."""
    q_len, s_len = q.shape[0], k.shape[0]
    mask = torch.arange(s_len) <= torch.arange(s_len - q_len, s_len).view(-1, 1)
    out, lse = attention.attention_with_lse_reference(
        q.float()[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
        mask[None, None], scale)
    return out[0], lse[0].T


@pytest.mark.parametrize("q_len, s_len", SHAPES)
@pytest.mark.parametrize("group, head_dim", [(1, 64), (3, 64), (4, 128), (8, 128), (16, 64),
                                             (4, 80)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_equals_the_reference(q_len, s_len, group, head_dim, dtype):
    h_kv, scale = 2, head_dim ** -0.5
    q, k, v = _inputs(q_len, s_len, h_kv, group, head_dim, dtype)
    assert native.supports_prefill_attention(q, k, v)
    out, lse = native.prefill_attention(q, k, v, scale)
    want_out, want_lse = _reference(q, k, v, scale)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.bfloat16:
        # P is rounded to bf16 before it meets V (as FlashAttention does), the output once more
        torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
        assert (out.float() - want_out).abs().mean() < 2e-3
    elif dtype == torch.float16:  # fp32 throughout, the output rounded to fp16
        torch.testing.assert_close(out.float(), want_out, atol=1e-3, rtol=1e-3)
    else:  # fp32 throughout
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


def test_prefill_attention_is_the_same_on_any_thread_count():
    """Each (KV head, 16 tokens) is one thread's from start to end: no sum depends on the
    split."""
    q, k, v = _inputs(300, 700, 4, 4, 64)
    with torch_threads(1):
        one = native.prefill_attention(q, k, v, 0.125)
    with torch_threads(2):
        two = native.prefill_attention(q, k, v, 0.125)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_prefill_attention_takes_only_what_it_can():
    q, k, v = _inputs(8, 8, 2, 4, 64)
    assert native.supports_prefill_attention(q, k, v)
    assert native.supports_prefill_attention(q.float(), k.float(), v.float()) == takes(
        torch.float32)
    assert native.supports_prefill_attention(q.half(), k.half(), v.half()) == takes(
        torch.float16)
    assert not native.supports_prefill_attention(q, k.float(), v.float())  # one dtype
    assert not native.supports_prefill_attention(*_inputs(8, 8, 2, 4, 72))  # d % 16
    assert not native.supports_prefill_attention(*_inputs(8, 8, 1, 32, 64))  # group > 16
    assert not native.supports_prefill_attention(q, k[:4], v[:4])  # fewer keys than queries


@pytest.mark.parametrize("q_len, s_len", [(150, 150), (70, 203)])
def test_the_engines_cpu_exact_attention_runs_it(q_len, s_len):
    """Prefill chunks on the CPU: the C kernel in "auto" with the LSE (where vLLM's kernel
    does not run AMX tiles); vLLM's kernel (or torch's) in mode "torch", the same attention."""
    q, k, v = _inputs(q_len, s_len, 2, 4, 128)
    if not exact_attention.prefill_in_c(q, k, v):
        pytest.skip("vLLM's kernel keeps the call where it runs AMX tiles")
    out, lse = exact_attention._cpu_causal_attention(q, k, v, 0.09)
    want = native.prefill_attention(q, k, v, 0.09)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1].view(2, 4, q_len))
    assert torch.equal(exact_attention.causal_attention(q, k, v, 0.09), out)
    with ops.kernel_mode("torch"):
        other = exact_attention.causal_attention(q, k, v, 0.09)
    torch.testing.assert_close(other.float(), out.float(), atol=2e-2, rtol=2e-2)
