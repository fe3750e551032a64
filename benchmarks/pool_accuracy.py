"""Pool the needle records of several accuracy runs (``vllm_shadowkv.eval.run`` folders) into one
table per length: each backend's accuracy per task and overall, dense's on the same prompts, and
on the prompts dense answers (the issues' "tasks dense solves"), with the sample count of every
cell. A prompt is (task, length, depth, seed); a backend's record of a prompt seen in two folders
counts once (the first folder given wins).

  .venv/bin/python benchmarks/pool_accuracy.py benchmarks/accuracy/smollm2_2k_seed{1,2} \\
      --backends default specache-2 --dense default
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from vllm_shadowkv.eval.report import load_runs, percent


def load(folders: list[Path]) -> dict[tuple, dict]:
    """(backend, task, length, depth, seed) -> record, first folder first."""
    records = {}
    for run in load_runs(folders):
        for r in run["records"]:
            key = (r["backend"], r["task"], r["length"], r["depth"], r.get("seed", 0))
            records.setdefault(key, r)
    return records


def pool(records: dict[tuple, dict], backends: list[str], dense: str) -> list[dict]:
    """One row per (length, backend): prompts pooled over every depth and seed seen."""
    scores = defaultdict(dict)  # (backend, length) -> prompt -> score
    for (backend, task, length, depth, seed), r in records.items():
        scores[backend, length][task, depth, seed] = r["score"]
    rows = []
    for length in sorted({k[1] for k in scores}):
        reference = scores.get((dense, length), {})
        for backend in backends:
            mine = scores.get((backend, length))
            if not mine:
                continue
            by_task = defaultdict(list)
            for (task, _, _), score in mine.items():
                by_task[task].append(score)
            shared = [p for p in mine if p in reference]
            solved = [p for p in shared if reference[p] == 1.0]
            rows.append({
                "backend": backend, "length": length, "prompts": len(mine),
                "seeds": sorted({p[2] for p in mine}),
                "by_task": {t: (percent(s), len(s)) for t, s in sorted(by_task.items())},
                "mean": percent(mine.values()),
                "dense_same": percent(reference[p] for p in shared) if shared else None,
                "on_solved": (percent(mine[p] for p in solved), len(solved)) if solved else None,
            })
    return rows


def markdown(rows: list[dict]) -> str:
    tasks = sorted({t for r in rows for t in r["by_task"]})
    head = ["length", "backend", "seeds", *tasks, "mean", "dense, same prompts",
            "on the prompts dense answers"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [str(r["length"]), r["backend"], ", ".join(map(str, r["seeds"]))]
        for t in tasks:
            acc = r["by_task"].get(t)
            cells.append(f"{acc[0]:.0f} ({acc[1]})" if acc else "")
        cells.append(f"**{r['mean']:.1f}** ({r['prompts']})")
        cells.append("" if r["dense_same"] is None else f"{r['dense_same']:.1f}")
        cells.append("" if r["on_solved"] is None
                     else f"{r['on_solved'][0]:.1f} ({r['on_solved'][1]})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+", help="accuracy run folders")
    parser.add_argument("--backends", nargs="+", help="rows, in order (default: every one)")
    parser.add_argument("--dense", default="default", help="the backend others are compared to")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    records = load(args.folders)
    backends = args.backends or sorted({k[0] for k in records})
    rows = pool(records, backends, args.dense)
    print(markdown(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
