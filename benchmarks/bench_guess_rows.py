"""The exact part of a SpeCache step with a guess row (MiniKV family's ``_attend_with_guess``):
its 16-bit rows and ring for [output row, guess row] per request, one layer at Llama-3.1-8B
shapes (8 KV heads, 32 query heads, head_dim 128, bf16), 2-bit pages built by the unit tests'
World (tests/unit/test_minikv_pages.py), 1,000-1,300-token prompts and 31 generated tokens.
Run it on two checkouts (PYTHONPATH) to compare implementations:

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_guess_rows.py --batch 2 8

Timed: the best and the median of 7 rounds of 300 calls, one thread.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from test_minikv_pages import World, make_method  # noqa: E402

from vllm_shadowkv.methods.base import RequestRows  # noqa: E402
from vllm_shadowkv.methods.minikv import MiniKVSettings  # noqa: E402


def time_batch(n: int) -> tuple[float, float]:
    settings = MiniKVSettings(min_sparse_len=100, residual=64)
    method = make_method(settings, h=8, d=128, num_layers=1, dtype=torch.bfloat16)
    requests = {f"r{i}": (1000 + 37 * i, 60) for i in range(n)}
    world = World(method, requests, hq=32, seed=1)
    for r in requests:
        world.prefill(r, chunk=512)
    for s in range(30):
        world.step({r: world.prompt[r] + s + 1 for r in requests})
    rows, q, k, v = [], [], [], []
    for i, r in enumerate(requests):
        s = world.prompt[r] + 31
        world.write(r, s - 1, s)
        rows.append(RequestRows(r, world.prompt[r], s + 1, 2 * i, 2 * i + 2, world.blocks[r],
                                guess=1))
        q += [world.q[r][s - 1:s], torch.randn(1, 32, 128).bfloat16()]
        k += [world.k[r][s - 1:s], torch.randn(1, 8, 128).bfloat16()]
        v += [world.v[r][s - 1:s], torch.randn(1, 8, 128).bfloat16()]
    q, k, v = torch.cat(q).unflatten(0, (n, 2)), torch.cat(k), torch.cat(v)
    plans = [method._caught_up_plan(world.ctx, r, 2) for r in rows]
    batch, ring = method._batch_plan(rows, plans), method._ring(world.ctx, rows, 2)
    index = torch.arange(2 * n)

    def call():
        method._attend_with_guess(world.ctx, batch, ring, 1, q, k, v, index)

    for _ in range(20):
        call()
    rounds = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(300):
            call()
        rounds.append((time.perf_counter() - t) / 300 * 1e6)
    return min(rounds), statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| requests | best us | median us |\n| ---: | ---: | ---: |")
    for n in args.batch:
        best, median = time_batch(n)
        print(f"| {n} | {best:.0f} | {median:.0f} |")


if __name__ == "__main__":
    main()
