"""What MiniKV's heavy-hitter scores cost in prefill: the H2O column sums of one layer
(core/heavy_hitters.accumulate_column_sums, a second pass over each prefill chunk's queries and
every key so far; on the CPU through the flash kernel) and the explicit fp32 tiles it replaced
(chunk_column_sums_reference), against the engine's exact attention of the same chunk
(backend/exact_attention.causal_attention), at Llama-3.1-8B shapes, chunk by chunk as vLLM's
chunked prefill hands them over. Same run, reported as ratios to the attention.

  python benchmarks/bench_heavy_hitters.py --out benchmarks/heavy_hitters/cpu.json
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_shadowkv.backend.exact_attention import causal_attention
from vllm_shadowkv.core.heavy_hitters import accumulate_column_sums, chunk_column_sums_reference

H_Q, H_KV, HEAD_DIM = 32, 8, 128


def chunked(fn, length: int, chunk: int) -> float:
    """Seconds for ``fn(start, end)`` over every chunk of a ``length``-token prompt."""
    t0 = time.perf_counter()
    for start in range(0, length, chunk):
        fn(start, min(start + chunk, length))
    return time.perf_counter() - t0


def measure(length: int, chunk: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(length, H_Q, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(length, H_KV, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(length, H_KV, HEAD_DIM, generator=gen).bfloat16()
    scale = HEAD_DIM ** -0.5
    sums = {}

    def attend(start, end):
        causal_attention(q[start:end], k[:end], v[:end], scale)

    def column_sums(start, end):
        sums["total"] = accumulate_column_sums(sums.get("total") if start else None,
                                               q[start:end], k[:end], scale)

    def tiles(start, end):
        chunk_column_sums_reference(q[start:end], k[:end], scale)

    attention_s = min(chunked(attend, length, chunk) for _ in range(reps))
    sums_s = min(chunked(column_sums, length, chunk) for _ in range(reps))
    tiles_s = min(chunked(tiles, length, chunk) for _ in range(reps))
    return {"prompt_tokens": length, "chunk_tokens": chunk, "attention_s": attention_s,
            "column_sums_s": sums_s, "ratio": sums_s / attention_s,
            "fp32_tiles_s": tiles_s, "tiles_ratio": tiles_s / attention_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(int(n), args.chunk, args.reps)
            for n in tqdm(args.lengths.split(","), desc="prompt lengths")]
    for r in rows:
        print(f"{r['prompt_tokens']:>6} tokens in chunks of {r['chunk_tokens']}: exact attention "
              f"{r['attention_s']:.2f} s, column sums {r['column_sums_s']:.2f} s "
              f"({r['ratio']:.2f}x the attention; fp32 tiles {r['fp32_tiles_s']:.2f} s, "
              f"{r['tiles_ratio']:.2f}x)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                "torch": torch.__version__, "shapes": [H_Q, H_KV, HEAD_DIM], "dtype": "bf16"}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
