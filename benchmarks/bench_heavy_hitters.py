"""What MiniKV's heavy-hitter scores cost in prefill, at Llama-3.1-8B shapes, chunk by chunk as
vLLM's chunked prefill hands them over, as ratios to the exact attention of the same chunks
through vLLM's CPU kernel (what the default backend's prefill runs), in one run:

* minikv: what MiniKV's prefill runs per chunk: on the CPU the exact attention through vLLM's
  kernel (no LSE), then the H2O column sums (a C kernel on AMX tiles, csrc/column_sums.c, where
  the CPU has them; else bf16 GEMM tiles that normalise their own rows,
  core/heavy_hitters.gemm_column_sums); on CUDA the engine's paged Triton kernel, which gives
  each row's LSE with the output, then the column sums' Triton kernel from that LSE;
* column sums alone (on CUDA with their rows' LSE from a pass of their own), and on the CPU
  the GEMM tiles too;
* the explicit fp32 tiles (chunk_column_sums_reference, the reference).

  python benchmarks/bench_heavy_hitters.py --out benchmarks/heavy_hitters/cpu.json
  python benchmarks/bench_heavy_hitters.py --device cuda --lengths 16384,32768 --reps 3
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_shadowkv.backend.exact_attention import causal_attention
from vllm_shadowkv.core import cpu_kernels, ops
from vllm_shadowkv.core.heavy_hitters import (accumulate_column_sums, chunk_column_sums_reference,
                                              gemm_column_sums)

H_Q, H_KV, HEAD_DIM = 32, 8, 128


def chunked(fn, length: int, chunk: int, device: torch.device) -> float:
    """Seconds for ``fn(start, end)`` over every chunk of a ``length``-token prompt."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for start in range(0, length, chunk):
        fn(start, min(start + chunk, length))
    sync()
    return time.perf_counter() - t0


def measure(length: int, chunk: int, reps: int, tiles_too: bool, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(length, heads, HEAD_DIM, generator=gen).bfloat16().to(device)
               for heads in (H_Q, H_KV, H_KV))
    scale = HEAD_DIM ** -0.5
    sums = {}
    # On CUDA the engine attends over its pages: here every token is a page of one slot.
    pages = torch.stack([k, v], dim=1)[:, None]  # [L, 1, 2, h_kv, d]
    tokens = torch.arange(length, device=device)

    def attend(start, end):
        """The prefill's exact attention -> its rows' LSE where the kernel gives it."""
        if device.type == "cpu":  # vLLM's kernel: no LSE
            causal_attention(q[start:end], k[:end], v[:end], scale)
            return None
        return ops.paged_causal_attention(q[start:end], pages, tokens[:end],
                                          torch.zeros_like(tokens[:end]), scale)[1]

    def minikv(start, end):
        lse = attend(start, end)
        sums["total"] = accumulate_column_sums(sums.get("total") if start else None,
                                               q[start:end], k[:end], scale, lse)

    def column_sums(start, end):
        sums["own"] = accumulate_column_sums(sums.get("own") if start else None,
                                             q[start:end], k[:end], scale)

    def tiles(start, end):
        chunk_column_sums_reference(q[start:end], k[:end], scale)

    def gemm_tiles(start, end):
        gemm_column_sums(q[start:end], k[:end], scale, cpu_kernels.column_sum_tile)

    attend(0, min(chunk, length))  # vLLM's kernel: its first call sets up for seconds
    column_sums(0, min(chunk, length))  # Triton's first launch compiles
    attention_s = min(chunked(attend, length, chunk, device) for _ in range(reps))
    minikv_s = min(chunked(minikv, length, chunk, device) for _ in range(reps))
    sums_s = min(chunked(column_sums, length, chunk, device) for _ in range(reps))
    tiles_s = (min(chunked(tiles, length, chunk, device) for _ in range(reps)) if tiles_too
               else None)
    gemm_s = None
    if device.type == "cpu":
        gemm_tiles(0, min(chunk, length))  # compiles the tile
        gemm_s = min(chunked(gemm_tiles, length, chunk, device) for _ in range(reps))
    return {"prompt_tokens": length, "chunk_tokens": chunk, "attention_s": attention_s,
            "minikv_s": minikv_s, "minikv_ratio": minikv_s / attention_s,
            "column_sums_s": sums_s, "ratio": sums_s / attention_s,
            "fp32_tiles_s": tiles_s, "tiles_ratio": tiles_s and tiles_s / attention_s,
            "gemm_tiles_s": gemm_s, "gemm_tiles_ratio": gemm_s and gemm_s / attention_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-tiles", action="store_true", help="skip the fp32 tiles (slow)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [measure(int(n), args.chunk, args.reps, not args.no_tiles, device)
            for n in tqdm(args.lengths.split(","), desc="prompt lengths")]
    for r in rows:
        tiles = (f"; fp32 tiles {r['fp32_tiles_s']:.2f} s, {r['tiles_ratio']:.2f}x"
                 if r["fp32_tiles_s"] else "")
        if r["gemm_tiles_s"]:
            tiles += f"; GEMM tiles {r['gemm_tiles_s']:.2f} s, {r['gemm_tiles_ratio']:.2f}x"
        print(f"{r['prompt_tokens']:>6} tokens in chunks of {r['chunk_tokens']}: the exact "
              f"attention {r['attention_s']:.2f} s; minikv's (attention + column sums) "
              f"{r['minikv_s']:.2f} s, {r['minikv_ratio']:.2f}x; column sums alone "
              f"{r['column_sums_s']:.2f} s, {r['ratio']:.2f}x{tiles}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        machine = (torch.cuda.get_device_name() if device.type == "cuda"
                   else platform.processor() or platform.machine())
        meta = {"machine": machine, "device": args.device, "threads": args.threads,
                "torch": torch.__version__, "shapes": [H_Q, H_KV, HEAD_DIM], "dtype": "bf16"}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
