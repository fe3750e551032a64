"""CPU kernels of the compute-heavy stages of decode (and of MiniKV's prefill scores), compiled
by torch.compile (inductor's C++ backend), with the signatures of their torch references in
reconstruct.py, quant_attention.py (attention over KIVI groups: each bounded block
dequantized in one fused pass, QK^T and PV as GEMMs), mixed_attention.py (one row's logits over
KIVI keys, SpeCache's top-k), critical_channels.py (TailorKV's partial scores),
heavy_hitters.py (a tile of MiniKV's column sums), and rope.py and landmarks.py (the RoPE
inversion and chunk geometry of ShadowKV's prompt end).

Eager torch spends these stages copying: the missed A rows gathered by advanced indexing, RoPE
as a dozen elementwise passes. Here the missed A rows are gathered by ``index_select`` and the
rest is compiled: the rebuild matmul + RoPE (measured in benchmarks/RESULTS.md). ShadowKV's
landmark scoring is a C kernel (native.py): compiled, it cost a graph call per request and ran
at 12 GFLOP/s. Tested against the references in tests/core/test_kernels.py.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
import types

import torch
from torch.fx.experimental import _config as fx_config

from . import critical_channels, heavy_hitters, landmarks, native, reconstruct, rope as rope_ops
from .kivi import unpack_codes
from .rope import RopeCache


@functools.cache
def available() -> bool:
    """Inductor's CPU backend compiles C++: a compiler must be on the path."""
    return shutil.which("g++") is not None or shutil.which("c++") is not None


def _one_graph(compiled, dynamic_dims: tuple[tuple[int, ...], ...] = ()):
    """One graph for every size a server meets. Duck sizing gives dimensions of equal size at the
    first trace one symbol (128 missed key rows and head_dim 128), so the next step's other miss
    count recompiled mid-decode (about 1 s on the CPU): traced without it. ``dynamic_dims``
    (per positional argument, the dims whose size varies between calls) are marked dynamic at
    the first trace of a ``dynamic=None`` function, whose other sizes stay constants of the
    graph; unmarked, each size seen changing compiled yet another graph."""

    @functools.wraps(compiled)
    def call(*args):
        for arg, dims in zip(args, dynamic_dims):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(arg, dim)
        duck = fx_config.use_duck_shape  # (set by hand: fx_config.patch cost 15 us a call)
        fx_config.use_duck_shape = False
        try:
            return compiled(*args)
        finally:
            fx_config.use_duck_shape = duck

    return call


def _compiled(fn):
    return _one_graph(torch.compile(fn, dynamic=True, fullgraph=True))


def _compiled_per_width(fn, bits: int, variant: str = ""):
    """``fn`` (a closure over ``bits``) compiled with a code object of its own. Dynamo keeps its
    graphs per code object: the closures of one ``def`` for two bit widths shared them, and the
    second width recompiled the first's graph with ``bits`` symbolic (automatic dynamic), which
    made the unpacking 10x slower (a 1-bit block after a 2-bit one in one process, 2026-11-27)
    and fails in torch 2.11's dynamo. The bit width must be a constant of the graph."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{bits}bit{variant}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(own, dynamic=None, fullgraph=True)


# Each dtype, head size and RoPE style is a graph of its own; a server sees one or two, the
# tests a dozen. Past the limit dynamo would quietly run the functions eagerly.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


# ShadowKV's prompt end: eagerly each is a dozen elementwise passes over the prompt's keys (0.37 s
# of a 16K layer's 0.78 s compression at Llama-3.1-8B shapes, 1 thread); compiled, one or two.
def _invert_rope(x, positions, cos_sin, rotary_dim, neox):
    return rope_ops.invert_rope(x, positions, RopeCache(cos_sin, rotary_dim, neox))


_compiled_invert_rope = _compiled(_invert_rope)


def invert_rope(x, positions, rope):
    return _compiled_invert_rope(x, positions, rope.cos_sin_cache, rope.rotary_dim,
                                 rope.is_neox_style)


chunk_geometry = _compiled(landmarks.chunk_geometry)


def _last_dim_sums(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last dimension (kept, size 1) as a GEMM with a column of ones, inside a
    compiled graph: inductor's float sum guards its length on the side of 4,096 its first trace
    saw (its accumulation helper for longer sums), so after the warm-up's short requests the
    first longer one compiled again mid-serving (a quantized block over 4,096 tokens)."""
    return torch.matmul(x, x.new_ones(x.shape[-1], 1))


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether bf16 operands multiply as they are (oneDNN's bf16 GEMM, fp32 accumulation) rather
    than converted to fp32 first: the quantized blocks' P and V (``_quant_block``). Whichever
    this CPU runs faster, timed once per process (on the shape of ShadowKV's key rebuild, where
    it was first used). The flag alone does not decide it: with
    AVX512-BF16, the bf16 GEMM ran 2.8x the fp32 rate on an EPYC and 0.54x on a Xeon (both in
    benchmarks/RESULTS.md); without it oneDNN emulates bf16, slower than fp32."""
    supported = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # private: may go
    if not (supported and supported()):
        return False
    rows, b = torch.randn(8, 224, 160).bfloat16(), torch.randn(8, 160, 128).bfloat16()

    def fastest(product) -> float:
        product()  # oneDNN builds its kernel at the first call
        times = []
        for _ in range(5):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        return min(times)

    bf16 = fastest(lambda: torch.matmul(rows, b))
    return bf16 < fastest(lambda: torch.matmul(rows.float(), b.float()))


def scatter_values(staging, staging_start, miss_slots, miss_count, slot_v):
    """Same contract as reconstruct.scatter_values, each miss's c x d rows written by
    ``_write_slots``."""
    batch, h_kv, k = miss_slots.shape
    width = int(miss_count.max()) if miss_count.numel() else 0
    if width == 0:
        return
    valid = torch.arange(width) < miss_count.unsqueeze(-1)  # [B, h, w]
    src = (staging_start.long().unsqueeze(-1) + torch.arange(width))[valid]
    picked = valid.flatten().nonzero().squeeze(1)
    # The decode step stages the misses in exactly this order: no gather needed then.
    in_order = torch.equal(src, torch.arange(len(staging)))
    _write_slots(slot_v.unflatten(2, (k, -1)), miss_slots[..., :width].long(), picked, staging,
                 None if in_order else src)


def _write_slots(slots: torch.Tensor, dest: torch.Tensor, picked: torch.Tensor,
                 src: torch.Tensor, src_index: torch.Tensor | None) -> None:
    """Rows of ``src`` [M, ...] (``src_index`` [n] of them, else the first n) into ``slots``
    [B, h, S, ...]: row i at position ``dest[b, h, w]`` of the entry ``picked[i]`` (flat index
    into ``dest`` [B, h, W]). Contiguous slots take one ``copy_rows`` into their flat rows:
    advanced indexing on both sides cost 2.5x."""
    if not slots.is_contiguous():
        rows = src if src_index is None else src.index_select(0, src_index)
        bi, hi, wi = torch.unravel_index(picked, dest.shape)
        slots[bi, hi, dest[bi, hi, wi]] = rows.to(slots.dtype)
        return
    batch, h_kv, width = slots.shape[:3]
    slots = slots.view(batch * h_kv * width, *slots.shape[3:])
    rows = dest + torch.arange(batch * h_kv, device=dest.device).view(batch, h_kv, 1) * width
    copy_rows(slots.view(len(slots), -1), rows.flatten().index_select(0, picked),
              src.reshape(src.shape[0], -1), src_index)


def copy_rows(dst, index, src, src_index=None):
    """The CPU's row copy: the C kernel (native.py) where it takes the tensors, else the
    reference (eager ``index_copy_`` copies element by element, at half index_select's rate)."""
    (native if native.supports_copy(dst, src) else reconstruct).copy_rows(dst, index, src,
                                                                          src_index)


@_compiled
def _partial_scores(q_crit: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """critical_channels.partial_scores with the keys' conversion to fp32 fused into the
    product (eager: a fp32 copy of the gathered rows, then a matmul with one row)."""
    return (keys.float() * q_crit[:, :, None]).sum(dim=1)


def channel_scores(q, keys_cm, channels, key_start, prompt_len, sink, recent, max_len):
    return critical_channels.scores_per_request(q, keys_cm, channels, key_start, prompt_len,
                                                sink, recent, max_len, _partial_scores)


_compiled_column_sum_tile = torch.compile(heavy_hitters.column_sum_tile, dynamic=None,
                                          fullgraph=True)


def column_sum_tile(logits, scale):
    """The max, exp and reductions of a tile of MiniKV's column sums compiled over the GEMM's
    16-bit logits (eager: five passes over fp32 copies). Its sizes are unbacked symbols: one
    graph for every tile. Backed, they were specialised at 1 (one row done again) and guarded at
    4096 (inductor's accumulation helper for longer reductions): a prompt longer than the
    warm-up's compiled again while serving."""
    torch._dynamo.decorators.mark_unbacked(logits, 0)
    torch._dynamo.decorators.mark_unbacked(logits, 1)
    return _compiled_column_sum_tile(logits, scale)


def _codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words [..., W] int32 -> codes [..., W, 32 // bits] fp32. One-bit codes are tested against
    a vector of constant masks: the 32-lane vector shift inductor emits for them ran 4-8x slower
    than this (a block's 1-bit keys, 2026-11-27)."""
    if bits == 1:
        lanes = torch.arange(32, dtype=torch.int32, device=words.device)
        masks = torch.bitwise_left_shift(torch.ones_like(lanes), lanes)  # bit 31: the sign bit
        return ((words.unsqueeze(-1) & masks) != 0).float()
    return unpack_codes(words, bits).unflatten(-1, (words.shape[-1], -1)).float()


def _dequantized_keys(key_codes, key_scale, key_zero, bits: int) -> torch.Tensor:
    """codes [R, n, T, W], scale/zero [R, n, d] -> keys [R, n * T, d] fp32. Computed as
    [R, n, T, W, codes per word] so that inductor's innermost loop runs over one word's codes
    (shifts by a vector of constants): over d, the word index c // per_word kept the loop scalar
    (4x slower)."""
    rows, n, tokens, words = key_codes.shape
    per_word = 32 // bits
    codes = _codes(key_codes, bits)  # [R, n, T, W, per_word]
    scale = key_scale.view(rows, n, 1, words, per_word).float()
    zero = key_zero.view(rows, n, 1, words, per_word).float()
    return (codes * scale + zero).reshape(rows, n * tokens, words * per_word)


def _dequantized_values(value_codes, value_scale, value_zero, bits: int, lanes: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """codes [R, n, T, W], scale/zero [R, n, T, d / vg] -> values [R, n * T, d] in ``dtype``
    (converted before the reshape: after it, the loop over d went scalar). The
    innermost loop runs over ``lanes`` channels, within one word and one value group (as for
    the keys: an index dividing it made the loop scalar): a constant of the graph, since the
    sizes it comes from may be symbolic."""
    rows, n, tokens, words = value_codes.shape
    groups = value_scale.shape[-1]
    head_dim = words * 32 // bits
    codes = _codes(value_codes, bits).view(rows, n, tokens, groups, -1, lanes)
    scale = value_scale.float()[..., None, None]
    zero = value_zero.float()[..., None, None]
    return (codes * scale + zero).to(dtype).reshape(rows, n * tokens, head_dim)


@functools.cache
def _quant_block(bits: int, value_lanes: int, logits_row: int | None = None,
                 bf16_values: bool = False):
    """The compiled attention over one block of gathered groups, for ``bits``-bit codes. The
    bit widths must be constants of the graph (``_compiled_per_width``): symbolic (an argument,
    or a closure under ``dynamic=True``) they made the unpacking 10x slower; ``dynamic=None``
    still makes the sizes dynamic once they change. ``value_lanes``: see
    ``_dequantized_values``. With ``logits_row`` (a graph constant too) the block also returns
    that query row's logits. ``bf16_values``: P and V multiply in bf16 (fp32 accumulation,
    as FlashAttention multiplies them; the logits stay fp32), where the CPU's bf16 GEMM is the
    faster one (``native_bf16_gemm``; measured in benchmarks/RESULTS.md, "Quantized decode
    blocks on the CPU")."""

    def block(q: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor,
              key_zero: torch.Tensor, value_codes: torch.Tensor, value_scale: torch.Tensor,
              value_zero: torch.Tensor, valid: torch.Tensor, scale: float):
        """q [R, s, g, d]; the gathered groups of each row: codes [R, n, T, W], key
        scale/zero [R, n, d], value scale/zero [R, n, T, d / vg]; valid [R, n * T] the row's
        tokens. -> out [R, s, g, d] fp32, lse [R, s, g] (and with ``logits_row`` its logits
        [R, g, n * T], -inf where not valid).
        One fused pass unpacks and dequantizes the block's K (then V), and QK^T and PV are
        GEMMs: 2.2-3x the broadcast sums that never wrote the dequantized block (inductor
        ran those at about 2 GFLOP/s without AVX-512). The block is bounded
        (quant_attention.BLOCK_BYTES), never the whole context."""
        rows, n, tokens, _ = key_codes.shape
        s_q, group, head_dim = q.shape[1:]
        k = _dequantized_keys(key_codes, key_scale, key_zero, bits)
        logits = torch.matmul(q.float().reshape(rows, s_q * group, head_dim),
                              k.transpose(1, 2)) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        row_max = logits.amax(-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(logits - row_max)
        denom = _last_dim_sums(p)
        dtype = torch.bfloat16 if bf16_values else torch.float32
        v = _dequantized_values(value_codes, value_scale, value_zero, bits, value_lanes, dtype)
        out = torch.matmul(p.to(dtype), v).float()
        out = out / denom.clamp_min(torch.finfo(torch.float32).tiny)
        lse = (row_max + torch.log(denom)).view(rows, s_q, group)  # log(0) = -inf: no keys
        if logits_row is None:
            return out.view(rows, s_q, group, head_dim), lse
        return (out.view(rows, s_q, group, head_dim), lse,
                logits.view(rows, s_q, group, -1)[:, logits_row])

    # rows (requests x KV heads), query rows, groups per block vary; the rest is the format's
    variant = (f"_lanes{value_lanes}" + ("" if logits_row is None else f"_row{logits_row}")
               + ("_bf16" if bf16_values else ""))
    return _one_graph(_compiled_per_width(block, bits, variant), ((0, 1),) * 8)


def _per_kv_head(field: torch.Tensor, ids: torch.Tensor, batch: int, h_kv: int) -> torch.Tensor:
    """A block's groups of one KV-group field, ``[B * n, h_kv, ...]`` pool entries ``ids``, as
    one row per (request, KV head): ``[B * h_kv, n, ...]``."""
    part = torch.index_select(field, 0, ids).unflatten(0, (batch, -1)).transpose(1, 2)
    return part.reshape(batch * h_kv, -1, *field.shape[2:])


@functools.cache
def _logits_block(bits: int):
    """The compiled logits of one query row per (request, KV head) over one block of gathered
    key groups (``bits`` a graph constant, as in ``_quant_block``)."""

    def block(q: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor,
              key_zero: torch.Tensor, valid: torch.Tensor, scale: float):
        """q [R, g, d]; codes [R, n, T, W], scale/zero [R, n, d]; valid [R, n * T] -> logits
        [R, g, n * T] fp32 (-inf where not valid): the block's keys dequantized in one fused
        pass, then one GEMM (as in ``_quant_block``)."""
        k = _dequantized_keys(key_codes, key_scale, key_zero, bits)
        logits = torch.matmul(q.float(), k.transpose(1, 2))
        return (logits * scale).masked_fill(~valid[:, None, :], float("-inf"))

    return _one_graph(_compiled_per_width(block, bits), ((0,),) + ((0, 1),) * 3 + ((0, 1),))


def quant_logits(q, groups, group_table, group_count, fmt, scale):
    """Same contract as core.mixed_attention.quant_logits."""
    from .quant_attention import group_blocks

    batch, h_q, head_dim = q.shape
    h_kv = groups.key_codes.shape[1]
    rows = q.reshape(batch * h_kv, h_q // h_kv, head_dim)  # one row per (request, KV head)
    blocks = []
    for ids, valid in group_blocks(group_table, group_count, fmt, groups):
        picked = [_per_kv_head(field, ids, batch, h_kv)
                  for field in (groups.key_codes, groups.key_scale, groups.key_zero)]
        valid = valid.expand(batch, h_kv, -1).flatten(0, 1)
        blocks.append(_logits_block(fmt.bits)(rows, *picked, valid, scale).view(
            batch, h_q, -1))
    if not blocks:
        return q.new_full((batch, h_q, 0), float("-inf"), dtype=torch.float32)
    return torch.cat(blocks, dim=-1)


def quant_attention(q, groups, group_table, group_count, fmt, scale, logits_row=None):
    """Same contract as core.quant_attention.quant_attention; blocks of groups gathered by
    ``index_select`` and attended by one compiled pass each, merged by LSE."""
    from .attention import merge_attention
    from .quant_attention import group_blocks

    batch, s_q, h_q, head_dim = q.shape
    h_kv = groups.key_codes.shape[1]
    width = int(group_count.max()) if batch else 0
    if width == 0:
        out = torch.zeros_like(q), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        return out if logits_row is None else (
            *out, q.new_empty((batch, h_q, 0), dtype=torch.float32))
    rows = q.view(batch, s_q, h_kv, h_q // h_kv, head_dim).transpose(1, 2).reshape(
        batch * h_kv, s_q, h_q // h_kv, head_dim)  # one row per (request, KV head)
    # The value loop's lanes: within one word and one value group.
    block = _quant_block(fmt.bits, math.gcd(fmt.codes_per_word, fmt.value_group), logits_row,
                         q.dtype == torch.bfloat16 and native_bf16_gemm())
    outs, lses, logits = [], [], []
    for ids, valid in group_blocks(group_table, group_count, fmt, groups):
        picked = [_per_kv_head(field, ids, batch, h_kv) for field in groups]
        valid = valid.expand(batch, h_kv, -1).flatten(0, 1)  # [B * h_kv, n * G]
        result = block(rows, *picked, valid, scale)
        outs.append(result[0])
        lses.append(result[1])
        if logits_row is not None:
            logits.append(result[2].reshape(batch, h_q, -1))  # a strided row of the block
    out, lse = merge_attention(outs, lses)
    out = out.view(batch, h_kv, s_q, h_q // h_kv, head_dim).transpose(1, 2)
    lse = lse.view(batch, h_kv, s_q, h_q // h_kv).transpose(1, 2)
    out, lse = out.reshape(q.shape).to(q.dtype), lse.reshape(batch, s_q, h_q)
    return (out, lse) if logits_row is None else (out, lse, torch.cat(logits, dim=-1))
