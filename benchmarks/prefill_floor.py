"""The hardware floor under a throughput.py run: the prefill's arithmetic at the machine's
measured GEMM rate in the run's dtype, and the most output throughput any backend could reach
above it.

  .venv/bin/python benchmarks/prefill_floor.py \\
      benchmarks/throughput/llama8b_shape_16k_2cores_s61/throughput.json

Every request needs its own prefill of L prompt tokens, and on a CPU a prefill is compute-bound.
So whatever its batch and however fast its decode, a backend's output tokens/s are at most
G / P_floor, with G output tokens per request and P_floor = the prefill's FLOPs / the machine's
GEMM rate: its exact attention and its linear layers both at the rate of the machine's best GEMM
in the run's dtype, softmax, norms and everything else free. Divided by the default backend's
measured output tokens/s, that is the largest throughput ratio any CPU implementation could
reach in that run.

FLOPs of one prefill, from the model's config: 2 per weight of every layer's projections per
token; causal attention 2 x h_q x d x L (L + 1) per layer (QK^T and PV over the lower triangle);
the lm_head on the last token. The GEMM rate: the best of ``--reps`` ``F.linear`` calls at the
model's projection shapes, on all of this process's cores (``--threads``), the threads the
throughput run gave each engine. The measured prefill per prompt: the time until the batch's last
first token over the batch.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _widths(config: dict) -> tuple[int, int, int]:
    """(hidden, query width, key/value width) of the model."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    return (hidden, config["num_attention_heads"] * head_dim,
            config["num_key_value_heads"] * head_dim)


def _projections(config: dict) -> list[tuple[int, int]]:
    """(in, out) of a layer's projections: fused QKV, output, fused gate-up, down."""
    hidden, q_width, kv_width = _widths(config)
    inter = config["intermediate_size"]
    return [(hidden, q_width + 2 * kv_width), (q_width, hidden), (hidden, 2 * inter),
            (inter, hidden)]


def prefill_flops(config: dict, length: int) -> dict:
    hidden, q_width, _ = _widths(config)
    weights = sum(k * n for k, n in _projections(config))
    layers = config["num_hidden_layers"]
    linear = 2 * weights * length * layers + 2 * hidden * config["vocab_size"]
    attention = 2 * q_width * length * (length + 1) * layers
    return {"linear": linear, "attention": attention, "total": linear + attention}


def run_dtype(meta: dict, config: dict) -> torch.dtype:
    """The dtype the run served: its ``--dtype``, else the model's (bf16 for the local ones)."""
    name = meta.get("dtype", "auto")
    model = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return getattr(torch, model if name == "auto" else name)


def gemm_rate(config: dict, tokens: int, reps: int, dtype: torch.dtype) -> float:
    """The best GEMM rate (FLOP/s) in ``dtype`` over the model's projection shapes, ``tokens``
    rows."""
    best = 0.0
    for k, n in _projections(config):
        x = torch.randn(tokens, k, dtype=dtype)
        w = torch.randn(n, k, dtype=dtype)
        F.linear(x, w)  # warm-up
        for _ in range(reps):
            start = time.perf_counter()
            F.linear(x, w)
            best = max(best, 2 * tokens * k * n / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="throughput.json files")
    parser.add_argument("--model", default=None, help="default: the local llama8b-shape model")
    parser.add_argument("--threads", type=int, default=0, help="0: the runs' own")
    parser.add_argument("--tokens", type=int, default=2048, help="GEMM rows (a prefill chunk)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON (default: beside the run)")
    args = parser.parse_args()

    from vllm_shadowkv.models import build_model

    model = Path(args.model or build_model("llama8b-shape"))
    config = json.loads((model / "config.json").read_text())
    for path in args.runs:
        run = json.loads(path.read_text())
        meta = run["meta"]
        torch.set_num_threads(args.threads or meta["omp_num_threads"])
        dtype = run_dtype(meta, config)
        rate = gemm_rate(config, args.tokens, args.reps, dtype)
        rows = []
        for r in run["rows"]:
            length, gen = r["context"], meta["gen"]
            flops = prefill_flops(config, length)
            floor_s = flops["total"] / rate
            measured = {x["backend"]: x["ttft_s_max"] / x["batch"]
                        for x in run["runs"] if x["context"] == length and "wall_s" in x}
            best_tok_s = gen / floor_s
            rows.append({
                "context": length, "gen": gen, "prefill_tflop": flops["total"] / 1e12,
                "attention_share": flops["attention"] / flops["total"],
                "gemm_gflop_s": rate / 1e9, "prefill_floor_s": floor_s,
                "prefill_s": measured,
                "prefill_gflop_s": {b: flops["total"] / s / 1e9 for b, s in measured.items()},
                "default_output_tok_s": r["default_output_tok_s"],
                "method_output_tok_s": r["method_output_tok_s"],
                "measured_ratio": r["throughput_ratio"],
                "output_tok_s_bound": best_tok_s,
                "ratio_bound": best_tok_s / r["default_output_tok_s"],
            })
        out = args.out or path.with_name("prefill_floor.json")
        out.write_text(json.dumps({"run": str(path), "threads": torch.get_num_threads(),
                                   "dtype": str(dtype), "rows": rows}, indent=1))
        print(f"{path} ({torch.get_num_threads()} threads): {dtype} GEMM {rate / 1e9:.0f} GFLOP/s")
        for row in rows:
            prefill = ", ".join(f"{b} {s:.1f} s" for b, s in row["prefill_s"].items())
            print(f"  {row['context']:>6}: {row['prefill_tflop']:.2f} TFLOP per prefill "
                  f"({100 * row['attention_share']:.0f} % attention), floor "
                  f"{row['prefill_floor_s']:.1f} s, measured {prefill}; output tok/s at most "
                  f"{row['output_tok_s_bound']:.2f} = {row['ratio_bound']:.2f}x the default's "
                  f"{row['default_output_tok_s']:.2f} (measured ratio {row['measured_ratio']:.2f}x)")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
