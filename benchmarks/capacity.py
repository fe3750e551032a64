"""KV capacity as vLLM itself reports it: default backend vs shadowkv, same KV memory, one run.

  VLLM_CPU_KVCACHE_SPACE=8 .venv/bin/python benchmarks/capacity.py

For each backend and each request length L (32K, 64K, 128K) an engine is started on the
llama8b-shape model (Llama-3.1-8B attention shapes: 32 q / 8 KV heads, head_dim 128) with
``max_model_len=L``, in a fresh process, in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0).
No prompt is run: capacity is decided when the engine sizes its KV cache. Read from the engine
objects, not from log text:

* ``num_gpu_blocks`` (``vllm_config.cache_config``, same as the scheduler's block pool) x
  ``block_size``: token slots of the pool (for shadowkv these are *compressed*-token slots);
* ``kv_cache_size_tokens`` and ``kv_cache_max_concurrency``: what vLLM logs as
  "<device> KV cache size: N tokens, Maximum concurrency for L tokens per request: X";
* the same concurrency recomputed with vLLM's ``get_max_concurrency_for_kv_cache_config`` from
  the scheduler's KV cache config, for every L, in every engine (a consistency check: the pool
  does not depend on max_model_len, so the 128K engine predicts the 32K engine's figure).

shadowkv settings are the paper's defaults (rank 160, chunk 8, budget 2048, 48 outlier chunks,
local window 32). Writes benchmarks/capacity/capacity.json and capacity.png.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "capacity"
LENGTHS = (32768, 65536, 131072)
PAPER_SETTINGS = {"rank": 160, "chunk_size": 8, "sparse_budget": 2048, "outlier_chunks": 48,
                  "local_window": 32}
BACKENDS = ("default", "shadowkv")
DESIGN_TARGET = 6.0  # the design contract: at least 6x the default's for long prompts (128K)


# -- child: one engine, its capacity figures --------------------------------------------------
def concurrency_for(vllm_config, kv_cache_config, length: int) -> float:
    """vLLM's max concurrency for ``length``-token requests, from this engine's KV cache config
    (``get_max_concurrency_for_kv_cache_config``), as an engine with max_model_len=length sees
    it."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    config = copy.deepcopy(kv_cache_config)
    for group in config.kv_cache_groups:
        if hasattr(group.kv_cache_spec, "max_model_len"):  # CompressedKVSpec carries it
            group.kv_cache_spec = dataclasses.replace(group.kv_cache_spec, max_model_len=length)
    model_config = vllm_config.model_config
    saved = model_config.max_model_len
    model_config.max_model_len = length
    try:
        return get_max_concurrency_for_kv_cache_config(vllm_config, config)
    finally:
        model_config.max_model_len = saved


def engine_capacity(model: str, backend: str, max_model_len: int, settings: dict,
                    lengths: tuple[int, ...]) -> dict:
    """Start one engine (in this process) and read its KV capacity from the engine objects."""
    from vllm import LLM
    from vllm.utils.math_utils import cdiv

    kwargs = {}
    if backend == "shadowkv":
        kwargs = {"attention_backend": "shadowkv", "additional_config": {"shadowkv": settings}}
    start = time.perf_counter()
    llm = LLM(model=model, max_model_len=max_model_len, enable_prefix_caching=False,
              enforce_eager=True, seed=0, **kwargs)
    startup_s = time.perf_counter() - start
    vllm_config = llm.llm_engine.vllm_config
    cache_config = vllm_config.cache_config
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core
    kv_cache_config = scheduler.kv_cache_config
    (group,) = kv_cache_config.kv_cache_groups  # one full-attention group on this model
    spec = group.kv_cache_spec
    pool = scheduler.kv_cache_manager.block_pool
    num_layers = len(group.layer_names)
    result = {
        "backend": backend,
        "spec": type(spec).__name__,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
        "num_layers": num_layers,
        "block_size": cache_config.block_size,
        "num_gpu_blocks": cache_config.num_gpu_blocks,
        "scheduler_pool_blocks": pool.num_gpu_blocks,
        "kv_slots": cache_config.num_gpu_blocks * cache_config.block_size,
        "page_size_bytes_per_layer": spec.page_size_bytes,
        "kv_cache_size_tokens": cache_config.kv_cache_size_tokens,  # vLLM's logged figure
        "max_concurrency": cache_config.kv_cache_max_concurrency,  # vLLM's logged figure
        "blocks_per_request": cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes),
        "computed_concurrency": {str(n): concurrency_for(vllm_config, kv_cache_config, n)
                                 for n in lengths},
        "startup_s": round(startup_s, 1),
    }
    if backend == "shadowkv":
        layout = spec.layout
        store_bytes = layout.store_bytes(max_model_len)
        store_capacity = spec.stamp.store_bytes
        result["shadowkv"] = {
            "settings": spec.stamp.settings.as_dict(),
            # a compressed token: A row + landmark share
            "slot_bytes_per_layer": layout.page_bytes // layout.block_size,
            "exact_token_bytes_per_layer": layout.exact_token_bytes,
            "exact_tokens_per_page": layout.exact_per_page,
            "packed_blocks": layout.method.pages.packed_blocks(max_model_len),
            "state_blocks": layout.method.pages.state_blocks(max_model_len),
            "steady_blocks": layout.steady_blocks(max_model_len),
            "staging_blocks": layout.exact_blocks(max_model_len),
            "peak_blocks": layout.peak_blocks(max_model_len),
            "value_store_bytes_per_request": store_bytes,
            "value_store_capacity_bytes": store_capacity,
            "store_bound_concurrency": store_capacity // store_bytes if store_bytes else None,
        }
    return result


def child_main(args) -> None:
    settings = json.loads(args.settings)
    lengths = tuple(int(n) for n in args.lengths.split(","))
    result = engine_capacity(args.model, args.backend, args.max_model_len, settings, lengths)
    Path(args.child_out).write_text(json.dumps(result, indent=1))
    os._exit(0)  # skip engine teardown: the process ends here


# -- parent: every (backend, length) in a fresh process ---------------------------------------
def run_child(model: str, backend: str, length: int, settings: dict, lengths, out: Path) -> dict:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("OMP_NUM_THREADS", "1")  # start-up only; spares a shared machine
    cmd = [sys.executable, __file__, "--child-out", str(out), "--model", model,
           "--backend", backend, "--max-model-len", str(length), "--settings", json.dumps(settings),
           "--lengths", ",".join(map(str, lengths))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{backend} @ {length} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def admissible(engine: dict) -> int:
    """Most whole requests of max_model_len tokens that fit in the pool at once: vLLM's figure
    counts the null block and fractional requests; shadowkv's peak (exact staging of the last
    prompt admitted, ``max_staging_requests`` = 1) must fit next to the others' steady pages."""
    usable = engine["num_gpu_blocks"] - 1
    if engine["backend"] == "default":
        return usable // engine["blocks_per_request"]
    skv = engine["shadowkv"]
    if usable < skv["peak_blocks"]:
        return 0
    return 1 + (usable - skv["peak_blocks"]) // skv["steady_blocks"]


def summarize(engines: list[dict], lengths) -> list[dict]:
    by = {(e["backend"], e["max_model_len"]): e for e in engines}
    rows = []
    for n in lengths:
        d, s = by[("default", n)], by[("shadowkv", n)]
        rows.append({
            "length": n,
            "default_concurrency": d["max_concurrency"],
            "shadowkv_concurrency": s["max_concurrency"],
            "concurrency_ratio": s["max_concurrency"] / d["max_concurrency"],
            "default_kv_size_tokens": d["kv_cache_size_tokens"],
            "shadowkv_kv_size_tokens": s["kv_cache_size_tokens"],
            "default_kv_slots": d["kv_slots"],
            "shadowkv_kv_slots": s["kv_slots"],
            "slots_ratio": s["kv_slots"] / d["kv_slots"],
            "default_blocks_per_request": d["blocks_per_request"],
            "shadowkv_blocks_per_request": s["blocks_per_request"],
            "default_mib_per_request": d["blocks_per_request"] * d["page_size_bytes_per_layer"]
            * d["num_layers"] / 2**20,
            "shadowkv_mib_per_request": s["blocks_per_request"] * s["page_size_bytes_per_layer"]
            * s["num_layers"] / 2**20,
            "shadowkv_store_bound_concurrency": s["shadowkv"]["store_bound_concurrency"],
            # Requests the block manager can hold at once (whole requests, null block excluded;
            # shadowkv: the last one admitted still needs its exact staging pages).
            "default_admissible": admissible(d),
            "shadowkv_admissible": admissible(s),
            "admissible_ratio": admissible(s) / max(admissible(d), 1),
        })
    return rows


def check_consistency(engines: list[dict]) -> list[str]:
    """Every engine's recomputed concurrency for length n must equal what the engine started at
    max_model_len=n reported (vLLM's own figure)."""
    reported = {(e["backend"], e["max_model_len"]): e["max_concurrency"] for e in engines}
    problems = []
    for e in engines:
        if e["num_gpu_blocks"] != e["scheduler_pool_blocks"]:
            problems.append(f"{e['backend']}@{e['max_model_len']}: cache_config blocks "
                            f"{e['num_gpu_blocks']} != scheduler pool {e['scheduler_pool_blocks']}")
        for n, value in e["computed_concurrency"].items():
            ref = reported.get((e["backend"], int(n)))
            if ref is not None and abs(ref - value) > 1e-9 * max(1.0, ref):
                problems.append(f"{e['backend']}@{e['max_model_len']}: computed {value} for {n}, "
                                f"engine at {n} reported {ref}")
    return problems


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name:")]
    return names[0] if names else "unknown CPU"


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['length'] // 1024}K" for r in rows]
    x = range(len(rows))
    width = 0.38
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    d = [r["default_concurrency"] for r in rows]
    s = [r["shadowkv_concurrency"] for r in rows]
    ax1.bar([i - width / 2 for i in x], d, width, label="default (CPU_ATTN)", color="#888888")
    ax1.bar([i + width / 2 for i in x], s, width, label="shadowkv", color="#1f77b4")
    for i, r in enumerate(rows):
        ax1.text(i + width / 2, s[i], f"{r['concurrency_ratio']:.2f}x", ha="center", va="bottom",
                 fontsize=9)
    ax1.set_xticks(list(x), labels)
    ax1.set_xlabel("tokens per request (max_model_len)")
    ax1.set_ylabel("vLLM max concurrency (requests)")
    ax1.set_title("Maximum concurrency, same KV memory")
    ax1.legend()
    ratios = [r["concurrency_ratio"] for r in rows]
    ax2.bar(list(x), ratios, 0.5, color="#1f77b4")
    ax2.axhline(DESIGN_TARGET, color="red", linestyle="--",
                label=f"design target {DESIGN_TARGET:g}x")
    ax2.axhline(rows[-1]["slots_ratio"], color="gray", linestyle=":",
                label=f"pool slots ratio {rows[-1]['slots_ratio']:.2f}x")
    for i, v in enumerate(ratios):
        ax2.text(i, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=9)
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("shadowkv / default")
    ax2.set_title("Concurrency ratio")
    ax2.legend(loc="lower right")
    fig.suptitle(f"KV capacity, {meta['model']} ({meta['kv_cache_gib']} GiB KV cache, "
                 f"rank 160, chunk 8, budget 2048, 48 outliers)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--settings", default=json.dumps(PAPER_SETTINGS),
                        help="shadowkv settings (JSON); default: the paper's")
    parser.add_argument("--model", default=None, help="default: the local llama8b-shape model")
    # internal: one engine in this process
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out:
        child_main(args)
        return

    from tqdm import tqdm

    from vllm_shadowkv.models import build_model

    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "8"
    model = args.model or str(build_model("llama8b-shape"))
    settings = json.loads(args.settings)
    lengths = tuple(int(n) for n in args.lengths.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    engines = []
    jobs = [(n, b) for n in sorted(lengths, reverse=True) for b in BACKENDS]  # interleaved
    wall = time.perf_counter()
    for n, backend in tqdm(jobs, desc="engines", unit="engine"):
        engines.append(run_child(model, backend, n, settings, lengths,
                                 args.out / f".engine_{backend}_{n}.json"))
        (args.out / f".engine_{backend}_{n}.json").unlink()
    problems = check_consistency(engines)
    rows = summarize(engines, lengths)
    meta = {
        "command": "VLLM_CPU_KVCACHE_SPACE=%s .venv/bin/python benchmarks/capacity.py"
                   % os.environ["VLLM_CPU_KVCACHE_SPACE"],
        "model": Path(model).name.rsplit("-", 1)[0],
        "model_path": model,
        "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
        "shadowkv_settings": settings,
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core {_cpu_name()} ({platform.machine()}, CPU only)",
        "wall_s": round(time.perf_counter() - wall, 1),
        "design_target_at_128k": DESIGN_TARGET,
        "consistency_problems": problems,
    }
    (args.out / "capacity.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "engines": engines}, indent=1))
    plot(rows, meta, args.out / "capacity.png")

    print(f"\nKV cache {meta['kv_cache_gib']} GiB, {meta['model']}, shadowkv {settings}")
    print(f"{'length':>8} {'default conc':>13} {'shadowkv conc':>14} {'ratio':>7} "
          f"{'default slots':>14} {'shadowkv slots':>15} {'admissible d/s':>15}")
    for r in rows:
        print(f"{r['length']:>8} {r['default_concurrency']:>13.2f} "
              f"{r['shadowkv_concurrency']:>14.2f} {r['concurrency_ratio']:>6.2f}x "
              f"{r['default_kv_slots']:>14,} {r['shadowkv_kv_slots']:>15,} "
              f"{r['default_admissible']:>7}/{r['shadowkv_admissible']:<7}")
    for p in problems:
        print("INCONSISTENT:", p)
    print(f"wrote {args.out / 'capacity.json'} and capacity.png ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
