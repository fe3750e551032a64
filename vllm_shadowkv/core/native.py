"""C kernels of the CPU's decode step, built on first use by the system's C compiler and called
through ctypes.

Why C: a layer's sparse step on the CPU is mostly the cost of its calls (benchmarks/RESULTS.md,
"The sparse step's fixed cost per layer"): a torch operation costs about 2 us to call and a
compiled graph 37-45 us, while a ctypes call costs 1.4 us; and the loops here run over the
requests' rows in place through their row ids, which no single torch operation does. The
sources are in ``csrc/``; each kernel has its torch reference (same contract) in the module
named by its wrapper's docstring, and the tests compare them.

The library is built once per source, compiler and CPU (``-march=native``) into
``$SHADOWKV_CACHE_DIR/native`` (default ``~/.cache/vllm_shadowkv/native``), atomically, so
processes starting together (tensor-parallel workers) share it. Without a compiler, or with
``SHADOWKV_NATIVE=0``, ``library()`` is None and the callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .quant_attention import longest

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
# -ffast-math: the dot products' and sums' loops vectorise (fp32 sums in any order); 512-bit
# vectors: gcc prefers 256-bit ones on AVX-512 CPUs, and the softmax's exp then ran at half the
# rate.
# Compile flags only: linked with -ffast-math, gcc adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (the model's own arithmetic) when the library loads.
FLAGS = ["-O3", "-ffast-math", "-march=native", "-mprefer-vector-width=512", "-fPIC",
         "-std=gnu11"]
# The kernels split their requests and KV heads over OpenMP threads. Linked with -fopenmp the
# library needs libgomp.so.1, which resolves to the one torch has loaded: one thread pool, as
# many threads as torch.set_num_threads (vLLM's CPU worker binds them to its cores). Without
# OpenMP (a compiler that lacks it) the same sources build serial.
OPENMP = ["-fopenmp"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 512  # cpu.h's MAX_HEAD_DIM, and the rotary dim's bound
MAX_QUERY_ROWS = 1024  # cpu.h's MAX_QUERY_ROWS (h_q x s_q)
_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _cache_dir() -> Path:
    root = os.environ.get("SHADOWKV_CACHE_DIR") or Path.home() / ".cache" / "vllm_shadowkv"
    return Path(root) / "native"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _build(compiler: str, openmp: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    files = sorted(CSRC.glob("*.[ch]"))  # the headers too
    for part in [version, _cpu_identity(), " ".join(FLAGS + openmp)] + [
            p.read_text() for p in files]:
        digest.update(part.encode())
    target = _cache_dir() / f"shadowkv_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, *openmp, "-c", *map(str, SOURCES)], cwd=tmp,
                       check=True, capture_output=True, text=True)
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        subprocess.run([compiler, "-shared", *openmp, *objects, "-o", str(built), "-lm",
                        "-lmvec"], check=True, capture_output=True, text=True)
        os.replace(built, target)  # atomic: a concurrent build writes the same bytes
    return target


def _build_any(compiler: str) -> Path:
    try:
        return _build(compiler, OPENMP)
    except subprocess.CalledProcessError as err:
        logger.warning("shadowkv: the C kernels do not build with OpenMP (%s); they run on one "
                       "thread", err.stderr.strip()[-500:])
        return _build(compiler, [])


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels' library, built if needed; None where it cannot be (said once in the log)."""
    if os.environ.get("SHADOWKV_NATIVE", "1") == "0":
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("shadowkv: no C compiler on the path; the CPU decode step runs on torch")
        return None
    try:
        lib = ctypes.CDLL(str(_build_any(compiler)))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or err
        logger.warning("shadowkv: building the C kernels failed (%s); the CPU decode step runs "
                       "on torch", detail)
        return None
    lib.landmark_scores.restype = ctypes.c_int
    lib.landmark_scores.argtypes = [_ptr, _i32, _ptr, _i32, _i64, _i64, _ptr, _ptr, _ptr, _i32,
                                    _i32, _i32, _i32, _i32, _i32, ctypes.c_float, _ptr, _i64]
    lib.rebuild_keys.restype = None
    lib.rebuild_keys.argtypes = [_ptr, _i32, _i64, _ptr, _ptr, _ptr, _ptr, _i32, _i32, _ptr, _ptr,
                                 _ptr, _i32, _i32, _i32, _i32, _ptr, _i32, _i32, _i32, _ptr, _i32,
                                 _i64, _ptr, _i32]
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [_ptr, _i32, _ptr, _i32, _i64, _ptr, _ptr, _i32, _i32, _i32,
                                     _i32, _i32, _i32, _i32, _ptr, _ptr, _i32, _i32, _ptr,
                                     ctypes.c_float, _ptr, _i32, _ptr]
    lib.select_slots.restype = ctypes.c_int
    lib.select_slots.argtypes = [_ptr, _i32, _ptr, _ptr, _ptr, _ptr, _i32, _i32, _i32, _ptr, _ptr,
                                 _ptr]
    lib.gather_store_rows.restype = ctypes.c_int64
    lib.gather_store_rows.argtypes = [_ptr, _i32, _i64, _i64, _ptr, _i32, _ptr, _i32, _ptr,
                                      _ptr, _ptr, _ptr, _ptr, _i32, _i64, _i64, _ptr, _ptr, _i64]
    lib.list_misses.restype = ctypes.c_int64
    lib.list_misses.argtypes = [_ptr, _ptr, _ptr, _i32, _i32, _i32, _ptr, _ptr, _ptr, _ptr]
    lib.quant_attention.restype = ctypes.c_int
    lib.quant_attention.argtypes = [_ptr, _i32, _i32, _i32, _i32, _i32, _ptr, _ptr, _i64, _i32,
                                    _i32, _i32, _i32, _i32, _ptr, _i64, _ptr, ctypes.c_float,
                                    _i32, _ptr, _i64, _ptr, _i32, _ptr]
    lib.column_sums.restype = ctypes.c_int
    lib.column_sums.argtypes = [_ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _i32, ctypes.c_float,
                                _ptr]
    lib.column_sums_lse.restype = ctypes.c_int
    lib.column_sums_lse.argtypes = [_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _i32,
                                    _i32, ctypes.c_float, _ptr, _ptr]
    lib.top_k_tokens.restype = ctypes.c_int
    lib.top_k_tokens.argtypes = [_ptr, _i64, _ptr, _i32, _i32, _i32, _i32, _ptr]
    lib.channel_top_k.restype = ctypes.c_int
    lib.channel_top_k.argtypes = [_ptr, _i32, _ptr, _i32, _ptr, _i32, _ptr, _ptr, _ptr, _i32, _i32,
                                  _i32, _i32, _i32, _i32, _i32, _i64, _i32, _ptr]
    lib.assign_slots.restype = ctypes.c_int
    lib.assign_slots.argtypes = [_ptr, _ptr, _i64, _i32, _ptr, _ptr]
    lib.kernel_threads.restype = ctypes.c_int
    lib.kernel_threads.argtypes = []
    lib.copy_rows.restype = None
    lib.copy_rows.argtypes = [_ptr, _i32, _i64, _ptr, _i64, _ptr, _i32, _i64, _ptr, _i64]
    lib.prefill_attention_dtypes.restype = ctypes.c_int
    lib.prefill_attention_dtypes.argtypes = []
    lib.prefill_attention.restype = ctypes.c_int
    lib.prefill_attention.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32,
                                      _i32, _i32, ctypes.c_float, _ptr, _ptr]
    lib.sparse_step.restype = ctypes.c_int64
    lib.sparse_step.argtypes = [ctypes.POINTER(SparseStep)]
    return lib


class SparseStep(ctypes.Structure):
    """``csrc/sparse_step.c``'s ``struct sparse_step``, field by field: ShadowKV's whole CPU
    decode step of one layer in one call. Set once per batch and layer cache
    (``methods/shadowkv/pages.py``, which keeps the tensors it points into alive); a step sets
    ``q``, ``out``, ``lse``, ``k_rows``, ``v_rows``, ``width`` and ``gen_before``."""

    _fields_ = [(name, kind) for names, kind in (
        ("pages", _ptr),
        ("dtype num_rows batch s_q h_q h_kv d rank k chunk", _i64),
        ("scale landmark_scale", ctypes.c_double),
        ("q", _ptr), ("q_dtype", _i64), ("out lse k_rows v_rows", _ptr), ("width", _i64),
        ("gen_before landmark_rows lm_start lm_count landmark_chunks slot_count", _ptr),
        ("max_landmarks logits_ld", _i64),
        ("scores a_rows a_positions a_start b_offsets b cos_sin", _ptr),
        ("cos_sin_dtype rotary_dim neox", _i64),
        ("slot_ids slot_chunks miss_slots miss_count slot_k_rows slot_v_rows heads chunks "
         "filled misses value_rows", _ptr),
        ("exact_width", _i64), ("exact_len pool", _ptr), ("pool_dtype", _i64),
        ("page_offsets first_page num_heads num_rows_stored", _ptr),
        ("page_rows row_numel", _i64)) for name in names.split()]


def sparse_step(step: SparseStep) -> int:
    """Runs one step (``SparseStep``); -> 0, or 1 + the first missed row the value store does
    not hold (the caller raises). A failed scratch allocation raises here."""
    status = library().sparse_step(ctypes.byref(step))
    if status == -1:
        raise MemoryError("sparse_step: a kernel's scratch allocation failed")
    if status == -2:
        raise IndexError("sparse_step: a value row's destination is outside the pages")
    return status


def _int32(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.int32)


def _int64(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.int64)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as one run of ``dtype``: itself where it is one already. Checked in Python: a
    decode step passes dozens of such tensors, and each no-op ``.to`` or ``.contiguous`` is a
    dispatch (microseconds each once the model's weights have swept the caches)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


def logits_ld(max_count: int) -> int:
    """The landmark pass's logit rows in its scratch: padded off a multiple of 4 KiB, since each
    landmark's dots go to every row, and rows that far apart share the same few L1 sets (2.5x
    slower at 4,096 landmarks)."""
    return -(-max_count // 16) * 16 + 16


def landmark_scores(q, landmarks, lm_rows, lm_start, lm_count, max_count, scale):
    """select.landmark_scores in one C call for the whole batch (``csrc/landmark_scores.c``).
    Takes what ``supports_scores`` accepts."""
    batch, s_q, h_q, head_dim = q.shape
    h_kv = landmarks.shape[1]
    out = torch.full((batch, h_kv, max_count), -1.0, dtype=torch.float32)
    if max_count == 0:
        return out
    q = q.contiguous()
    if landmarks.stride(-1) != 1:  # the kernel reads a head's row as one run: copy them out
        landmarks, lm_rows = landmarks[lm_rows].contiguous(), torch.arange(lm_rows.numel())
    rows, starts, counts = _int64(lm_rows), _int32(lm_start), _int32(lm_count)
    row_stride, head_stride, _ = landmarks.stride()
    failed = library().landmark_scores(
        q.data_ptr(), DTYPES[q.dtype], landmarks.data_ptr(), DTYPES[landmarks.dtype],
        row_stride, head_stride, rows.data_ptr(), starts.data_ptr(), counts.data_ptr(), batch,
        s_q, h_q, h_kv, head_dim, max_count, scale, out.data_ptr(), logits_ld(max_count))
    if failed == 2:
        raise MemoryError("landmark_scores: scratch allocation failed")
    assert not failed, "outside supports_scores()"
    return out


def supports_scores(q: torch.Tensor, landmarks: torch.Tensor) -> bool:
    """Whether ``landmark_scores`` here takes these: CPU tensors of fp32, bf16 or fp16, a head
    dimension of at most 512, at most 1024 query rows (s_q x h_q), and the library built."""
    s_q, h_q = q.shape[1:3]
    return (q.device.type == landmarks.device.type == "cpu"
            and q.dtype in DTYPES and landmarks.dtype in DTYPES
            and landmarks.shape[-1] <= MAX_HEAD_DIM and s_q * h_q <= MAX_QUERY_ROWS
            and library() is not None)


def rebuild_keys(a, a_rows, a_positions, a_start, b, slot_chunks, miss_slots, miss_count, rope,
                 slot_k, slot_index=None):
    """reconstruct.rebuild_keys in one C call for the whole batch (``csrc/rebuild_keys.c``).
    Takes what ``supports_rebuild`` accepts; layouts the kernel does not read (A rows or slots
    not one run of memory each) are copied first, a case outside the engine."""
    batch, h_kv, k = slot_chunks.shape
    rank, head_dim = b.shape[-2:]
    if a.stride(-1) != 1:
        a, a_rows = a[a_rows].contiguous(), torch.arange(a_rows.numel())
    if slot_index is None and not slot_k.is_contiguous():
        keys = slot_k.contiguous()
        rebuild_keys(a, a_rows, a_positions, a_start, b, slot_chunks, miss_slots, miss_count,
                     rope, keys)
        slot_k.copy_(keys)
        return
    assert slot_k.stride(-1) == 1
    c = slot_index.shape[-1] if slot_index is not None else slot_k.shape[2] // k
    b, cos_sin = b.contiguous(), rope.cos_sin_cache.contiguous()
    a_rows = _int64(a_rows)
    index = _int64(slot_index) if slot_index is not None else None
    slot_chunks, miss_slots, miss_count = map(_int32, (slot_chunks, miss_slots, miss_count))
    a_positions, a_start = _int32(a_positions), _int32(a_start)
    library().rebuild_keys(
        a.data_ptr(), DTYPES[a.dtype], a.stride(0), a_rows.data_ptr(), a_positions.data_ptr(),
        a_start.data_ptr(), b.data_ptr(), DTYPES[b.dtype], rank, slot_chunks.data_ptr(),
        miss_slots.data_ptr(), miss_count.data_ptr(), batch, h_kv, k, c, cos_sin.data_ptr(),
        DTYPES[cos_sin.dtype], rope.rotary_dim, rope.is_neox_style, slot_k.data_ptr(),
        DTYPES[slot_k.dtype], slot_k.stride(0) if index is not None else 0,
        index.data_ptr() if index is not None else None, head_dim)


def supports_rebuild(a: torch.Tensor, b: torch.Tensor, rope, slot_k: torch.Tensor) -> bool:
    """Whether ``rebuild_keys`` here takes these: CPU tensors of fp32, bf16 or fp16, a rotary
    dimension of at most 512, and the library built."""
    tensors = (a, b, rope.cos_sin_cache, slot_k)
    return (all(t.device.type == "cpu" and t.dtype in DTYPES for t in tensors)
            and rope.rotary_dim <= MAX_HEAD_DIM and library() is not None)


def select_slots(scores, landmark_chunks, lm_start, lm_count, k, slot_chunks, slot_count=None):
    """select.select_slots in one C call for the whole batch (``csrc/select_slots.c``), for
    what ``supports_select`` accepts. Among equal scores the lower landmark wins."""
    batch, h_kv, max_count = scores.shape
    scores, chunks = _as(scores, torch.float32), _int32(landmark_chunks)
    starts, counts = _int32(lm_start), _int32(lm_count)
    owned = None if slot_count is None else _int32(slot_count)
    slots = slot_chunks.to(torch.int32, copy=True).contiguous()
    miss_slots = torch.empty(batch, h_kv, k, dtype=torch.int32)
    miss_count = torch.empty(batch, h_kv, dtype=torch.int32)
    failed = library().select_slots(
        scores.data_ptr(), max_count, chunks.data_ptr(), starts.data_ptr(), counts.data_ptr(),
        None if owned is None else owned.data_ptr(), batch, h_kv, k, slots.data_ptr(),
        miss_slots.data_ptr(), miss_count.data_ptr())
    if failed:
        raise MemoryError("select_slots: scratch allocation failed")
    return slots, miss_slots, miss_count


def assign_slots(slot_chunks, selected):
    """select.assign_slots in one C call (``csrc/select_slots.c``), for CPU tensors."""
    *lead, k = selected.shape
    slots = slot_chunks.to(torch.int32, copy=True).contiguous()
    miss_slots = torch.empty(*lead, k, dtype=torch.int32)
    miss_count = torch.empty(*lead, dtype=torch.int32)
    wanted = _int32(selected)  # held: a converted copy must outlive the call
    if library().assign_slots(slots.data_ptr(), wanted.data_ptr(), miss_count.numel(),
                              k, miss_slots.data_ptr(), miss_count.data_ptr()):
        raise MemoryError("assign_slots: scratch allocation failed")
    return slots, miss_slots, miss_count


def list_misses(slot_chunks, miss_slots, miss_count):
    """select.list_misses in one C call (``csrc/select_slots.c``), for CPU tensors."""
    batch, h_kv, k = miss_slots.shape
    slot_chunks, miss_slots, miss_count = map(_int32, (slot_chunks, miss_slots, miss_count))
    heads, chunks, filled = torch.empty(3, batch * h_kv * k, dtype=torch.int64)
    per_request = torch.empty(batch, dtype=torch.int64)
    n = library().list_misses(slot_chunks.data_ptr(), miss_slots.data_ptr(),
                              miss_count.data_ptr(), batch, h_kv, k, heads.data_ptr(),
                              chunks.data_ptr(), filled.data_ptr(), per_request.data_ptr())
    return heads[:n], chunks[:n], filled[:n], per_request.tolist()


def supports_select(scores: torch.Tensor) -> bool:
    """Whether ``select_slots`` here takes these: CPU scores, and the library built."""
    return scores.device.type == "cpu" and library() is not None


def decode_attention(q, rows, k_rows, v_rows, exact_width, exact_len, slot_chunks, chunk_size,
                     gen_before, scale):
    """attention.decode_attention in one C call for the whole batch
    (``csrc/decode_attention.c``), for what ``supports_decode_attention`` accepts."""
    batch, s_q, h_q, head_dim = q.shape
    h_kv, width = k_rows.shape[1:]
    q = q.contiguous()
    k_rows, v_rows, exact_len, gen_before = map(_int64, (k_rows, v_rows, exact_len, gen_before))
    slot_chunks = _int32(slot_chunks)
    out = torch.empty_like(q)
    lse = torch.empty(batch, s_q, h_q, dtype=torch.float32)
    failed = library().decode_attention(
        q.data_ptr(), DTYPES[q.dtype], rows.data_ptr(), DTYPES[rows.dtype], rows.stride(0),
        k_rows.data_ptr(), v_rows.data_ptr(), batch, s_q, h_q, h_kv, head_dim, width,
        exact_width, exact_len.data_ptr(), slot_chunks.data_ptr(), slot_chunks.shape[-1],
        chunk_size, gen_before.data_ptr(), scale, out.data_ptr(), DTYPES[out.dtype],
        lse.data_ptr())
    if failed:
        raise MemoryError("decode_attention: scratch allocation failed (or outside "
                          "supports_decode_attention())")
    return out, lse


def supports_decode_attention(q: torch.Tensor, s_q: int, rows: torch.Tensor) -> bool:
    """Whether ``decode_attention`` here takes ``s_q`` query rows of ``q`` (``[.., h_q, d]``)
    over ``rows``: CPU tensors of fp32, bf16 or fp16, rows each one run of memory, a head
    dimension of at most 512, at most 1024 query rows (s_q x h_q), and the library built."""
    h_q, head_dim = q.shape[-2:]
    return (q.device.type == rows.device.type == "cpu" and q.dtype in DTYPES
            and rows.dtype in DTYPES and rows.stride(-1) == 1 and head_dim <= MAX_HEAD_DIM
            and s_q * h_q <= MAX_QUERY_ROWS and library() is not None)


def prefill_attention(query, key, value, scale):
    """attention.attention_with_lse_reference's causal attention in one C call
    (``csrc/prefill_attention.c``): query ``[q, Hq, d]``, key and value ``[s, Hkv, d]`` (s >= q;
    query token i at position s - q + i) -> (out ``[q, Hq, d]``, lse ``[Hq, q]`` fp32), for
    what ``supports_prefill_attention`` accepts."""
    q_len, h_q, head_dim = query.shape
    s_len, h_kv, _ = key.shape
    query = _heads_packed(query)
    key, value = _heads_packed(key), _heads_packed(value)
    out = torch.empty(q_len, h_q, head_dim, dtype=query.dtype)
    lse = torch.empty(h_q, q_len, dtype=torch.float32)
    failed = library().prefill_attention(
        query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(),
        value.stride(0), DTYPES[query.dtype], q_len, s_len, h_q, h_kv, head_dim, scale,
        out.data_ptr(), lse.data_ptr())
    if failed == 2:
        raise MemoryError("prefill_attention: scratch allocation failed")
    assert not failed, "outside supports_prefill_attention()"
    return out, lse


def _heads_packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` [n, h, d] with each token's heads one run (any token stride): itself where so."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def supports_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                               ) -> bool:
    """Whether ``prefill_attention`` here takes these: CPU tensors of one dtype the build takes
    (bf16 on AVX512-BF16; bf16, fp16 or fp32 on AVX2, multiplied in fp32 there), a head dimension a
    multiple of 16 up to 512, at most 16 query heads per KV head, at least as many keys as
    queries."""
    (q_len, h_q, head_dim), (s_len, h_kv, _) = query.shape, key.shape
    return (query.device.type == key.device.type == value.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype and query.dtype in DTYPES
            and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and h_q % h_kv == 0
            and h_q // h_kv <= 16 and s_len >= q_len > 0 and library() is not None
            and library().prefill_attention_dtypes() & 1 << DTYPES[query.dtype] != 0)


def quant_attention(q, groups, group_table, group_count, fmt, scale, logits_row=None,
                    most_groups=None, attend=True):
    """quant_attention.quant_attention in one C call for the whole batch
    (``csrc/quant_attention.c``), for what ``supports_quant_attention`` accepts. Without
    ``attend`` only the logits of ``logits_row`` are computed: -> logits."""
    batch, s_q, h_q, head_dim = q.shape
    h_kv = groups.key_codes.shape[1]
    q = q.contiguous()
    table = group_table if group_table.stride(-1) == 1 else group_table.contiguous()
    table, counts = table.to(torch.int32), _int32(group_count)
    width = longest(counts, most_groups) * fmt.group
    logits = None
    if logits_row is not None:
        logits = torch.full((batch, h_q, width), float("-inf"), dtype=torch.float32)
    strides = torch.tensor([s * f.element_size() for f in groups for s in f.stride()[:2]],
                           dtype=torch.int64)
    bases = (ctypes.c_void_p * 6)(*(f.data_ptr() for f in groups))
    out = torch.empty_like(q) if attend else None
    lse = torch.empty(batch, s_q, h_q, dtype=torch.float32)
    failed = library().quant_attention(
        q.data_ptr(), DTYPES[q.dtype], batch, s_q, h_q, head_dim, bases, strides.data_ptr(),
        len(groups.key_codes), DTYPES[groups.key_scale.dtype], h_kv, fmt.bits, fmt.group,
        fmt.value_group,
        table.data_ptr(), table.stride(0) if batch else 0, counts.data_ptr(), scale,
        -1 if logits_row is None else logits_row,
        None if logits is None else logits.data_ptr(), width,
        None if out is None else out.data_ptr(), DTYPES[q.dtype], lse.data_ptr())
    if failed == 2:
        raise IndexError(f"quant_attention: a group table entry is outside the pool's "
                         f"{len(groups.key_codes)} groups, or a request's groups overflow the "
                         f"logits row ({width} wide)")
    if failed:
        raise MemoryError("quant_attention: scratch allocation failed (or outside "
                          "supports_quant_attention())")
    if not attend:
        return logits
    return (out, lse) if logits is None else (out, lse, logits)


def quant_logits(q, groups, group_table, group_count, fmt, scale, most_groups=None):
    """mixed_attention.quant_logits: ``quant_attention``'s logits alone, q [B, h_q, d]."""
    return quant_attention(q[:, None], groups, group_table, group_count, fmt, scale, 0,
                           most_groups, attend=False)


def supports_quant_attention(q: torch.Tensor, groups) -> bool:
    """Whether ``quant_attention`` here takes these: CPU tensors, queries and scales of fp32,
    bf16 or fp16, each pool field's entries [h_kv, ...] with unit strides inside a head, a head
    dimension of at most 512, at most 1024 query rows (s_q x h_q), and the library built."""
    s_q, h_q, head_dim = q.shape[1:]
    return (q.device.type == "cpu" and all(f.device.type == "cpu" for f in groups)
            and q.dtype in DTYPES and groups.key_scale.dtype in DTYPES
            and all(f[0, 0].is_contiguous() for f in groups if len(f))
            and head_dim <= MAX_HEAD_DIM and s_q * h_q <= MAX_QUERY_ROWS
            and library() is not None)


def top_k_tokens(logits, other_lse, h_kv, k):
    """mixed_attention.top_k_tokens in one C call (``csrc/top_k_tokens.c``), for CPU tensors.
    Among equal scores the lower token wins."""
    batch, h_q, width = logits.shape
    logits, other_lse = logits.float().contiguous(), other_lse.float().contiguous()
    out = torch.empty(batch, h_kv, k, dtype=torch.int32)
    if library().top_k_tokens(logits.data_ptr(), width, other_lse.data_ptr(), batch, h_q, h_kv,
                              k, out.data_ptr()):
        raise MemoryError("top_k_tokens: scratch allocation failed")
    return out


def channel_top_k(q, pool, page_offset, page_start, channels, prompt_len, sink, recent, chunk,
                  page_rows, k):
    """critical_channels.channel_top_k in one C call for the whole batch
    (``csrc/channel_top_k.c``), for what ``supports_channel_top_k`` accepts. Among equal scores
    the earlier token wins."""
    batch, h_q, head_dim = q.shape
    h_kv, d_s = channels.shape[1:]
    out = torch.empty(batch, h_kv, k, dtype=torch.int32)
    q, offsets = q.contiguous(), _int64(page_offset)
    channels, starts, lens = _int32(channels), _int32(page_start), _int32(prompt_len)
    if library().channel_top_k(q.data_ptr(), DTYPES[q.dtype], channels.data_ptr(), d_s,
                               pool.data_ptr(), DTYPES[pool.dtype], offsets.data_ptr(),
                               starts.data_ptr(), lens.data_ptr(), batch, h_q, h_kv, head_dim,
                               sink, recent, chunk, page_rows, k, out.data_ptr()):
        raise MemoryError("channel_top_k: scratch allocation failed")
    return out


def supports_channel_top_k(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether ``channel_top_k`` here takes these: CPU tensors of fp32, bf16 or fp16, and the
    library built."""
    return (q.device.type == pool.device.type == "cpu" and q.dtype in DTYPES
            and pool.dtype in DTYPES and library() is not None)


def column_sums(q, k, scale):
    """heavy_hitters.chunk_column_sums_reference in one C call on AMX tiles
    (``csrc/column_sums.c``), for what ``supports_column_sums`` accepts; None where the CPU has
    no AMX tiles (or d > 128)."""
    n, h_q, head_dim = q.shape
    length, h_kv, _ = k.shape
    q = q.contiguous()
    total = torch.zeros(h_kv, length, dtype=torch.float32)
    status = library().column_sums(q.data_ptr(), k.data_ptr(), k.stride(0), n, h_q, h_kv,
                                   head_dim, length, scale, total.data_ptr())
    if status == 2:
        raise MemoryError("column_sums: scratch allocation failed")
    return None if status else total


def supports_column_sums(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``column_sums`` here may take these: bf16 CPU tensors, each token's key heads one
    run of memory, and the library built (the kernel itself declines without AMX tiles)."""
    return (q.device.type == k.device.type == "cpu" and q.dtype == k.dtype == torch.bfloat16
            and k.stride(2) == 1 and k.stride(1) == k.shape[2] and library() is not None)


def column_sums_lse(q, k, scale, lse):
    """heavy_hitters.chunk_column_sums_reference given the rows' LSE, in one C call on
    AVX512-BF16 dot products or AVX2's FMAs (``csrc/column_sums.c``): q [n, h_q, d] the chunk's
    queries, k [length, h_kv, d] every key so far, lse [h_kv, G, n] from the chunk's attention
    -> [h_kv, length] fp32. For what ``supports_column_sums_lse`` accepts."""
    n, h_q, head_dim = q.shape
    length, h_kv, _ = k.shape
    q, k = _heads_packed(q), _heads_packed(k)
    lse = _as(lse.reshape(h_q, n), torch.float32)
    total = torch.empty(h_kv, length, dtype=torch.float32)
    status = library().column_sums_lse(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                       DTYPES[q.dtype], n, length, h_q, h_kv, head_dim, scale,
                                       lse.data_ptr(), total.data_ptr())
    if status == 2:
        raise MemoryError("column_sums_lse: scratch allocation failed")
    assert not status, "outside supports_column_sums_lse()"
    return total


def supports_column_sums_lse(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``column_sums_lse`` here takes these: what ``supports_prefill_attention`` takes
    of the chunk's queries over its keys."""
    return supports_prefill_attention(q, k, k)


def copy_rows(dst, index, src, src_index=None):
    """reconstruct.copy_rows in one C call (``csrc/copy_rows.c``), for what ``supports_copy``
    accepts."""
    n = index.numel()
    if n == 0:
        return
    index = _int64(index)
    if src_index is not None:
        src_index = _int64(src_index)
    library().copy_rows(dst.data_ptr(), DTYPES[dst.dtype], dst.stride(0), index.data_ptr(), n,
                        src.data_ptr(), DTYPES[src.dtype], src.stride(0),
                        None if src_index is None else src_index.data_ptr(), dst[0].numel())


def supports_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``copy_rows`` here takes these: CPU tensors of fp32, bf16 or fp16, rows of one
    width, each one run of memory, and the library built."""
    return (dst.device.type == src.device.type == "cpu" and dst.dtype in DTYPES
            and src.dtype in DTYPES and dst.shape[1:].numel() == src.shape[1:].numel()
            and _rows_contiguous(dst) and _rows_contiguous(src) and library() is not None)


def gather_store_rows(out, out_rows, pool, tables, counts, heads, chunks, page_rows, row_numel):
    """The value store's gather in one C call (``csrc/store_rows.c``; the reference is
    CpuValueStore.gather_many's torch path), for what ``supports_store_gather`` accepts.
    ``tables``: the keys' page offsets (elements from ``pool``'s first), first page, heads and
    rows, int64 each. -> None, or the first wanted row its key does not hold (nothing copied)."""
    split = out_rows.shape[1] if out_rows is not None and out_rows.dim() == 2 else 1
    dest = None if out_rows is None else _int64(out_rows)
    counts = torch.tensor(counts, dtype=torch.int64)
    heads, chunks = _int64(heads), _int64(chunks)
    bad = library().gather_store_rows(
        out.data_ptr(), DTYPES[out.dtype], out.stride(0), len(out),
        None if dest is None else dest.data_ptr(), split, pool.data_ptr(), DTYPES[pool.dtype],
        *(t.data_ptr() for t in tables),
        counts.data_ptr(), len(counts), page_rows, row_numel, heads.data_ptr(),
        chunks.data_ptr(), heads.numel())
    if bad == -2:
        raise IndexError(f"value store: a destination row is outside out's {len(out)} rows")
    if bad < 0:
        raise MemoryError("gather_store_rows: scratch allocation failed")
    return bad - 1 if bad else None


def supports_store_gather(out: torch.Tensor, out_rows: torch.Tensor | None, pool: torch.Tensor,
                          row_numel: int) -> bool:
    """Whether ``gather_store_rows`` here takes these: CPU tensors of fp32, bf16 or fp16, out's
    rows each one run of memory and as wide as a stored row (or, with ``out_rows`` [n, c], a
    c-th of one), and the library built."""
    split = out_rows.shape[1] if out_rows is not None and out_rows.dim() == 2 else 1
    return (out.device.type == pool.device.type == "cpu" and out.dtype in DTYPES
            and pool.dtype in DTYPES and len(out) > 0 and out[0].numel() * split == row_numel
            and _rows_contiguous(out) and library() is not None)


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.dim() >= 1 and t[0].is_contiguous() if len(t) else True
