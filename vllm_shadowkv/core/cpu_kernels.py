"""CPU kernels of the compute-heavy stages of decode (and of MiniKV's prefill scores), compiled
by torch.compile (inductor's C++ backend), with the signatures of their torch references in
reconstruct.py, critical_channels.py (TailorKV's partial scores), heavy_hitters.py (a tile of
MiniKV's column sums), and rope.py and landmarks.py (the RoPE inversion and chunk geometry of
ShadowKV's prompt end).

Eager torch spends these stages copying (RoPE as a dozen elementwise passes). The decode
step's own kernels are C (native.py): the key rebuild, the landmark scoring (compiled, it cost a
graph call per request and ran at 12 GFLOP/s) and the attention over KIVI groups (compiled,
each bounded block was dequantized into memory before two GEMMs: half the C kernel's speed).
Tested against the references in tests/core/test_kernels.py.
"""

from __future__ import annotations

import functools
import shutil

import torch
from torch.fx.experimental import _config as fx_config

from . import critical_channels, heavy_hitters, landmarks, native, reconstruct, rope as rope_ops
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
