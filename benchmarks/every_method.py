"""One table and one plot for several ``throughput.py`` runs side by side (one run per method,
each against its own default engine): the ratios each run measured, never timings across runs.

  .venv/bin/python benchmarks/every_method.py benchmarks/throughput/<folder>

``<folder>`` holds one sub-folder per run (``<name>/throughput.json``, its first context).
Prints a markdown table and writes ``<folder>/every_method.png``: decode TPOT, first request's
TTFT and output tokens/s, each method / default (``--png`` elsewhere).
"""

import argparse
import json
from pathlib import Path

from plots import pyplot  # benchmarks/plots.py

MiB = 1 << 20


def summarise(run: Path) -> dict:
    data = json.loads((run / "throughput.json").read_text())
    row = data["rows"][0]
    default, method = data["runs"][0], data["runs"][1]
    assert default["backend"] == "default", run
    first_ttft = [r["per_request"][0]["ttft_s"] for r in (default, method)]
    return {
        "name": run.name, "method": method["backend"], "context": row["context"],
        "gen": default["gen"], "batch": (row["default_batch"], row["method_batch"]),
        "concurrency": (default["vllm_max_concurrency"], method["vllm_max_concurrency"]),
        "decode_ms": (row["default_decode_tpot_ms"], row["method_decode_tpot_ms"]),
        "decode_ratio": row["decode_tpot_ratio"],
        "ttft_s": tuple(first_ttft), "ttft_ratio": first_ttft[1] / first_ttft[0],
        "throughput_ratio": row["throughput_ratio"], "hit_rate": row["method_hit_rate"],
        "fetched_mib": (row["method_bytes_fetched"] or 0) / MiB,
        "sparse": row["method_sparse_requests"], "preemptions": row["preemptions"],
    }


def table(rows: list[dict]) -> str:
    lines = ["| run | batch default / method | vLLM's max concurrency | decode TPOT default / "
             "method | ratio | first TTFT default / method | ratio | output tok/s ratio | hit "
             "rate | host MiB fetched |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['batch'][0]} / {r['batch'][1]} | {r['concurrency'][0]:.1f} / "
            f"{r['concurrency'][1]:.1f} | {r['decode_ms'][0]:.1f} / {r['decode_ms'][1]:.1f} ms | "
            f"**{r['decode_ratio']:.2f}x** | {r['ttft_s'][0]:.2f} / {r['ttft_s'][1]:.2f} s | "
            f"**{r['ttft_ratio']:.2f}x** | **{r['throughput_ratio']:.2f}x** | "
            f"{r['hit_rate']:.2f} | {r['fetched_mib']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    figures = [("decode TPOT", "decode_ratio"), ("first TTFT", "ttft_ratio"),
               ("output tokens/s", "throughput_ratio")]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(figures)
    for k, (label, key) in enumerate(figures):
        xs = [i + (k - 1) * width for i in range(len(rows))]
        bars = ax.bar(xs, [r[key] for r in rows], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_ylabel("method / vLLM's default backend")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1.25 * max(r[key] for r in rows for _, key in figures))
    ax.legend(fontsize=8, loc="upper center", ncol=len(figures))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--png", type=Path, default=None,
                        help="default: <folder>/every_method.png")
    args = parser.parse_args()
    png = args.png or args.folder / "every_method.png"
    runs = sorted(p.parent for p in args.folder.glob("*/throughput.json"))
    if not runs:
        raise SystemExit(f"no <run>/throughput.json under {args.folder}")
    rows = [summarise(run) for run in runs]
    print(table(rows))
    first = rows[0]
    plot(rows, png,
         f"{first['context'] // 1024}K prompts, {first['gen']} output tokens, same KV memory "
         "(lower is faster for TPOT and TTFT)")
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
