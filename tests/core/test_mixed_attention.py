"""SpeCache's attention over a low-bit cache with the top-k tokens exact (core/mixed_attention.py:
one quantized pass, its top-k and the exact tokens swapped in; the pass by the torch path, the
C kernel and the Triton kernel interpreted on the CPU), against caches built
explicitly. Fresh random inputs each test.
"""

import pytest
import torch

from vllm_shadowkv.core import native, ops
from vllm_shadowkv.core import quant_attention as torch_path
from vllm_shadowkv.core.attention import attention_with_lse_reference, merge_attention
from vllm_shadowkv.core.kivi import (KiviFormat, QuantizedGroups, dequantize_groups,
                                     dequantize_tokens, quantize_groups)
from vllm_shadowkv.core.mixed_attention import swap_in_exact, top_k_tokens

# quant_kernels: imported there interpreted on a CPU-only machine
from test_kivi import _needs_native, _two_group_blocks, quant_kernels


class Requests:
    """Exact K/V of ragged requests, quantized into one shared pool of token groups (spare
    groups, shuffled ids, a non-contiguous table with garbage past each count), and queries."""

    def __init__(self, fmt, h_kv, gqa, s_q, counts, dtype, device="cpu"):
        n_pool = sum(counts) + 2
        k = torch.randn(n_pool * fmt.group, h_kv, fmt.head_dim, device=device)
        k[..., ::7] = k[..., ::7] * 4 + 3  # large fixed channels, KIVI's reason for per-channel keys
        v = torch.randn(n_pool * fmt.group, h_kv, fmt.head_dim, device=device)
        k, v = k.to(dtype), v.to(dtype)
        self.fmt, self.h_kv, self.dtype = fmt, h_kv, dtype
        self.pool = quantize_groups(k, v, fmt)
        ids = torch.randperm(n_pool, device=device).to(torch.int32)
        table = torch.full((max(counts) + 1, len(counts)), 10**6, dtype=torch.int32, device=device)
        self.exact = []  # per request: k, v [count * G, h_kv, d]
        start = 0
        for b, count in enumerate(counts):
            mine = ids[start:start + count]
            table[:count, b] = mine
            start += count
            rows = (mine.long().view(-1, 1) * fmt.group + torch.arange(fmt.group, device=device))
            self.exact.append((k[rows.flatten()], v[rows.flatten()]))
        self.table = table.T
        self.count = torch.tensor(counts, dtype=torch.int32, device=device)
        q = torch.randn(len(counts), h_kv * gqa, s_q, fmt.head_dim, device=device)
        self.q = q.to(dtype).transpose(1, 2)  # [B, s_q, h_q, d], non-contiguous
        self.scale = fmt.head_dim ** -0.5

    def dequantized(self, b):
        n = int(self.count[b])
        picked = QuantizedGroups(*(t[self.table[b, :n].long()] for t in self.pool))
        return dequantize_groups(picked, self.fmt, torch.float32)

    def random_tokens(self, k):
        """k distinct token ids per (request, KV head), -1 past a request's tokens."""
        out = torch.full((len(self.exact), self.h_kv, k), -1, dtype=torch.int32)
        for b, (keys, _) in enumerate(self.exact):
            for h in range(self.h_kv):
                ids = torch.randperm(keys.shape[0])[:k]
                out[b, h, :len(ids)] = ids.to(torch.int32)
        return out.to(self.count.device)

    def slots(self, tokens):
        """The exact K/V of tokens [B, h_kv, k] -> slot_k, slot_v [B, h_kv, k, d] (0 if empty)."""
        slot_k = torch.zeros(*tokens.shape, self.fmt.head_dim, dtype=self.dtype)
        slot_v = torch.zeros_like(slot_k)
        for b, (keys, values) in enumerate(self.exact):
            for h in range(self.h_kv):
                ids = tokens[b, h].long().cpu()
                used = ids >= 0
                slot_k[b, h, used] = keys[ids[used], h].cpu()
                slot_v[b, h, used] = values[ids[used], h].cpu()
        return slot_k.to(self.q.device), slot_v.to(self.q.device)


def _attend(q, k, v, scale, key_mask=None):
    """One request: q [s_q, h_q, d]; k, v [S, h_kv, d] -> out [s_q, h_q, d] fp32, lse."""
    out, lse = attention_with_lse_reference(q[None].float(), k.transpose(0, 1)[None].float(),
                                            v.transpose(0, 1)[None].float(), key_mask, scale)
    return out[0], lse[0]


IMPLS = {
    "torch": torch_path.quant_attention,
    "native": native.quant_attention,
    "triton": quant_kernels.quant_attention,
}
KERNEL_MODES = {"torch": "torch", "native": "auto", "triton": "triton"}
IMPL_PARAMS = [pytest.param("torch"), pytest.param("native", marks=_needs_native),
               pytest.param("triton")]

def _device(impl, kernel_device):
    return kernel_device if impl == "triton" else torch.device("cpu")


def test_dequantize_tokens_picks_single_tokens():
    """Tokens of a (request, KV head) dequantized one by one equal the same rows of the
    request's dequantized groups (empty slots read token 0)."""
    fmt = KiviFormat(2, 16, 64, 16)
    r = Requests(fmt, 2, 4, 1, [3, 1, 2], torch.bfloat16)
    tokens = r.random_tokens(20)
    keys, values = dequantize_tokens(r.pool, r.table, tokens, fmt)
    assert keys.shape == values.shape == (3, 2, 20, 64) and keys.dtype == torch.float32
    for b in range(3):
        all_keys, all_values = r.dequantized(b)
        for h in range(2):
            ids = tokens[b, h].long().clamp_min(0)
            torch.testing.assert_close(keys[b, h], all_keys[ids, h], atol=0, rtol=0)
            torch.testing.assert_close(values[b, h], all_values[ids, h], atol=0, rtol=0)


def _mixed_cache_reference(r, tokens, residual_k, residual_v):
    """Per request: the dequantized cache with the rows in tokens (per KV head) replaced by
    their exact K/V, then the 16-bit residual appended; exact attention over it."""
    outs, lses = [], []
    for b, (keys, values) in enumerate(r.exact):
        k_mixed, v_mixed = (t.cpu() for t in r.dequantized(b))
        for h in range(r.h_kv):
            ids = tokens[b, h].long().cpu()
            ids = ids[ids >= 0]
            k_mixed[ids, h] = keys[ids, h].cpu().float()
            v_mixed[ids, h] = values[ids, h].cpu().float()
        out, lse = _attend(r.q[b].cpu(), torch.cat([k_mixed, residual_k[b].float()]),
                           torch.cat([v_mixed, residual_v[b].float()]), r.scale)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _with_residual(r, quant_part, residual_k, residual_v):
    exact = attention_with_lse_reference(r.q.cpu(), residual_k.transpose(1, 2),
                                         residual_v.transpose(1, 2), None, r.scale)
    return merge_attention([quant_part[0].cpu(), exact[0]], [quant_part[1].cpu(), exact[1]])


# (format, h_kv, GQA group, s_q, counts, slots per KV head): bits 1/2, GQA 1/4/8, odd
# head_dim and slot counts, 1 or 2 query rows, every token of some requests in the slots.
MIXED_CASES = [
    (KiviFormat(1, 32, 64, 32), 2, 4, 1, [3, 1, 2], 24),
    (KiviFormat(2, 32, 96, 32), 1, 8, 2, [2, 3], 37),
    (KiviFormat(2, 64, 64, 16), 2, 1, 1, [1, 2], 5),
    (KiviFormat(1, 64, 64, 64), 1, 8, 2, [2, 1, 1], 64),
    (KiviFormat(2, 16, 64, 16, midpoint_one_bit=False), 2, 4, 1, [1, 0, 3], 16),
    (KiviFormat(1, 32, 64, 32), 2, 2, 2, [2, 3], 20),  # several KV heads, two query rows
]


def _case_id(case):
    fmt, h_kv, gqa, s_q, counts, k = case
    return f"{fmt.bits}b-G{fmt.group}-d{fmt.head_dim}-hkv{h_kv}-gqa{gqa}-sq{s_q}-k{k}"


def _mixed(impl, r, tokens, slot_k, slot_v):
    """The quantized pass by ``impl`` with the slots swapped in, and the pass's LSE."""
    quant = IMPLS[impl](r.q, r.pool, r.table, r.count, r.fmt, r.scale, None)
    return swap_in_exact(quant[:2], r.q, r.pool, r.table, r.count, r.fmt, r.scale, tokens,
                         slot_k, slot_v), quant[1]


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("case", MIXED_CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapped_in_slots_equal_the_mixed_cache(impl, case, dtype, kernel_device, monkeypatch):
    fmt, h_kv, gqa, s_q, counts, k = case
    _two_group_blocks(monkeypatch, fmt, h_kv, len(counts))
    r = Requests(fmt, h_kv, gqa, s_q, counts, dtype, _device(impl, kernel_device))
    tokens = r.random_tokens(k)
    slot_k, slot_v = r.slots(tokens)
    residual_k = torch.randn(len(counts), 9, h_kv, fmt.head_dim).to(dtype)
    residual_v = torch.randn(len(counts), 9, h_kv, fmt.head_dim).to(dtype)
    part, pass_lse = _mixed(impl, r, tokens, slot_k, slot_v)
    assert part[0].dtype == dtype
    out, lse = _with_residual(r, part, residual_k, residual_v)
    want_out, want_lse = _mixed_cache_reference(r, tokens, residual_k, residual_v)
    # bf16: the pass's P.V and its output are bf16 (16-bit dots on CUDA). The swap subtracts the
    # slots' low-bit share from the pass, which scales the pass's rounding by its weight over
    # what is left (1-20x on these inputs where 1-bit keys overrate the top-k): so does atol.
    tol = 1e-4 if dtype == torch.float32 and not r.q.is_cuda else 2e-2
    gain = torch.exp(pass_lse.cpu() - part[1].cpu()).nan_to_num(1.0).clamp_min(1.0)
    excess = (out.float() - want_out).abs() - tol * (gain.unsqueeze(-1) + want_out.abs())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} of {excess.numel()} outputs off by up "
                               f"to {excess.max().item():.3g} past atol {tol} x {gain.max().item():.3g}")
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("case", MIXED_CASES, ids=_case_id)
def test_quant_logits_and_top_k_match_brute_force(impl, case, kernel_device, monkeypatch):
    fmt, h_kv, gqa, _, counts, k = case
    _two_group_blocks(monkeypatch, fmt, h_kv, len(counts))
    r = Requests(fmt, h_kv, gqa, 1, counts, torch.bfloat16, _device(impl, kernel_device))
    row = r.q[:, 0]  # [B, h_q, d]
    with ops.kernel_mode(KERNEL_MODES[impl]):
        logits = ops.quant_logits(row, r.pool, r.table, r.count, fmt, r.scale)
    assert logits.shape == (len(counts), h_kv * gqa, max(counts) * fmt.group)
    # Compiled for CUDA, the kernel's dots on 16-bit queries are tf32 (about 1e-3 relative).
    tol = 3e-3 if logits.is_cuda else 1e-4
    logits = logits.cpu()
    other_lse = torch.randn(len(counts), h_kv * gqa) * 3  # the residual's share of each row
    chosen = top_k_tokens(logits, other_lse, h_kv, k)
    assert chosen.shape == (len(counts), h_kv, k) and chosen.dtype == torch.int32
    for b, count in enumerate(counts):
        keys, _ = r.dequantized(b)  # [S, h_kv, d]
        heads_keys = keys.cpu().repeat_interleave(gqa, dim=1)  # [S, h_q, d]
        want = torch.einsum("hd,shd->hs", row[b].cpu().float(), heads_keys) * r.scale
        width = count * fmt.group
        torch.testing.assert_close(logits[b, :, :width], want, atol=tol, rtol=tol)
        assert torch.isinf(logits[b, :, width:]).all()
        # Probabilities of the whole row (quantized tokens + the residual), summed per group.
        row_lse = torch.logaddexp(torch.logsumexp(want, dim=-1), other_lse[b])
        scores = torch.exp(want - row_lse[:, None]).view(h_kv, gqa, width).sum(1)
        take = min(k, width)
        for h in range(h_kv):
            ids = chosen[b, h].long()
            assert (ids[take:] == -1).all() and len(set(ids[:take].tolist())) == take
            assert ((ids[:take] >= 0) & (ids[:take] < width)).all()
            # Ties may pick different tokens: compare the chosen scores, not the ids.
            got = scores[h, ids[:take]].sort().values
            best = scores[h].topk(take).values.sort().values
            torch.testing.assert_close(got, best, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("case", MIXED_CASES, ids=_case_id)
def test_logits_row_from_the_attention_pass(impl, case, kernel_device, monkeypatch):
    """SpeCache's single pass: the attention also returns one query row's logits over every
    token, equal to quant_logits of that row, and leaves the attention itself unchanged."""
    fmt, h_kv, gqa, s_q, counts, k = case
    _two_group_blocks(monkeypatch, fmt, h_kv, len(counts))
    r = Requests(fmt, h_kv, gqa, s_q, counts, torch.bfloat16, _device(impl, kernel_device))
    plain = IMPLS[impl](r.q, r.pool, r.table, r.count, fmt, r.scale)
    for row in range(s_q):
        out, lse, logits = IMPLS[impl](r.q, r.pool, r.table, r.count, fmt, r.scale,
                                       logits_row=row)
        torch.testing.assert_close((out, lse), plain, atol=1e-6, rtol=1e-6)
        with ops.kernel_mode(KERNEL_MODES[impl]):
            want = ops.quant_logits(r.q[:, row], r.pool, r.table, r.count, fmt, r.scale)
        assert logits.shape == want.shape == (len(counts), h_kv * gqa, max(counts) * fmt.group)
        # On CUDA the attention pass takes 16-bit dots (bf16 keys: logits off by up to 0.02 on
        # an H200), quant_logits tf32 ones.
        tol = 4e-2 if logits.is_cuda else 1e-5
        torch.testing.assert_close(logits, want, atol=tol, rtol=tol)
        # The caller's host-side max(group_count) (no device read) gives the same bits.
        told = IMPLS[impl](r.q, r.pool, r.table, r.count, fmt, r.scale, logits_row=row,
                           most_groups=max(counts))
        for a, b in zip(told, (out, lse, logits)):
            assert torch.equal(a, b)
        with ops.kernel_mode(KERNEL_MODES[impl]):
            assert torch.equal(ops.quant_logits(r.q[:, row], r.pool, r.table, r.count, fmt,
                                                r.scale, max(counts)), want)


@_needs_native
@pytest.mark.parametrize("h_kv, gqa, width, k", [(2, 4, 37, 5), (1, 8, 300, 64), (3, 1, 9, 12),
                                                 (2, 3, 0, 4)])
def test_c_top_k_equals_the_reference(h_kv, gqa, width, k):
    """The C top-k against mixed_attention.top_k_tokens: ragged rows (-inf past a request's
    tokens, a request without any), other keys' LSE of -inf, k above the width."""
    batch = 4
    logits = torch.randn(batch, h_kv * gqa, width) * 4
    lengths = [width, width // 2, 0, max(width - 3, 0)]
    for b, n in enumerate(lengths):
        logits[b, :, n:] = float("-inf")
    other_lse = torch.randn(batch, h_kv * gqa) * 3
    other_lse[1] = float("-inf")
    got = native.top_k_tokens(logits, other_lse, h_kv, k)
    want = top_k_tokens(logits, other_lse, h_kv, k)
    assert got.shape == want.shape and got.dtype == want.dtype
    for b in range(batch):
        for h in range(h_kv):
            assert sorted(got[b, h].tolist()) == sorted(want[b, h].tolist())


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_logits_row_without_groups(impl, kernel_device):
    """A batch whose requests hold no groups yet: empty logits, as quant_logits gives."""
    fmt, h_kv, gqa, s_q = KiviFormat(1, 32, 64, 32), 2, 4, 1
    r = Requests(fmt, h_kv, gqa, s_q, [0, 0], torch.bfloat16, _device(impl, kernel_device))
    out, lse, logits = IMPLS[impl](r.q, r.pool, r.table, r.count, fmt, r.scale, logits_row=0)
    assert logits.shape == (2, h_kv * gqa, 0) and torch.isinf(lse).all()


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("bits, gqa", [(1, 4), (2, 8), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_covering_the_context_is_exact_attention(impl, bits, gqa, dtype, kernel_device):
    """The "current" mode end to end: one pass over the low-bit keys, the output row's top-k
    from its logits, fetched exact and swapped in, merged with the residual; with k covering
    the prompt it is exact attention (no rounding left of the low-bit pass, in bf16 too)."""
    fmt = KiviFormat(bits, 32, 64, 32)
    counts = [2, 3, 1]
    r = Requests(fmt, 2, gqa, 1, counts, dtype, _device(impl, kernel_device))
    residual_k = torch.randn(len(counts), 5, 2, 64).to(dtype)
    residual_v = torch.randn(len(counts), 5, 2, 64).to(dtype)
    residual = attention_with_lse_reference(r.q.cpu().float(), residual_k.transpose(1, 2).float(),
                                            residual_v.transpose(1, 2).float(), None, r.scale)
    quant = IMPLS[impl](r.q, r.pool, r.table, r.count, fmt, r.scale, 0)
    tokens = top_k_tokens(quant[2], residual[1][:, 0].to(quant[2].device), 2, 3 * fmt.group)
    slot_k, slot_v = r.slots(tokens)
    part = swap_in_exact(quant[:2], r.q, r.pool, r.table, r.count, fmt, r.scale, tokens, slot_k,
                         slot_v)
    out, lse = _with_residual(r, part, residual_k, residual_v)
    for b, (keys, values) in enumerate(r.exact):
        want_out, want_lse = _attend(r.q[b].cpu(), torch.cat([keys.cpu(), residual_k[b]]),
                                     torch.cat([values.cpu(), residual_v[b]]), r.scale)
        # bf16: the output's own rounding, nothing of the low-bit pass.
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[b].float(), want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[b], want_lse, atol=1e-4, rtol=1e-4)
