"""Short requests' decode attention on the CPU, one layer at Llama-3.1-8B shapes: the engine's
exact path for requests below ``min_sparse_len`` against vLLM's CPU attention op over its own
cache (what the default backend runs: ``bench_layer_decode.DenseLayer``), for the same batch of
B requests of L context tokens, one decode token per request. Needs vLLM's CPU build.

  .venv/bin/python benchmarks/bench_exact_decode.py --out benchmarks/exact_decode/cpu.json

(writes the JSON and a plot beside it, cpu.png).

* in place: ``exact_attention_step`` on the engine's pages (ShadowKV's layout, every request
  short), the step's K/V written by ``write_exact``; the requests' row ids planned once per
  step and kept for the step's other layers (the plan's cost reported apart, once per step);
* copied: the path before it, each request's context gathered out of the pages and copied into
  a cache of vLLM's layout, then vLLM's op (``exact_attention``, still what prefill chunks run).

Timed: the median of ``--reps`` steps after ``--warmup``, one torch/OpenMP thread each.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench_layer_decode import (BLOCK, DTYPE, H_KV, HEAD_DIM, SCALE, DenseLayer, cpu_name,
                                decode_inputs, llama_rope, measure, one_thread, prompt_kv)
from plots import ratio_by_context
from vllm_shadowkv.backend.exact_attention import (InPlacePlan, exact_attention,
                                                   exact_attention_step, write_exact)
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.methods.base import KVShapes, RequestRows
from vllm_shadowkv.methods.shadowkv import ShadowKVMethod, ShadowKVSettings


class ExactLayer:
    """``n`` short requests of the same prompt in the engine's exact pages; ``step(batch)``
    decodes the first ``batch`` at context + 1 tokens, in place or copied (``mode``)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n: int, mode: str):
        self.context = context = len(keys)
        self.mode = mode
        shapes = KVShapes(H_KV, HEAD_DIM, DTYPE, BLOCK, num_layers=1, max_model_len=context + 1)
        settings = ShadowKVSettings(min_sparse_len=context + 1).resolved(shapes)
        self.layout = layout = PageLayout(ShadowKVMethod(settings, shapes))
        per_request = layout.exact_blocks(context + 1)
        self.cache = torch.zeros(1 + n * per_request, 1, BLOCK,
                                 layout.page_bytes // BLOCK // DTYPE.itemsize, dtype=DTYPE)
        self.reqs = []
        positions = torch.arange(context)
        for i in range(n):
            block_ids = 1 + i * per_request + torch.arange(per_request)
            blocks, slots = layout.exact_token_slots(context, block_ids, positions)
            write_exact(self.cache, layout, blocks, slots, keys, values)
            self.reqs.append(RequestRows(f"r{i}", context, context + 1, i, i + 1, block_ids))
        self.plans = {}

    def plan_ms(self, batch: int) -> float:
        """One step's planning of the in-place row ids (the step's first layer pays it)."""
        start = time.perf_counter()
        InPlacePlan.of(self.cache, self.layout, self.reqs[:batch], 1)
        return 1e3 * (time.perf_counter() - start)

    def step(self, batch: int):
        reqs = self.reqs[:batch]
        blocks, slots = self.layout.exact_token_slots_batch(
            [r.prompt_len for r in reqs], torch.stack([r.block_ids for r in reqs]),
            torch.full((batch, 1), self.context))
        blocks, slots = blocks.flatten(), slots.flatten()
        plans = self.plans.setdefault(batch, {})

        def run(q, k, v):
            write_exact(self.cache, self.layout, blocks, slots, k, v)
            if self.mode == "copied":
                return torch.cat([exact_attention(self.cache, self.layout, r.prompt_len,
                                                  r.block_ids, r.seq_len, q[i:i + 1], SCALE)[0]
                                  for i, r in enumerate(reqs)])
            results = exact_attention_step(self.cache, self.layout, reqs, q, SCALE,
                                           [False] * batch, plans)
            return torch.cat([out for out, _ in results])
        return run


def plot(rows: list[dict], machine: str, path: Path) -> None:
    series = {}
    for batch in sorted({r["batch"] for r in rows}):
        pts = [r for r in rows if r["batch"] == batch]
        for key, label in (("in_place_over_default", "in place"),
                           ("copied_over_default", "copied (before)")):
            series[f"{label}, batch {batch}"] = ([p["context"] for p in pts],
                                                  [p[key] for p in pts])
    ratio_by_context(series, "time / vLLM's CPU attention op's",
                     f"Short requests' decode attention, one layer, {machine}", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    rows = []
    with one_thread():
        for context in tqdm(args.contexts, desc="contexts", unit="context"):
            keys, values = prompt_kv(context, llama_rope(context + 1))
            n = max(args.batches)
            layers = {"default": DenseLayer(keys, values, n),
                      "in_place": ExactLayer(keys, values, n, "in_place"),
                      "copied": ExactLayer(keys, values, n, "copied")}
            for batch in args.batches:
                inputs = decode_inputs(batch, args.warmup + args.reps)
                row = {"context": context, "batch": batch}
                for name, layer in layers.items():
                    row[f"{name}_ms"] = measure(layer, batch, inputs, args.warmup)["ms"]
                row["plan_ms"] = statistics.median(
                    layers["in_place"].plan_ms(batch) for _ in range(5))
                row["in_place_over_default"] = row["in_place_ms"] / row["default_ms"]
                row["copied_over_default"] = row["copied_ms"] / row["default_ms"]
                outs = {name: layer.step(batch)(*inputs[0]).float()
                        for name, layer in layers.items()}
                for name in ("default", "copied"):
                    diff = outs["in_place"] - outs[name]
                    row[f"in_place_vs_{name}_max_abs_diff"] = float(diff.abs().max())
                rows.append(row)
                print(json.dumps(row))
    result = {"machine": cpu_name(), "threads": 1, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        plot(rows, result["machine"], args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
