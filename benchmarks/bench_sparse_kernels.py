"""ShadowKV's two heaviest CPU stages alone, at Llama-3.1-8B shapes (8 KV heads of 128, 32 query
heads, rank 160, chunks of 8, bf16 unless --dtype): the C key rebuild and landmark scores
(``core/csrc/``) against their torch references, over a ragged batch of requests whose every
selected chunk missed (random tokens: the engine's end-to-end runs rebuild nearly all of them).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sparse_kernels.py --out FILE.json

``--march`` builds the kernels for another CPU than this one (``skylake-avx512``: AVX-512
without BF16; ``x86-64-v2``: no AVX-512) to time their other paths here; ``--csrc`` builds them
from other sources (an older commit's ``git archive``) to time a change. Their functions must
take this core/native.py's arguments: sources from before 2026-12-04 do not (landmark_scores
then took its scratch, and kernel_threads did not exist).
"""

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_shadowkv.core import native, reconstruct, select
from vllm_shadowkv.core.rope import RopeCache

H_KV, H_Q, D, RANK, CHUNK = 8, 32, 128, 160, 8
PAGE_ROWS, PAGE_LANDMARKS = 36, 16  # rows of H_KV x D per page of 128 tokens, landmark rows
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _best_ms(fn, reps: int, flush: torch.Tensor | None = None) -> float:
    """Best of ``reps`` calls; with ``flush`` (--cold) that buffer written before each, as the
    engine's weights sweep the caches between two layers' steps."""
    fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.add_(1)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def measure(context: int, batch: int, budget: int, dtype: torch.dtype, reps: int,
            flush: torch.Tensor | None = None) -> dict:
    chunks, k = context // CHUNK, budget // CHUNK
    # A rows in a shuffled order: the selected chunks' rows are scattered over the pages.
    a = torch.randn(batch * context, RANK).to(dtype)
    a_rows = torch.randperm(batch * context)
    a_positions = torch.randint(0, context, (batch * context,), dtype=torch.int32)
    starts = torch.arange(batch, dtype=torch.int32)
    b = torch.randn(batch, H_KV, RANK, D).to(dtype)
    angles = torch.arange(context).float()[:, None] * 500000.0 ** (-torch.arange(0, D, 2) / D)
    rope = RopeCache(torch.cat([angles.cos(), angles.sin()], -1).to(dtype), D, True)
    slot_chunks = torch.stack([torch.stack([torch.randperm(chunks)[:k] for _ in range(H_KV)])
                               for _ in range(batch)]).to(torch.int32)
    miss_slots = torch.arange(k, dtype=torch.int32).expand(batch, H_KV, k).contiguous()
    miss_count = torch.full((batch, H_KV), k, dtype=torch.int32)
    keys = torch.zeros(batch, H_KV, k * CHUNK, D, dtype=dtype)
    args = (a, a_rows, a_positions, starts * context, b, slot_chunks, miss_slots, miss_count,
            rope, keys)
    rebuild_c = _best_ms(lambda: native.rebuild_keys(*args), reps, flush)
    rebuild_torch = _best_ms(lambda: reconstruct.rebuild_keys(*args), max(1, reps // 4))
    want = keys.clone()
    reconstruct.rebuild_keys(*args[:-1], want)
    native.rebuild_keys(*args)
    rebuild_err = ((keys.float() - want.float()).norm() / want.float().norm()).item()

    # The landmarks where the engine's pages put them: a page of 128 tokens holds their A rows
    # (20 rows of H_KV x D) then their 16 landmark rows.
    pages = batch * chunks // PAGE_LANDMARKS
    landmarks = torch.randn(pages * PAGE_ROWS, H_KV, D).to(dtype)
    lm_rows = (torch.arange(pages)[:, None] * PAGE_ROWS + PAGE_ROWS - PAGE_LANDMARKS
               + torch.arange(PAGE_LANDMARKS)).flatten()
    q = torch.randn(batch, 1, H_Q, D).to(dtype)
    counts = torch.full((batch,), chunks, dtype=torch.int32)
    lm = (q, landmarks, lm_rows, starts * chunks, counts, chunks, D ** -0.5)
    scores_c = _best_ms(lambda: native.landmark_scores(*lm), reps, flush)
    scores_torch = _best_ms(lambda: select.landmark_scores(*lm), max(1, reps // 4))
    scores_err = (native.landmark_scores(*lm) - select.landmark_scores(*lm)).abs().max().item()
    return {"context": context, "batch": batch, "keys_rebuilt": batch * H_KV * k * CHUNK,
            "rebuild_c_ms": rebuild_c, "rebuild_torch_ms": rebuild_torch,
            "rebuild_rel_err": rebuild_err, "landmarks": batch * chunks,
            "scores_c_ms": scores_c, "scores_torch_ms": scores_torch,
            "scores_max_err": scores_err,
            "scores_gb_s": lm_rows.numel() * H_KV * D * landmarks.element_size() / scores_c / 1e6}


def _last_level_cache() -> int:
    """Bytes of the largest cache (sysfs), 32 MiB where it does not say."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = index.read_text().strip()
        sizes.append(int(text[:-1]) << {"K": 10, "M": 20}.get(text[-1], 0))
    return max(sizes, default=32 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget", type=float, default=0.0156,
                        help="selected tokens per KV head, as a share of the context")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cold", action="store_true",
                        help="caches flushed before each timed call, as between the engine's "
                             "layers (its weights stream through the caches)")
    parser.add_argument("--march", help="-march= of the kernels' build (default: native)")
    parser.add_argument("--csrc", type=Path, help="build the kernels from these sources")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.march:
        native.FLAGS = [f"-march={args.march}" if f.startswith("-march=") else f
                        for f in native.FLAGS]
    if args.csrc:
        native.CSRC, native.SOURCES = args.csrc, sorted(args.csrc.glob("*.c"))
    if native.library() is None:
        raise SystemExit("bench_sparse_kernels: the C kernels are not built (no C compiler?)")
    torch.manual_seed(0)
    flush = torch.zeros(_last_level_cache() // 2) if args.cold else None  # fp32: twice its bytes
    cases = [(c, b) for c in args.contexts for b in args.batches]
    rows = []
    for context, batch in tqdm(cases, desc="sparse kernels", unit="case"):
        budget = max(CHUNK, round(args.budget * context / CHUNK) * CHUNK)
        rows.append(measure(context, batch, budget, DTYPES[args.dtype], args.reps, flush))
    print(f"{'context':>8} {'batch':>5} {'keys':>6} {'rebuild C ms':>12} {'torch ms':>9} "
          f"{'landmarks':>9} {'scores C ms':>11} {'torch ms':>9} {'GB/s':>5}")
    for r in rows:
        print(f"{r['context']:>8} {r['batch']:>5} {r['keys_rebuilt']:>6} "
              f"{r['rebuild_c_ms']:>12.2f} {r['rebuild_torch_ms']:>9.2f} {r['landmarks']:>9} "
              f"{r['scores_c_ms']:>11.2f} {r['scores_torch_ms']:>9.2f} {r['scores_gb_s']:>5.1f}")
    meta = {"command": "benchmarks/bench_sparse_kernels.py", "date": str(date.today()),
            "machine": platform.processor() or platform.machine(), "dtype": args.dtype,
            "march": args.march or "native", "csrc": str(args.csrc or native.CSRC),
            "threads": torch.get_num_threads(), "cold": args.cold}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
