"""Aggregate scored records into accuracy tables (JSON, Markdown) and plots (PNG)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path


def percent(xs) -> float:
    """Mean of 0..1 scores, in %."""
    xs = list(xs)
    return 100.0 * sum(xs) / len(xs) if xs else float("nan")


def summarize(records: list[dict]) -> dict:
    """Accuracy (%) per backend x task x length, and per backend x depth x length (needles).

    ``decode_accuracy``: the same over the answers that need decode steps (records whose
    ``decode_score`` is not None; see run.decode_score). ``by_length``: for a method's records,
    how many requests decoded sparsely, their mean hit rate and, measured with
    ``measure_fidelity``, their mean relative error and chunk recall (run.fidelity)."""
    by_task, by_depth, decode, modes = (defaultdict(list) for _ in range(4))
    for r in records:
        key = (r["backend"], r["task"], r["length"])
        by_task[key].append(r["score"])
        if r.get("decode_score") is not None:
            decode[key].append(r["decode_score"])
        if r["depth"] is not None:
            by_depth[(r["backend"], r["depth"], r["length"])].append(r["score"])
        if "mode" in r:
            modes[(r["backend"], r["length"])].append(r)
    return {
        "by_task": [{"backend": b, "task": t, "length": n, "accuracy": percent(s),
                     "samples": len(s),
                     "decode_accuracy": percent(decode[(b, t, n)]) if decode[(b, t, n)] else None,
                     "decode_samples": len(decode[(b, t, n)])}
                    for (b, t, n), s in sorted(by_task.items())],
        "by_depth": [{"backend": b, "depth": d, "length": n, "accuracy": percent(s),
                      "samples": len(s)}
                     for (b, d, n), s in sorted(by_depth.items())],
        "by_length": [{"backend": b, "length": n, "requests": len(rs),
                       "sparse": sum(r["mode"] == "sparse" for r in rs),
                       "hit_rate": _avg([r["hit_rate"] for r in rs if r["mode"] == "sparse"]),
                       "speculation_hit_rate": _avg([r.get("speculation_hit_rate")
                                                     for r in rs if r["mode"] == "sparse"]),
                       **{name: _avg([r.get(name) for r in rs if r["mode"] == "sparse"])
                          for name in ("relative_error", "chunk_recall")}}
                      for (b, n), rs in sorted(modes.items())],
    }


def _avg(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def markdown(summary: dict, backends: list[str], engines: list[dict] | None = None) -> str:
    """A task x length table with one column per backend, the same over answers that need
    decode steps, the engines' settings and sparse modes, then a depth x length table each."""
    acc = {(r["backend"], r["task"], r["length"]): r for r in summary["by_task"]}
    tasks = sorted({r["task"] for r in summary["by_task"]})
    lengths = sorted({r["length"] for r in summary["by_task"]})
    lines = ["| task | length | " + " | ".join(f"`{b}`" for b in backends) + " |",
             "|---|---:|" + "---:|" * len(backends)]
    for task in tasks:
        for n in lengths:
            cells = [acc.get((b, task, n)) for b in backends]
            if any(cells):
                lines.append(f"| {task} | {n} | " + " | ".join(
                    f"{c['accuracy']:.1f}" if c else "" for c in cells) + " |")
    for n in lengths:
        cells = [[r["accuracy"] for r in summary["by_task"] if r["backend"] == b and r["length"] == n]
                 for b in backends]
        lines.append(f"| **mean** | {n} | " + " | ".join(
            f"**{sum(c) / len(c):.1f}**" if c else "" for c in cells) + " |")
    if any(r.get("decode_accuracy") is not None for r in summary["by_task"]):
        lines += ["", "Answers that need decode steps (the first generated token comes from the "
                  "exact prefill): accuracy (%) over them, (records)", "",
                  "| task | length | " + " | ".join(f"`{b}`" for b in backends) + " |",
                  "|---|---:|" + "---:|" * len(backends)]
        for task in tasks:
            for n in lengths:
                cells = [acc.get((b, task, n)) for b in backends]
                if any(c and c["decode_samples"] for c in cells):
                    lines.append(f"| {task} | {n} | " + " | ".join(
                        f"{c['decode_accuracy']:.1f} ({c['decode_samples']})"
                        if c and c["decode_samples"] else "" for c in cells) + " |")
    modes = {(r["backend"], r["length"]): r for r in summary.get("by_length", [])}
    if engines:
        lines += ["", "Engines (one per fixed spec, one per length for a ratio spec): settings, "
                  "requests that decoded sparsely, their mean hit rate, their in-engine fidelity "
                  "(with `measure_fidelity`: relative error against dense attention / chunk "
                  "recall), engine wall time", "",
                  "| engine | length | sparse_budget | outlier_chunks | sparse requests | "
                  "hit rate | fidelity | seconds |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for e in engines:
            ns = [e["length"]] if e["length"] is not None else sorted(
                n for b, n in modes if b == e["backend"]) or [None]
            for j, n in enumerate(ns):
                m = modes.get((e["backend"], n))
                hit = f"{m['hit_rate']:.2f}" if m and m["hit_rate"] is not None else ""
                if m and m.get("speculation_hit_rate") is not None:  # SpeCache's guess rows
                    hit += f" (guessed {m['speculation_hit_rate']:.2f})"
                sparse = f"{m['sparse']}/{m['requests']}" if m else ""
                fid = (f"{m['relative_error']:.4f} / {m['chunk_recall']:.2f}"
                       if m and m.get("relative_error") is not None else "")
                settings = e["settings"]
                lines.append(
                    f"| `{e['backend']}` | {n if n is not None else 'all'} | "
                    f"{settings.get('sparse_budget', '')} | {settings.get('outlier_chunks', '')} | "
                    f"{sparse} | {hit} | {fid} | {e['seconds'] if j == 0 else ''} |")
    for b in backends:
        depth = {(r["depth"], r["length"]): r["accuracy"] for r in summary["by_depth"] if r["backend"] == b}
        if not depth:
            continue
        ns = sorted({n for _, n in depth})
        lines += ["", f"Needle tasks, `{b}`: accuracy (%) by depth (rows) and length (columns)", "",
                  "| depth | " + " | ".join(str(n) for n in ns) + " |", "|---:|" + "---:|" * len(ns)]
        for d in sorted({d for d, _ in depth}):
            lines.append(f"| {d:g} | " + " | ".join(
                f"{depth[(d, n)]:.0f}" if (d, n) in depth else "" for n in ns) + " |")
    return "\n".join(lines) + "\n"


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") or "backend"


def plots(summary: dict, backends: list[str], out: Path) -> list[Path]:
    """accuracy_vs_length.png (a panel per task, a line per backend) and heatmap_<backend>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    tasks = sorted({r["task"] for r in summary["by_task"]})
    cols = min(3, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for b in backends:
            pts = sorted((r["length"], r["accuracy"]) for r in summary["by_task"]
                         if r["backend"] == b and r["task"] == task)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=b)
        ax.set_title(task)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-5, 105)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "accuracy_vs_length.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for b in backends:
        cells = {(r["depth"], r["length"]): r["accuracy"] for r in summary["by_depth"] if r["backend"] == b}
        if not cells:
            continue
        depths, lengths = sorted({d for d, _ in cells}), sorted({n for _, n in cells})
        grid = [[cells.get((d, n), float("nan")) for n in lengths] for d in depths]
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.2 + 0.5 * len(depths)))
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"needle tasks: {b}", fontsize=9)
        fig.colorbar(im, ax=ax, label="accuracy (%)")
        fig.tight_layout()
        paths.append(out / f"heatmap_{slug(b)}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def load_runs(dirs: list[Path]) -> list[dict]:
    """The results.json of each run directory, in order."""
    import json

    return [json.loads((Path(d) / "results.json").read_text()) for d in dirs]


def merge(out: Path, dirs: list[Path]) -> dict:
    """One report from several runs' results.json (e.g. a long context run separately, with
    fewer samples): records and engines concatenated, tables and plots rebuilt into ``out``."""
    import json

    runs = load_runs(dirs)
    records = [r for run in runs for r in run["records"]]
    engines = [e for run in runs for e in run["meta"].get("engines", [])]
    labels = list(dict.fromkeys(b for run in runs for b in run["meta"]["backends"]))
    summary = summarize(records)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"merged_from": [run["meta"] for run in runs], "backends": labels, "engines": engines}
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "records": records}, indent=1) + "\n")
    (out / "results.md").write_text(markdown(summary, labels, engines))
    plots(summary, labels, out)
    return summary


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Merge accuracy runs: " + merge.__doc__.split(":")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("dirs", type=Path, nargs="+", help="run directories holding results.json")
    a = p.parse_args()
    merge(a.out, a.dirs)
    print((a.out / "results.md").read_text())
