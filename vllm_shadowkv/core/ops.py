"""The one dispatch point between the torch references and the kernels.

Mode "auto": CUDA tensors go to the Triton kernels (exact attention to torch's FlashAttention
varlen kernel where torch has it), CPU tensors to the compiled CPU kernels
(core/cpu_kernels.py) and the C kernels (core/native.py; both: the references where no C/C++
compiler is installed). "triton" sends every tensor to the Triton kernels (CPU tensors work only
under TRITON_INTERPRET=1: how the kernel path is tested inside the CPU engine); "torch" sends
every tensor to the references (MiniKV's CPU column sums: to the eager GEMM tiles, which
normalise their rows themselves).
"""

import contextlib
import importlib.util
from typing import Literal, get_args

import torch

from . import quant_attention as quant_path
from . import (attention, cpu_kernels, critical_channels, heavy_hitters, landmarks,
               mixed_attention, native, reconstruct, select)
from . import rope as rope_ops

_HAS_TRITON = importlib.util.find_spec("triton") is not None
KernelMode = Literal["auto", "triton", "torch"]
KERNEL_MODES = get_args(KernelMode)
_mode = "auto"


@contextlib.contextmanager
def kernel_mode(mode: str):
    global _mode
    assert mode in KERNEL_MODES, mode
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def force_triton():
    return kernel_mode("triton")


def _use_triton(t: torch.Tensor) -> bool:
    if _mode == "auto":
        # CUDA: checked by tests/core/test_kernels.py and the decode tests on a GPU
        # (scripts/gpu_checks.sh); the same kernels run on the CPU in "triton" mode under
        # TRITON_INTERPRET=1, in the engine (test_triton_kernel_path_in_the_engine_...).
        return _HAS_TRITON and t.is_cuda
    return _mode == "triton"


def compiles(device: torch.device) -> bool:
    """Whether the kernels this mode runs on ``device`` compile on first use: the Triton kernels
    on CUDA, the compiled CPU kernels; not the references, nor Triton's CPU interpreter."""
    t = torch.empty(0, device=device)
    return device.type == "cuda" if _use_triton(t) else compiled_cpu(t)


def _kernels(name: str):
    return importlib.import_module(f"vllm_shadowkv.triton_kernels.{name}")


def uses_triton(t: torch.Tensor) -> bool:
    """Whether work on ``t`` goes to the Triton kernels in the current mode."""
    return _use_triton(t)


def compiled_cpu(t: torch.Tensor) -> bool:
    """Whether work on ``t`` goes to the torch.compile'd CPU kernels (cpu_kernels.py, which
    need a C++ compiler) in the current mode."""
    return native_cpu(t) and cpu_kernels.available()


def native_cpu(t: torch.Tensor) -> bool:
    """Whether work on ``t`` may go to the C kernels (native.py, which need only a C compiler)
    in the current mode; each ``native.supports_*`` says whether it takes the inputs."""
    return _mode == "auto" and t.device.type == "cpu"


def invert_rope(x, positions, rope):
    impl = cpu_kernels if compiled_cpu(x) else rope_ops
    return impl.invert_rope(x, positions, rope)


def chunk_geometry(keys, chunk_size):
    impl = cpu_kernels if compiled_cpu(keys) else landmarks
    return impl.chunk_geometry(keys, chunk_size)


def landmark_scores(q, landmarks, lm_rows, lm_start, lm_count, max_count, scale):
    impl = (_kernels("select_kernels") if _use_triton(q)
            else native if native_cpu(q) and native.supports_scores(q, landmarks) else select)
    return impl.landmark_scores(q, landmarks, lm_rows, lm_start, lm_count, max_count, scale)


def select_chunks(scores, landmark_chunks, lm_start, lm_count, k, slot_count=None):
    impl = _kernels("select_kernels") if _use_triton(scores) else select
    return impl.select_chunks(scores, landmark_chunks, lm_start, lm_count, k, slot_count)


def select_slots(scores, landmark_chunks, lm_start, lm_count, k, slot_chunks, slot_count=None):
    """The step's selection and slot assignment: one C call on the CPU, the top-k kernel and
    ``assign_slots`` elsewhere."""
    if native_cpu(scores) and native.supports_select(scores):
        return native.select_slots(scores, landmark_chunks, lm_start, lm_count, k, slot_chunks,
                                   slot_count)
    selected = select_chunks(scores, landmark_chunks, lm_start, lm_count, k, slot_count)
    return select.assign_slots(slot_chunks, selected)


def assign_slots(slot_chunks, selected):
    """The hit-cache assignment of SpeCache's and TailorKV's tokens to their slots."""
    impl = native if native_cpu(selected) and native.supports_select(selected) else select
    return impl.assign_slots(slot_chunks, selected)


def list_misses(slot_chunks, miss_slots, miss_count):
    impl = native if native_cpu(miss_slots) and native.supports_select(miss_slots) else select
    return impl.list_misses(slot_chunks, miss_slots, miss_count)


def channel_scores(q, keys_cm, channels, key_start, prompt_len, sink, recent, max_len):
    """Over channel rows gathered out of the host store (the CPU's path; the Triton path reads
    them in place, `channel_scores_paged`)."""
    impl = cpu_kernels if compiled_cpu(q) else critical_channels
    return impl.channel_scores(q, keys_cm, channels, key_start, prompt_len, sink, recent, max_len)


def channel_scores_paged(q, pool, page_offset, page_start, channels, prompt_len, sink, recent,
                         max_len, chunk, page_rows):
    impl = _kernels("channel_kernels") if _use_triton(q) else critical_channels
    return impl.channel_scores_paged(q, pool, page_offset, page_start, channels, prompt_len,
                                     sink, recent, max_len, chunk, page_rows)


def _native_channels(q, pool) -> bool:
    return native_cpu(q) and native.supports_channel_top_k(q, pool)


def reads_channels_in_place(q, pool) -> bool:
    """Whether `channel_top_k` has a kernel here that reads the store's pages in place (Triton,
    or C on the CPU); elsewhere the rows are gathered for `channel_scores`."""
    return _use_triton(q) or _native_channels(q, pool)


def channel_top_k(q, pool, page_offset, page_start, channels, prompt_len, sink, recent, max_len,
                  chunk, page_rows, k):
    """TailorKV's top-k tokens, reading the store's key copy in place: one C call on the CPU,
    the Triton kernel's scores and one torch.topk on CUDA."""
    if _native_channels(q, pool):
        return native.channel_top_k(q, pool, page_offset, page_start, channels, prompt_len, sink,
                                    recent, chunk, page_rows, k)
    scores = channel_scores_paged(q, pool, page_offset, page_start, channels, prompt_len, sink,
                                  recent, max_len, chunk, page_rows)
    return critical_channels.select_tokens(scores, prompt_len, sink, recent, k)


def rebuild_keys(a, a_rows, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, rope,
                 slot_k, slot_index=None):
    args = (a, a_rows, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, rope, slot_k)
    if native_cpu(slot_k) and native.supports_rebuild(a, b, rope, slot_k):
        native.rebuild_keys(*args, slot_index)
    elif slot_index is not None:  # slots where they lie in the pages: the CPU step's only
        reconstruct.rebuild_keys(*args, slot_index)
    else:
        (_kernels("rebuild_kernels") if _use_triton(slot_k) else reconstruct).rebuild_keys(*args)


def prefill_in_c(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a CPU causal attention of ``query`` over ``key``/``value`` (a prefill chunk) runs
    in C (``native.prefill_attention``, on AVX512-BF16 dot products for bf16 or AVX2's fp32 FMAs
    for bf16 and fp32)."""
    return native_cpu(query) and native.supports_prefill_attention(query, key, value)


def decode_in_place(q: torch.Tensor, s_q: int, rows: torch.Tensor) -> bool:
    """Whether ``decode_attention`` of ``s_q`` rows of ``q`` (``[.., Hq, d]``) over ``rows``
    runs in C, reading the rows in place."""
    return native_cpu(q) and native.supports_decode_attention(q, s_q, rows)


def decode_attention(q, rows, k_rows, v_rows, exact_width, exact_len, slot_chunks, chunk_size,
                     gen_before, scale):
    """Attention over K/V rows where they lie in the pages: ShadowKV's CPU step, and the
    16-bit rows and ring of the MiniKV family's steps (C on the CPU, else the reference)."""
    impl = native if decode_in_place(q, q.shape[1], rows) else attention
    return impl.decode_attention(q, rows, k_rows, v_rows, exact_width, exact_len, slot_chunks,
                                 chunk_size, gen_before, scale)


def scatter_values(staging, staging_start, miss_slots, miss_count, slot_v):
    impl = (_kernels("rebuild_kernels") if _use_triton(slot_v)
            else cpu_kernels if native_cpu(slot_v) else reconstruct)
    impl.scatter_values(staging, staging_start, miss_slots, miss_count, slot_v)


def copy_rows(dst, index, src, src_index=None):
    """dst[index[i]] = src[src_index[i]]: the row writes of the slots and the state pages. CUDA
    runs torch's index_copy_ (the reference); the CPU a C loop (cpu_kernels.copy_rows)."""
    (cpu_kernels if native_cpu(dst) else reconstruct).copy_rows(dst, index, src, src_index)


def _native_quant(q, groups) -> bool:
    return native_cpu(q) and native.supports_quant_attention(q, groups)


def quant_attention(q, groups, group_table, group_count, fmt, scale, logits_row=None,
                    most_groups=None):
    impl = (_kernels("quant_kernels") if _use_triton(q)
            else native if _native_quant(q, groups) else quant_path)
    return impl.quant_attention(q, groups, group_table, group_count, fmt, scale, logits_row,
                                most_groups)


def quant_logits(q, groups, group_table, group_count, fmt, scale, most_groups=None):
    impl = (_kernels("quant_kernels") if _use_triton(q)
            else native if _native_quant(q[:, None], groups) else mixed_attention)
    return impl.quant_logits(q, groups, group_table, group_count, fmt, scale, most_groups)


def top_k_tokens(logits, other_lse, h_kv, k):
    """SpeCache's top-k: one C call on the CPU, the torch reference elsewhere."""
    if native_cpu(logits) and native.library() is not None:
        return native.top_k_tokens(logits, other_lse, h_kv, k)
    return mixed_attention.top_k_tokens(logits, other_lse, h_kv, k)


def column_sums(q, k, scale, lse=None):
    """One prefill chunk's H2O column sums. The Triton kernel takes the rows' LSE where the
    engine's paged prefill kernel gave it, and so does the CPU's C kernel (AVX512-BF16: bf16;
    AVX2: bf16, fp16, fp32) where the chunk's attention ran in C. Otherwise on the CPU the C
    kernel on AMX tiles (bf16, "auto") and the GEMM tiles elsewhere
    (``heavy_hitters.gemm_column_sums``, compiled in "auto", eager in "torch") normalise their
    rows themselves."""
    if _use_triton(q):
        return _kernels("heavy_hitter_kernels").chunk_column_sums(q, k, scale, lse)
    if q.device.type != "cpu":
        return heavy_hitters.chunk_column_sums_reference(q, k, scale, lse)
    if native_cpu(q) and lse is not None and native.supports_column_sums_lse(q, k):
        return native.column_sums_lse(q, k, scale, lse)
    if native_cpu(q) and native.supports_column_sums(q, k):
        sums = native.column_sums(q, k, scale)
        if sums is not None:  # (None: no AMX tiles on this CPU)
            return sums
    tile = cpu_kernels.column_sum_tile if compiled_cpu(q) else heavy_hitters.column_sum_tile
    return heavy_hitters.gemm_column_sums(q, k, scale, tile)


def flash_varlen(t: torch.Tensor) -> bool:
    """Whether exact attention on ``t`` goes to FlashAttention's varlen kernel: CUDA in mode
    "auto", where torch has the kernel and it takes the inputs."""
    return _mode == "auto" and attention.flash_varlen_supported(t)


def varlen_causal_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale):
    """Exact causal attention over packed sequences, with each row's LSE (the engine's exact
    requests of a step on CUDA, one call)."""
    impl = (attention.varlen_causal_attention_flash if flash_varlen(query)
            else attention.varlen_causal_attention_reference)
    return impl(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)


def paged_causal_attention(query, kv, blocks, slots, scale):
    """A request's exact attention over its pages, with each row's LSE. The CPU engine gathers
    the tokens for vLLM's or torch's flash kernel instead (backend/exact_attention.py)."""
    if _use_triton(query):
        return _kernels("prefill_kernels").paged_causal_attention(query, kv, blocks, slots, scale)
    return attention.paged_causal_attention_reference(query, kv, blocks, slots, scale)
