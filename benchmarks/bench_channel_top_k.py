"""TailorKV's S-layer selection on the CPU, one layer at Llama-3.1-8B shapes (8 KV heads of 128,
32 query heads, bf16): the C kernel (critical-channel scores read from the store's pages in
place, radix-select top-k) against the torch path it replaced (the compiled scores, which take
the critical channels' rows out of keys held channel-major in one tensor, then torch.topk; the
gather out of the store's pages is not counted).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_channel_top_k.py --out DIR
"""

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_shadowkv.core import critical_channels as cc
from vllm_shadowkv.core import native, ops
from vllm_shadowkv.store import CpuValueStore

H_KV, H_Q, D, CHUNK, PAGE_ROWS = 8, 32, 128, 128, 256


def _timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def measure(context: int, batch: int, k: int, d_s: int, sink: int, recent: int,
            reps: int) -> dict:
    store = CpuValueStore(1 << 34, torch.bfloat16, (CHUNK,), PAGE_ROWS, pin_memory=False)
    chunks = -(-context // CHUNK)
    keys = torch.randn(batch, H_KV, D, chunks * CHUNK).to(torch.bfloat16)
    offsets, starts = [], [0]
    for b in range(batch):
        store.put(b, keys[b].reshape(H_KV, D * chunks, CHUNK))
        offsets.append(store.page_offsets(b))
        starts.append(starts[-1] + len(offsets[-1]))
    q = torch.randn(batch, H_Q, D).to(torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32)
    channels = cc.critical_channels(q, keys.float().abs().amax(-1), d_s)
    args = (q, store.pool, torch.cat(offsets), torch.tensor(starts[:-1], dtype=torch.int32),
            channels, lens, sink, recent)
    c_ms = _timed(lambda: native.channel_top_k(*args, CHUNK, PAGE_ROWS, k), reps)
    # The torch path reads the keys channel-major, request b's at columns [b * N, (b + 1) * N).
    keys_cm = keys.permute(1, 2, 0, 3).reshape(H_KV, D, -1)
    key_start = torch.arange(batch, dtype=torch.int32) * chunks * CHUNK

    def torch_path():
        scores = ops.channel_scores(q, keys_cm, channels, key_start, lens, sink, recent, context)
        return cc.select_tokens(scores, lens, sink, recent, k)

    torch_ms = _timed(torch_path, reps)
    # Scores summed in another order: a near-tie at the k-th place may go either way.
    want, got = torch_path().flatten(0, 1), native.channel_top_k(*args, CHUNK, PAGE_ROWS, k)
    overlap = torch.stack([torch.isin(g, w).float().mean()
                           for g, w in zip(got.flatten(0, 1), want)]).mean().item()
    return {"context": context, "batch": batch, "k": k, "c_ms": c_ms, "torch_ms": torch_ms,
            "speedup": torch_ms / c_ms, "overlap": overlap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="16384,32768,131072")
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--top-k", type=int, default=896)
    parser.add_argument("--channels", type=int, default=12)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if native.library() is None:
        raise SystemExit("bench_channel_top_k: the C kernels are not built (no C compiler?)")
    cases = [(c, b) for c in map(int, args.contexts.split(",")) for b in
             map(int, args.batches.split(","))]
    rows = [measure(c, b, args.top_k, args.channels, 8, 120, args.reps)
            for c, b in tqdm(cases, desc="channel top-k")]
    print("| context | batch | torch path ms | C ms | speed-up | same tokens |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | {r['torch_ms']:.2f} | {r['c_ms']:.2f} | "
              f"{r['speedup']:.1f}x | {r['overlap']:.4f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    meta = {"command": f"bench_channel_top_k.py {command}", "date": str(date.today()),
            "machine": f"{torch.get_num_threads()} threads, {platform.machine()}"}
    (out / "channel_top_k.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
