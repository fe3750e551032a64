"""KV capacity as vLLM itself reports it: the default backend vs each method, same KV memory, one run.

  VLLM_CPU_KVCACHE_SPACE=8 .venv/bin/python benchmarks/capacity.py

For each backend (default, shadowkv, minikv, specache, tailorkv) and each request length L (32K, 64K, 128K) an engine is started on the
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

Method settings are each paper's defaults: shadowkv rank 160, chunk 8, budget 2048, 48 outlier
chunks, local window 32; minikv its defaults (2-bit KIVI groups of 16, 25 % heavy hitters + 25 %
recent window, pyramid layer budgets); specache its defaults (1-bit KIVI groups of 64, top-64
slots per KV head); tailorkv its defaults with Llama-3.x's layer set (layer 0 quantized at 1 bit,
the other an S-layer of 8 + 120 + 896 tokens; the llama8b-shape model has 2 layers, so half its
layers are quantized against 1 of 32 in Llama-3.1-8B). Writes benchmarks/capacity/capacity.json and capacity.png.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "capacity"
LENGTHS = (32768, 65536, 131072)
PAPER_SETTINGS = {"shadowkv": {"rank": 160, "chunk_size": 8, "sparse_budget": 2048,
                               "outlier_chunks": 48, "local_window": 32},
                  "minikv": {}, "specache": {}, "tailorkv": {"q_layers": [0]}}
BACKENDS = ("default", "shadowkv", "minikv", "specache", "tailorkv")
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
    if backend != "default":
        kwargs = {"attention_backend": backend, "additional_config": {backend: settings}}
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
        # one block over every layer (a method's layers may have pages of different sizes)
        "block_bytes": sum(t.block_stride * len(t.layers) for t in kv_cache_config.kv_cache_tensors),
        "kv_cache_size_tokens": cache_config.kv_cache_size_tokens,  # vLLM's logged figure
        "max_concurrency": cache_config.kv_cache_max_concurrency,  # vLLM's logged figure
        "blocks_per_request": cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes),
        "computed_concurrency": {str(n): concurrency_for(vllm_config, kv_cache_config, n)
                                 for n in lengths},
        "startup_s": round(startup_s, 1),
    }
    if backend != "default":
        layout = spec.layout
        store_bytes = layout.store_bytes(max_model_len)
        store_capacity = spec.stamp.store_bytes
        result["method"] = {
            "settings": spec.stamp.settings.as_dict(),
            "token_bytes_per_layer": [layout.method.token_bytes(i) for i in range(num_layers)],
            "exact_token_bytes_per_layer": layout.exact_token_bytes,
            "exact_tokens_per_page": layout.exact_per_page,
            "region_blocks": layout.region_blocks(max_model_len),
            "steady_blocks": layout.steady_blocks(max_model_len),
            "staging_blocks": layout.exact_blocks(max_model_len),
            "peak_blocks": layout.peak_blocks(max_model_len),
            "store_bytes_per_request": store_bytes,
            "store_capacity_bytes": store_capacity,
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
    counts the null block and fractional requests; a method's peak (exact staging of the last
    prompt admitted, ``max_staging_requests`` = 1) must fit next to the others' steady pages."""
    usable = engine["num_gpu_blocks"] - 1
    if engine["backend"] == "default":
        return usable // engine["blocks_per_request"]
    method = engine["method"]
    if usable < method["peak_blocks"]:
        return 0
    return 1 + (usable - method["peak_blocks"]) // method["steady_blocks"]


def summarize(engines: list[dict], lengths, backends) -> list[dict]:
    """One row per length: each backend's figures, the methods' also as ratios to the default."""
    by = {(e["backend"], e["max_model_len"]): e for e in engines}
    rows = []
    for n in lengths:
        row = {"length": n}
        default = by[("default", n)]
        for backend in backends:
            e = by[(backend, n)]
            figures = {
                "concurrency": e["max_concurrency"],
                "kv_size_tokens": e["kv_cache_size_tokens"],
                "kv_slots": e["kv_slots"],
                "blocks_per_request": e["blocks_per_request"],
                "mib_per_request": e["blocks_per_request"] * e["block_bytes"] / 2**20,
                # Requests the block manager can hold at once (whole requests, null block
                # excluded; a method's last one admitted still needs its exact staging pages).
                "admissible": admissible(e),
            }
            if backend != "default":
                figures |= {
                    "concurrency_ratio": e["max_concurrency"] / default["max_concurrency"],
                    "slots_ratio": e["kv_slots"] / default["kv_slots"],
                    "admissible_ratio": admissible(e) / max(admissible(default), 1),
                    "store_mib_per_request": e["method"]["store_bytes_per_request"] / 2**20,
                    "store_bound_concurrency": e["method"]["store_bound_concurrency"],
                }
            row[backend] = figures
        rows.append(row)
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


COLORS = {"default": "#888888", "shadowkv": "#1f77b4", "minikv": "#ff7f0e",
          "specache": "#2ca02c", "tailorkv": "#d62728"}


def plot(rows: list[dict], backends, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['length'] // 1024}K" for r in rows]
    methods = [b for b in backends if b != "default"]
    width = 0.8 / len(backends)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for j, backend in enumerate(backends):
        xs = [i + (j - (len(backends) - 1) / 2) * width for i in range(len(rows))]
        ax1.bar(xs, [r[backend]["concurrency"] for r in rows], width, label=backend,
                color=COLORS.get(backend))
    ax1.set_xticks(range(len(rows)), labels)
    ax1.set_xlabel("tokens per request (max_model_len)")
    ax1.set_ylabel("vLLM max concurrency (requests)")
    ax1.set_title("Maximum concurrency, same KV memory")
    ax1.legend()
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(rows))]
        ratios = [r[method]["concurrency_ratio"] for r in rows]
        ax2.bar(xs, ratios, width, label=method, color=COLORS.get(method))
        for x, v in zip(xs, ratios):
            ax2.text(x, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax2.axhline(DESIGN_TARGET, color="red", linestyle="--",
                label=f"design target {DESIGN_TARGET:g}x")
    ax2.set_xticks(range(len(rows)), labels)
    ax2.set_ylabel("method / default")
    ax2.set_title("Concurrency ratio to the default backend")
    ax2.legend(loc="lower right")
    paper = all(meta["settings"][m] == PAPER_SETTINGS.get(m, {}) for m in methods)
    which = "its paper's" if paper else "the given"
    fig.suptitle(f"KV capacity by vLLM's accounting, {meta['model']} "
                 f"({meta['kv_cache_gib']} GiB KV cache, each method at {which} settings)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated; 'default' is always measured")
    parser.add_argument("--settings", default=json.dumps(PAPER_SETTINGS),
                        help="method settings, JSON keyed by method; default: each paper's")
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
    backends = ("default",) + tuple(b for b in args.backends.split(",") if b != "default")
    args.out.mkdir(parents=True, exist_ok=True)
    engines = []
    jobs = [(n, b) for n in sorted(lengths, reverse=True) for b in backends]  # interleaved
    wall = time.perf_counter()
    for n, backend in tqdm(jobs, desc="engines", unit="engine"):
        engines.append(run_child(model, backend, n, settings.get(backend, {}), lengths,
                                 args.out / f".engine_{backend}_{n}.json"))
        (args.out / f".engine_{backend}_{n}.json").unlink()
    problems = check_consistency(engines)
    rows = summarize(engines, lengths, backends)
    meta = {
        "command": " ".join([f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}",
                             ".venv/bin/python", "benchmarks/capacity.py",
                             *map(shlex.quote, sys.argv[1:])]),
        "model": Path(model).name.rsplit("-", 1)[0],
        "model_path": model,
        "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
        "settings": {b: settings.get(b, {}) for b in backends if b != "default"},
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core {_cpu_name()} ({platform.machine()}, CPU only)",
        "wall_s": round(time.perf_counter() - wall, 1),
        "design_target_at_128k": DESIGN_TARGET,
        "consistency_problems": problems,
    }
    (args.out / "capacity.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "engines": engines}, indent=1))
    plot(rows, backends, meta, args.out / "capacity.png")

    print(f"\nKV cache {meta['kv_cache_gib']} GiB, {meta['model']}, settings {meta['settings']}")
    for r in rows:
        print(f"{r['length']:>8}: " + "  ".join(
            f"{b} {r[b]['concurrency']:.2f}"
            + (f" ({r[b]['concurrency_ratio']:.2f}x)" if b != "default" else "")
            + f", {r[b]['admissible']} whole" for b in backends))
    for p in problems:
        print("INCONSISTENT:", p)
    print(f"wrote {args.out / 'capacity.json'} and capacity.png ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
