"""Exact attention over a request's exact pages: the engine's path for every method's prefill
and for short requests (and the dense reference of ``measure_fidelity``)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_shadowkv.core import native, ops
from vllm_shadowkv.core.attention import causal_attention_cpu

if TYPE_CHECKING:
    from vllm_shadowkv.backend.layout import PageLayout
    from vllm_shadowkv.methods.base import RequestRows


def exact_view(kv_cache: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """``[num_blocks, exact_per_page, 2 (k, v), h_kv, d]`` view of the layer cache (no copy)."""
    h, d = layout.shapes.num_kv_heads, layout.shapes.head_size
    pages = kv_cache.view(kv_cache.shape[0], -1)[:, : layout.exact_per_page * 2 * h * d]
    return pages.view(-1, layout.exact_per_page, 2, h, d)


def exact_rows(kv_cache: torch.Tensor, layout: PageLayout, blocks: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """Where exact tokens' keys and values lie as rows of ``kv_cache.view(-1, d)``: tokens at
    ``blocks``, ``slots`` ``[B, T]`` -> row ids ``[2 (k, v), B, h_kv, T]`` int64 (the same for
    every layer whose pages have this one's size)."""
    pages = exact_view(kv_cache, layout)
    assert kv_cache.stride(0) % pages.shape[-1] == 0, "the pages are not whole rows of head_dim"
    s_page, s_token, s_kv, s_head = (s // pages.shape[-1] for s in pages.stride()[:4])
    token = (blocks * s_page + slots * s_token).unsqueeze(1)  # [B, 1, T]
    heads = torch.arange(pages.shape[3], device=token.device).view(1, -1, 1) * s_head
    return torch.stack([token + heads + kv * s_kv for kv in (0, 1)])


def exact_kv(kv_cache: torch.Tensor, layout: PageLayout, blocks: torch.Tensor,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, h_kv, T, d]`` (copies) of exact tokens at ``blocks``, ``slots``
    ``[B, T]``."""
    kv = exact_view(kv_cache, layout)[blocks, slots].permute(2, 0, 3, 1, 4)  # [2, B, h, T, d]
    return kv[0], kv[1]


def read_exact(kv_cache, layout: PageLayout, prompt_len: int, block_ids, positions):
    """Keys and values ``[n, h_kv, d]`` of exact tokens at ``positions``."""
    blocks, slots = layout.exact_token_slots(prompt_len, block_ids, positions)
    kv = exact_view(kv_cache, layout)[blocks, slots]  # [n, 2, h, d]
    return kv[:, 0], kv[:, 1]


def write_exact(kv_cache, layout: PageLayout, blocks, slots, key, value) -> None:
    view = exact_view(kv_cache, layout)
    view[blocks, slots, 0] = key if key.dtype == view.dtype else key.to(view.dtype)
    view[blocks, slots, 1] = value if value.dtype == view.dtype else value.to(view.dtype)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The last ``q`` positions of a sequence attend all its ``s`` keys, causally.

    query ``[q, Hq, d]``; key, value ``[s, Hkv, d]`` -> ``[q, Hq, d]``; the model's dtype in
    and out, fp32 accumulation. On CUDA FlashAttention's varlen kernel, where torch has it.
    """
    if query.device.type == "cpu":
        return _cpu_causal_attention(query, key, value, scale)[0]
    q_len, s_len = query.shape[0], key.shape[0]
    if ops.flash_varlen(query):
        cu_seq_q = torch.tensor([0, q_len], dtype=torch.int32, device=query.device)
        cu_seq_k = torch.tensor([0, s_len], dtype=torch.int32, device=query.device)
        return ops.varlen_causal_attention(query, key, value, cu_seq_q, cu_seq_k, q_len, s_len,
                                           scale)[0]
    mask = None
    if 1 < q_len < s_len:  # a later prefill chunk: query i sits at position s - q + i
        rows = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        mask = torch.arange(s_len, device=query.device)[None, :] <= rows
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        attn_mask=mask, is_causal=1 < q_len == s_len, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def prefill_in_c(query, key, value) -> bool:
    """Whether the CPU's causal attention of ``query`` over ``key``/``value`` runs in C
    (``ops.prefill_in_c``), except where vLLM's kernel runs AMX tiles: there it keeps the call,
    the two not having been compared on such a CPU."""
    return (ops.prefill_in_c(query, key, value)
            and _vllm_cpu_isa(query.dtype, query.shape[-1]) != "amx")


def _cpu_causal_attention(query, key, value, scale) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`causal_attention` on the CPU -> (out, lse ``[Hkv, G, q]`` fp32 or None): in C on
    AVX512-BF16 dot products (bf16) or AVX2's fp32 FMAs (bf16, fp16, fp32) where ``prefill_in_c``
    (``native.prefill_attention``: 1.7-2.1x vLLM's CPU kernel on AVX512-BF16, which multiplies
    in fp32 without AMX tiles, 1.4-2.1x on AVX2; benchmarks/RESULTS.md, "Prefill attention in
    C", "Prefill attention on AVX2"), else vLLM's own CPU kernel (no LSE), else torch's flash kernel."""
    if prefill_in_c(query, key, value):
        out, lse = native.prefill_attention(query, key, value, scale)
        return out, lse.unflatten(0, (key.shape[1], -1))
    out = _vllm_cpu_attention(query, key, value, scale)
    return (out, None) if out is not None else causal_attention_cpu(query, key, value, scale)


_VLLM_CPU_BLOCK = 128  # a multiple of 32: every ISA of vLLM's CPU kernels takes it
_VLLM_CPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _vllm_cpu_isa(dtype: torch.dtype, head_dim: int) -> str | None:
    """The ISA vLLM's CPU kernel runs for these inputs; None without a CPU build of vLLM or
    for a head size it does not take (checked once per dtype and head size, not per call)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
    except ImportError:
        return None
    if (not hasattr(torch.ops._C, "cpu_attention_with_kv_cache")
            or head_dim not in CPUAttentionBackend.get_supported_head_sizes()):
        return None
    isa = _get_attn_isa(dtype, _VLLM_CPU_BLOCK, head_dim, "auto")
    if isa == "amx":
        # Linux lets a process use AMX tiles only once it has asked (oneDNN asks at its first
        # AMX GEMM): vLLM's kernel does not, and a process whose first AMX use it is dies of
        # SIGILL (a benchmark calling this before any bf16 GEMM did).
        torch.cpu._init_amx()
    return isa


def _vllm_cpu_attention(query, key, value, scale) -> torch.Tensor | None:
    """The same attention through vLLM's own CPU kernel, what its default CPU backend runs
    (1.15x torch's flash kernel on a 4K SmolLM2 prefill layer), over a one-request paged cache
    filled with ``key``/``value``; None where it does not apply (no CPU build of vLLM, a head
    size or dtype it does not take), and the caller uses torch's flash kernel."""
    q_len, h_q, head_dim = query.shape
    s_len, h_kv, _ = key.shape
    if (s_len == 0 or query.dtype not in _VLLM_CPU_DTYPES
            or not query.dtype == key.dtype == value.dtype):
        return None
    isa = _vllm_cpu_isa(query.dtype, head_dim)
    if isa is None:
        return None
    from vllm import _custom_ops as ops
    from vllm import envs

    block = _VLLM_CPU_BLOCK
    blocks = -(-s_len // block)
    # As CPUAttentionBackendImpl splits its cache: [blocks, h, 2 * block, d] -> K, V.
    cache = torch.empty(blocks, h_kv, 2 * block, head_dim, dtype=key.dtype)
    cache[-1].zero_()  # the kernel reads the last block whole: no NaN from unwritten slots
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                   torch.arange(s_len, dtype=torch.long), isa)
    seq_lens = torch.tensor([s_len], dtype=torch.int32)
    query_start_loc = torch.tensor([0, q_len], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=h_q, num_kv_heads=h_kv, head_dim=head_dim, seq_lens=seq_lens,
        dtype=query.dtype, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype="auto")
    out = torch.empty(q_len, h_q, head_dim, dtype=query.dtype)
    ops.cpu_attention_with_kv_cache(
        query=query.contiguous(), key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True,
        alibi_slopes=None, sliding_window=-1,
        block_table=torch.arange(blocks, dtype=torch.int32)[None], softcap=0,
        scheduler_metadata=metadata, s_aux=None, kv_cache_dtype="auto")
    return out


def exact_attention(kv_cache, layout: PageLayout, prompt_len: int, block_ids, seq_len: int,
                    query: torch.Tensor, scale: float, with_lse: bool = False,
                    read: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A request's causal attention over its exact pages -> (out, lse): lse ``[h_kv, G, q]``
    fp32 if ``with_lse`` and the kernel gives it, else None. Where the Triton kernels run
    (CUDA), one kernel reads the pages in place and gives the LSE with the output; on the CPU
    the tokens are gathered for the C kernel, which gives it too (vLLM's kernel, where the C
    one does not apply, gives none); ``read`` gets the gathered keys and values."""
    positions = torch.arange(seq_len, device=query.device)
    if ops.uses_triton(query):
        blocks, slots = layout.exact_token_slots(prompt_len, block_ids, positions)
        out, lse = ops.paged_causal_attention(query, exact_view(kv_cache, layout), blocks,
                                              slots, scale)
        return out, lse if with_lse else None
    key, value = read_exact(kv_cache, layout, prompt_len, block_ids, positions)
    if read is not None:
        read[:] = key, value
    if query.device.type == "cpu":
        out, lse = _cpu_causal_attention(query, key, value, scale)
        return out, lse if with_lse else None
    return causal_attention(query, key, value, scale), None


# Up to this many query rows, a request on the CPU attends its exact tokens where they lie on
# the pages (decode steps of short requests): vLLM's kernel would first copy its whole context
# into a cache of its own layout, 4-14x the attention's time for one row
# (benchmarks/bench_exact_decode.py).
IN_PLACE_ROWS = 16


def exact_attention_step(kv_cache, layout: PageLayout, reqs: list[RequestRows],
                         query: torch.Tensor, scale: float, with_lse: list[bool],
                         plans: dict | None = None, read: dict | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """`exact_attention` for each of a step's exact requests (prefill chunks, short requests):
    -> (out [q, Hq, d], lse [h_kv, G, q] fp32 or None) per request. ``read`` maps a request's
    index to a list that receives the keys and values of its sequence where they are gathered
    (a prompt's last chunk on the CPU: the method compresses those same tokens next).

    With FlashAttention (CUDA) in one varlen call, as vLLM's FlashAttention backend runs a step.
    On the CPU the requests with few query rows (decodes) in one call of the in-place decode
    attention per row count, where their row ids are planned once per step and page size in
    ``plans`` (kept by the caller for the step's other layers); the others (prefill chunks)
    one call each."""
    if reqs and ops.flash_varlen(query):
        return _flash_step(kv_cache, layout, reqs, query, scale, with_lse)
    # In place only where the pages are whole rows of d (ShadowKV's pages may not be: 16-token
    # blocks of 54 elements a token at d 64); elsewhere the cache seen as rows would straddle.
    rows_tile = kv_cache.stride(0) % query.shape[-1] == 0
    pool = kv_cache.view(-1, query.shape[-1]) if rows_tile else None
    results: list = [None] * len(reqs)
    by_rows: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        if (rows_tile and r.end - r.start <= IN_PLACE_ROWS
                and ops.decode_in_place(query, r.end - r.start, pool)):
            by_rows.setdefault(r.end - r.start, []).append(i)
        else:
            results[i] = exact_attention(kv_cache, layout, r.prompt_len, r.block_ids, r.seq_len,
                                         query[r.start:r.end], scale, with_lse=with_lse[i],
                                         read=(read or {}).get(i))
    plans = {} if plans is None else plans
    for s_q, index in by_rows.items():
        step = [reqs[i] for i in index]
        key = (s_q, kv_cache.stride(0))
        if key not in plans:
            plans[key] = InPlacePlan.of(kv_cache, layout, step, s_q)
        q = torch.stack([query[r.start:r.end] for r in step])  # [B, s_q, Hq, d]
        out, lse = plans[key].attend(q, pool, scale)
        for j, i in enumerate(index):
            results[i] = (out[j], lse[j] if with_lse[i] else None)
    return results


@dataclass(frozen=True)
class InPlacePlan:
    """Row ids of requests with ``s_q`` query rows each over their exact tokens in the pages:
    the tokens before the rows are the decode attention's exact region (``before`` valid of a
    padded ``width``), the rows' own tokens its generated tokens (token j seen by row i when
    j <= i). The same for every layer whose pages have this size."""
    k_rows: torch.Tensor  # [B, h_kv, width + s_q] int64, rows of kv_cache.view(-1, d)
    v_rows: torch.Tensor
    width: int
    before: torch.Tensor  # [B] int64
    no_slots: torch.Tensor  # [B, h_kv, 0]
    gen_before: torch.Tensor  # [B] zeros

    @classmethod
    def of(cls, kv_cache, layout: PageLayout, reqs: list[RequestRows], s_q: int) -> InPlacePlan:
        device = kv_cache.device
        before_list = [r.seq_len - s_q for r in reqs]
        width, before = max(before_list), torch.tensor(before_list, device=device)
        last = (before - 1).clamp(min=0).view(-1, 1)
        positions = torch.cat([  # [B, width + s_q]: padding repeats a valid token, masked
            torch.arange(width, device=device).view(1, -1).expand(len(reqs), -1).minimum(last),
            before.view(-1, 1) + torch.arange(s_q, device=device)], dim=1)
        blocks, slots = layout.exact_token_slots_batch(
            [r.prompt_len for r in reqs],
            torch.nn.utils.rnn.pad_sequence([r.block_ids for r in reqs], batch_first=True),
            positions)
        rows = exact_rows(kv_cache, layout, blocks, slots)
        n, h_kv = len(reqs), rows.shape[2]
        return cls(rows[0], rows[1], width, before,
                   torch.empty(n, h_kv, 0, dtype=torch.int32, device=device),
                   torch.zeros(n, dtype=torch.long, device=device))

    def attend(self, q: torch.Tensor, pool: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, s_q, Hq, d] -> out [B, s_q, Hq, d], lse [B, h_kv, G, s_q] fp32."""
        out, lse = ops.decode_attention(q, pool, self.k_rows, self.v_rows, self.width,
                                        self.before, self.no_slots, 1, self.gen_before, scale)
        return out, lse.transpose(1, 2).unflatten(1, (self.k_rows.shape[1], -1))


def _flash_step(kv_cache, layout: PageLayout, reqs: list[RequestRows], query: torch.Tensor,
                scale: float, with_lse: list[bool]
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The step's exact requests in one FlashAttention varlen call: their tokens gathered out
    of the pages (the kernel's paged form wants pages of a multiple of 256 tokens, more than a
    method's exact page holds), each row's LSE for all."""
    device = query.device
    where = [layout.exact_token_slots(r.prompt_len, r.block_ids,
                                      torch.arange(r.seq_len, device=device)) for r in reqs]
    blocks, slots = torch.cat([b for b, _ in where]), torch.cat([s for _, s in where])
    pages = exact_view(kv_cache, layout)
    key, value = pages[blocks, slots, 0], pages[blocks, slots, 1]  # [Tk, h_kv, d] each
    rows = torch.cat([torch.arange(r.start, r.end, device=device) for r in reqs])
    q_lens = [r.end - r.start for r in reqs]
    q_cut = [0, *itertools.accumulate(q_lens)]
    k_cut = [0, *itertools.accumulate(r.seq_len for r in reqs)]
    cu_seq_q, cu_seq_k = (torch.tensor(c, dtype=torch.int32, device=device)
                          for c in (q_cut, k_cut))
    out, lse = ops.varlen_causal_attention(query[rows], key.to(query.dtype),
                                           value.to(query.dtype), cu_seq_q, cu_seq_k,
                                           max(q_lens), max(r.seq_len for r in reqs), scale)
    h_kv = key.shape[1]
    return [(out[a:b], lse[:, a:b].unflatten(0, (h_kv, -1)).contiguous() if w else None)
            for a, b, w in zip(q_cut, q_cut[1:], with_lse)]
