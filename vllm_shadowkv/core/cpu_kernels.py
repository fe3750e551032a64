"""CPU kernels of the compute-heavy stages of decode (and of MiniKV's prefill scores), compiled
by torch.compile (inductor's C++ backend), with the signatures of their torch references in
select.py, reconstruct.py, quant_attention.py (attention over KIVI groups: each bounded block
dequantized in one fused pass, QK^T and PV as GEMMs), mixed_attention.py (one row's logits over
KIVI keys, SpeCache's top-k), critical_channels.py (TailorKV's partial scores),
heavy_hitters.py (a tile of MiniKV's column sums), and rope.py and landmarks.py (the RoPE
inversion and chunk geometry of ShadowKV's prompt end).

Eager torch spends these stages copying: the landmarks converted to fp32 and permuted before
a matmul with four columns, the missed A rows gathered by advanced indexing, RoPE as a dozen
elementwise passes. Here the scoring reads each request's landmark rows in place, as strided
views of its runs of pages (a gather of 16K rows at 128K cost as much as the scoring itself;
an index gather inside the compiled loop ran 2x to 5x slower), the missed A rows are gathered
by ``index_select`` and the rest is compiled: the scoring one fused pass per run of pages, the
rebuild matmul + RoPE (measured in benchmarks/RESULTS.md). Tested against the references in
tests/core/test_kernels.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import time
import types

import torch
from torch.fx.experimental import _config as fx_config

from . import critical_channels, heavy_hitters, landmarks, reconstruct, rope as rope_ops
from .kivi import unpack_codes
from .rope import RopeCache, apply_rope


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


def _page_logits(q: torch.Tensor, pages: torch.Tensor, count: int, scale: float) -> torch.Tensor:
    """q [s_q, h_q, d]; pages [m, p, h_kv, d]: landmark rows in place (any strides), the first
    ``count`` valid -> logits [s_q, h_kv, g, count] fp32 (landmarks last: the softmax's rows).
    Compiled (``_compiled_page_logits``): one pass, the products and the reduction over d fused
    (reading the pages in place: a gather first cost as much as this)."""
    s_q, h_q, head_dim = q.shape
    h_kv = pages.shape[2]
    qg = q.float().reshape(s_q, h_kv, h_q // h_kv, head_dim)
    rows = pages.float()
    # One reduction over d per query row, stacked (the row stays in cache between them): the
    # products of all a group's rows at once ([..., g, d] then a sum) ran at 0.74x of this.
    logits = torch.stack([torch.stack([(rows * qg[s, :, j]).sum(-1) for j in range(qg.shape[2])])
                          for s in range(s_q)])  # [s_q, g, m, p, h_kv]
    return (logits.flatten(2, 3)[:, :, :count] * scale).permute(0, 3, 1, 2).contiguous()


def _last_dim_sums(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last dimension (kept, size 1) as a GEMM with a column of ones, inside a
    compiled graph: inductor's float sum guards its length on the side of 4,096 its first trace
    saw (its accumulation helper for longer sums), so after the warm-up's short requests the
    first longer one compiled again mid-serving (a quantized block over 4,096 tokens, a request
    of over 4,096 landmarks)."""
    return torch.matmul(x, x.new_ones(x.shape[-1], 1))


def _chunk_scores(logits: torch.Tensor) -> torch.Tensor:
    """[s_q, h_kv, g, n] -> [h_kv, n]: softmax over the landmarks, sum over the query tokens,
    max over the group's query heads (see select.landmark_scores); the softmax's sums by
    ``_last_dim_sums``."""
    exp = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    return (exp / _last_dim_sums(exp)).sum(dim=0).amax(dim=1)


def _page_scores(q: torch.Tensor, pages: torch.Tensor, count: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """A request whose landmarks are one run of pages (the common case): scores [h_kv, m * p]
    (valid up to ``count``, a 0-d tensor) in one compiled pass. Logits and softmax compiled apart
    cost 1.45 ms per request at 16K against 1.05 here; with every size symbolic (``_compiled``)
    1.7: only the page count varies here, so the loops over p, h_kv and d stay constant."""
    logits = _page_logits(q, pages, pages.shape[0] * pages.shape[1], scale)
    valid = torch.arange(logits.shape[-1], device=logits.device) < count
    return _chunk_scores(logits.masked_fill(~valid, float("-inf")))


_compiled_page_scores = _one_graph(torch.compile(_page_scores, dynamic=None, fullgraph=True),
                                   ((), (0,)))
# Called only with two pages or more (a single page, a handful of rows, runs eagerly): sizes
# 0 and 1 would each compile a graph of their own, in the middle of serving.
_compiled_page_logits = _compiled(_page_logits)
_compiled_chunk_scores = _compiled(_chunk_scores)


MAX_RUNS = 16  # more runs of pages than this: one gather, then one pass


def _landmark_pages(landmarks: torch.Tensor, rows: torch.Tensor):
    """One request's landmark rows as ``[(pages [m, p, h_kv, d], valid rows in them)]``: views
    in place, one per run of pages that lie at one stride (vLLM hands a request's blocks out
    mostly in order, so a request is one or a few runs), each page holding ``p`` rows at one
    stride. A partly filled last page joins its run whole (its rows past the valid count are
    masked, not read into the scores), so the common request is one run and one compiled call;
    where the storage ends before that page does, it is a run of its own. Rows in no such
    pattern are gathered (``_gathered``)."""
    n = rows.numel()
    if n < 2:
        return _gathered(landmarks, rows)
    steps = rows[1:] - rows[:-1]
    page_starts = (steps != steps[0]).nonzero().flatten() + 1  # rows that open a page
    per_page = int(page_starts[0]) if page_starts.numel() else n
    full, tail = divmod(n, per_page)
    num_pages = full + (tail > 0)
    if (page_starts.numel() != num_pages - 1 or bool((page_starts % per_page).any())
            or int(steps[0]) <= 0):
        return _gathered(landmarks, rows)  # pages of unequal row counts, rows not ascending
    firsts = rows[::per_page]
    jumps = firsts[1:] - firsts[:-1]
    ascending = jumps[jumps > 0]  # (views take no negative strides)
    stride = int(torch.mode(ascending).values) if ascending.numel() else 0
    breaks = ((jumps != stride).nonzero().flatten() + 1).tolist()
    if len(breaks) >= MAX_RUNS:
        return _gathered(landmarks, rows)
    row_stride, (s_n, s_h, s_d) = int(steps[0]), landmarks.stride()
    firsts = firsts.tolist()

    def view(first_page: int, pages: int, per: int):
        return torch.as_strided(landmarks, (pages, per, *landmarks.shape[1:]),
                                (stride * s_n, row_stride * s_n, s_h, s_d),
                                landmarks.storage_offset() + firsts[first_page] * s_n)

    last_row = (firsts[-1] + (per_page - 1) * row_stride) * s_n + landmarks.storage_offset()
    end = last_row + (landmarks.shape[1] - 1) * s_h + (landmarks.shape[2] - 1) * s_d
    fits = end < landmarks.untyped_storage().nbytes() // landmarks.element_size()
    joined = num_pages if fits else full  # pages in the runs; a last page apart if not
    views = [(view(a, b - a, per_page), min(b * per_page, n) - a * per_page)
             for a, b in zip([0, *breaks], [*breaks, joined]) if b > a]
    if joined < num_pages:
        views.append((view(full, 1, tail), tail))
    return views


def _gathered(landmarks: torch.Tensor, rows: torch.Tensor):
    """The rows copied out, as pages of two rows (the shape of the runs' graph) and a last row."""
    n = rows.numel()
    picked = torch.index_select(landmarks, 0, rows)
    pairs = [(picked[: n - n % 2].unflatten(0, (-1, 2)), n - n % 2)] if n >= 2 else []
    return pairs + ([(picked[n - 1:].unsqueeze(1), 1)] if n % 2 else [])


def landmark_scores(q, landmarks, lm_rows, lm_start, lm_count, max_count, scale):
    batch = q.shape[0]
    out = q.new_full((batch, landmarks.shape[1], max_count), -1.0, dtype=torch.float32)
    for i, (start, count) in enumerate(zip(lm_start.tolist(), lm_count.tolist())):
        if count:
            # fp32 and storage offset 0 (an offset of 0 or 1 is a graph of its own): converted
            # inside, q cost the loop a conversion per (row, query head), 1.4x the time.
            qi = q[i].to(torch.float32, copy=True)
            runs = _landmark_pages(landmarks, lm_rows[start:start + count])
            if len(runs) == 1 and len(runs[0][0]) > 1:
                pages, n = runs[0]
                out[i, :, :count] = _compiled_page_scores(qi, pages, torch.tensor(n),
                                                          scale)[:, :n]
                continue
            logits = [(_compiled_page_logits if len(pages) > 1 else _page_logits)(
                qi, pages, n, scale) for pages, n in runs]
            out[i, :, :count] = _compiled_chunk_scores(logits[0] if len(logits) == 1 else
                                                       torch.cat(logits, dim=-1))
    return out


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether bf16 operands multiply as they are (oneDNN's bf16 GEMM, fp32 accumulation) rather
    than converted to fp32 first: the rebuild's rows and B, and the quantized blocks' P and V
    (``_quant_block``). Whichever this CPU runs faster, timed once per process on the
    rebuild's shape. The flag alone does not decide it: with
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


@_compiled
def _keys(rows: torch.Tensor, b: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
          rotary_dim: int, neox: bool, native_bf16: bool, out_dtype: torch.dtype
          ) -> torch.Tensor:
    """A rows [B, h, n, r] times B [B, h, r, d], RoPE at ``positions`` [B, h, n] -> [B, h, n, d]
    in ``out_dtype`` (the slots'; RoPE in fp32). bf16 rows and B multiply as they are where the
    CPU has bf16 GEMMs (the Triton kernel's bf16 dot with fp32 accumulation; the product is
    rounded to bf16 once before RoPE), else in fp32. (Gathering the rows inside the compiled
    loop was 2x slower than index_select.)"""
    if native_bf16 and rows.dtype == b.dtype == torch.bfloat16:
        keys = torch.matmul(rows, b).float()
    else:
        keys = torch.matmul(rows.float(), b.float())
    flat = keys.view(-1, 1, keys.shape[-1])
    rope = RopeCache(cos_sin, rotary_dim, neox)
    return apply_rope(flat, positions.reshape(-1), rope, out_dtype).view(keys.shape)


def rebuild_keys(a, a_rows, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, rope,
                 slot_k, slot_index=None):
    batch, h_kv, k = slot_chunks.shape
    c = slot_index.shape[-1] if slot_index is not None else slot_k.shape[2] // k
    width = int(miss_count.max()) if miss_count.numel() else 0
    if width == 0:
        return
    valid = torch.arange(width) < miss_count.unsqueeze(-1)  # [B, h, w]
    slots = miss_slots[..., :width].long().clamp_min(0)
    chunks = slot_chunks.long().gather(-1, slots).clamp_min(0)
    offsets = torch.arange(c)
    rows = a_start.long().view(-1, 1, 1, 1) + chunks.unsqueeze(-1) * c + offsets  # [B,h,w,c]
    rows = torch.where(valid.unsqueeze(-1), rows, 0).flatten(2)  # [B, h, w*c]
    flat = rows.flatten()  # (index_select: 4x faster than indexing by a 3-D index)
    a_picked = torch.index_select(a, 0, a_rows.index_select(0, flat)).view(*rows.shape, a.shape[1])
    positions = a_positions.index_select(0, flat).view(rows.shape)
    keys = _keys(a_picked, b, positions, rope.cos_sin_cache, rope.rotary_dim,
                 rope.is_neox_style, native_bf16_gemm(), slot_k.dtype)
    # Slots of their own: whole chunks of c rows (8x fewer, longer copies than row by row).
    picked = valid.flatten().nonzero().squeeze(1)  # (a boolean index of keys cost 1.3x)
    _write_slots(slot_k if slot_index is not None else slot_k.unflatten(2, (k, c)), slots,
                 picked, keys.reshape(-1, c, keys.shape[-1]), picked, slot_index)


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
                 src: torch.Tensor, src_index: torch.Tensor | None,
                 slot_index: torch.Tensor | None = None) -> None:
    """Rows of ``src`` [M, ...] (``src_index`` [n] of them, else the first n) into ``slots``
    [B, h, S, ...]: row i at position ``dest[b, h, w]`` of the entry ``picked[i]`` (flat index
    into ``dest`` [B, h, W]); with ``slot_index`` [B, h, S, c], ``slots`` is [N, d] (the pages'
    rows), src [M, c, d], and token t of position s of (b, h) is row ``slot_index[b, h, s, t]``.
    Contiguous slots (the engine's) take one ``copy_rows`` into their flat rows: advanced
    indexing on both sides cost 2.5x."""
    if slot_index is None and not slots.is_contiguous():
        rows = src if src_index is None else src.index_select(0, src_index)
        bi, hi, wi = torch.unravel_index(picked, dest.shape)
        slots[bi, hi, dest[bi, hi, wi]] = rows.to(slots.dtype)
        return
    if slot_index is None:  # the slots' own flat rows, by arithmetic
        batch, h_kv, width = slots.shape[:3]
        slots = slots.view(batch * h_kv * width, *slots.shape[3:])
        rows = dest + torch.arange(batch * h_kv, device=dest.device).view(batch, h_kv, 1) * width
    else:  # token rows of the pages (entries not picked may be -1)
        c = slot_index.shape[-1]
        rows = slot_index.gather(2, dest.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, c))
        tokens = torch.arange(c, device=picked.device)
        src_rows = (picked if src_index is None else src_index).unsqueeze(1) * c + tokens
        copy_rows(slots, rows.view(-1, c).index_select(0, picked).flatten(),
                  src.reshape(-1, slots.shape[-1]), src_rows.flatten())
        return
    copy_rows(slots.view(len(slots), -1), rows.flatten().index_select(0, picked),
              src.reshape(src.shape[0], -1), src_index)


# The reference, compiled: its gather, conversion and scatter become one vectorized loop that
# writes into dst in place (2 MiB of rows: 0.29 ms; eager index_copy_ 0.62, element by element).
# dst's size and offset are symbolic: every layer's cache runs the same graph.
_compiled_copy_rows = _compiled(reconstruct.copy_rows)


# Below this many elements a scatter runs eagerly: the compiled call's fixed cost (about 45 us on
# the 2-core Xeon, dynamo's frame and AOT wrappers) is more than eager index_copy_ takes there.
EAGER_COPY_ELEMENTS = 1 << 16
_warming = False


@contextlib.contextmanager
def warming():
    """Every call runs its compiled graph, whatever its size: the start-up warm-up's small
    requests compile the graphs that larger steps run later (not in the middle of serving)."""
    global _warming
    before, _warming = _warming, True
    try:
        yield
    finally:
        _warming = before


def copy_rows(dst, index, src, src_index=None):
    # Fewer than two rows run eagerly: sizes 0 and 1 would each compile a graph mid-serving.
    n = index.numel()
    compiled = n > 1 and (_warming or n * math.prod(dst.shape[1:]) >= EAGER_COPY_ELEMENTS)
    (_compiled_copy_rows if compiled else reconstruct.copy_rows)(dst, index, src, src_index)


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
