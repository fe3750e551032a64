"""End-to-end offline throughput and time per output token: a method vs vLLM's default backend.

  .venv/bin/python benchmarks/throughput.py        # CPU: tiny model, 1K/2K/4K/8K, 64 MiB KV
  .venv/bin/python benchmarks/throughput.py --method minikv --settings '{}'   # MiniKV's defaults

For each context length L, one engine per backend (fresh process, engine core in-process,
interleaved: the order of the two backends alternates from one length to the next), the same KV
memory for both (``kv_cache_memory_bytes``), and the largest batch of L-token prompts that fits
in it all at once for L + G tokens each:

* default: ``(num_blocks - 1) // cdiv(L + G, block_size)`` (the null block is not usable);
* a method (shadowkv, minikv): one prompt is staged exactly while it is prefilled
  (``max_staging_requests`` 1), the others hold their compressed pages + per-request state +
  exact generated tokens:
  ``1 + (num_blocks - 1 - peak) // steady`` (``peak`` = ``layout.peak_blocks``: staging +
  compressed + state in the step that compresses; ``steady`` = blocks once the staging is freed
  and G tokens are generated); also capped by the CPU value store.

``LLM.generate`` runs the batch greedily (``ignore_eos``, G tokens each) after a short warm-up.
Reported: output tokens/s (batch x G / wall time of the generate call), total tokens/s (prompt +
output), time per output token (TPOT, per request ``(last_token_ts - first_token_ts)/(G - 1)``
from vLLM's request metrics, averaged; also the TPOT of the request whose prompt finished last,
which decodes with no prompt being prefilled alongside), time to first token, preemptions, and
for the method the per-request mode, slot hit rate and bytes fetched from the host store
(``llm.collective_rpc("kv_compression_stats")``). Ratios are method / default. Every engine's
OpenMP threads are bound to all of the machine's cores (``--threads`` for fewer,
vllm_shadowkv/cpu_cores.py). Run it on an otherwise idle machine: beside other jobs, a second
OpenMP thread made single MKL calls (``torch.linalg.eigh`` in the compression) stall for seconds
(1 thread then avoids it).

ShadowKV settings (``--method shadowkv``, the default; all flags): rank 40 (the paper's rank
160 is 15.6 % of Llama-3.1-8B's key width 1024; 40 is 15.6 % of the tiny model's 256, so a
compressed token costs the same fraction of an exact one), chunk 8, sparse budget L/64 (the paper's 1.56 % sparsity),
48 outlier chunks, local window 32, min_sparse_len 1024 (below every context: every prompt is
compressed and decoded sparsely). Other methods take ``--settings`` (JSON, their own keys;
``min_sparse_len`` comes from its flag).

On the CPU the methods' exact attention runs vLLM's C++ CPU_ATTN kernel, as the default backend
does, and their decode the compiled CPU kernels (core/cpu_kernels.py). CPU timings say nothing
about GPU speed.
Writes benchmarks/throughput/throughput.json and throughput.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from vllm_shadowkv.cpu_cores import engine_cores_env

from engine_cores import engine_env, machine  # benchmarks/engine_cores.py

OUT_DIR = Path(__file__).resolve().parent / "throughput"
MiB = 1 << 20


def shadowkv_settings(args, context: int) -> dict:
    budget = max(args.chunk_size, context * args.sparsity // args.chunk_size * args.chunk_size)
    return {"rank": args.rank, "chunk_size": args.chunk_size, "sparse_budget": int(budget),
            "outlier_chunks": args.outlier_chunks, "local_window": args.local_window,
            "min_sparse_len": args.min_sparse_len}


# -- child: one engine, one batch ---------------------------------------------------------------
def largest_batch(backend: str, spec, num_blocks: int, context: int, gen: int) -> dict:
    usable = num_blocks - 1  # block 0 is vLLM's null block
    if backend == "default":
        per_request = -(-(context + gen) // spec.block_size)
        return {"batch": usable // per_request, "blocks_per_request": per_request,
                "usable_blocks": usable}
    layout = spec.layout
    # Staging is freed (remove_skipped_blocks) before the first generated token's block is
    # allocated, so a request holds at most max(peak, steady) blocks.
    steady = layout.blocks_needed(context, context + gen) - layout.exact_blocks(context)
    peak = max(layout.peak_blocks(context), steady)
    batch = 0 if usable < peak else 1 + (usable - peak) // steady
    store_bytes = layout.store_bytes(context)
    store_capacity = spec.stamp.store_bytes
    store_cap = store_capacity // store_bytes if store_bytes else batch
    return {"batch": min(batch, store_cap), "blocks_per_request": steady, "peak_blocks": peak,
            "usable_blocks": usable, "store_bound": store_cap,
            "value_store_bytes_per_request": store_bytes}


def method_summary(stats: dict, req_ids: set[str]) -> dict:
    rows = {**stats["finished"], **stats["requests"]}  # the last ones are released next step
    # The engine's ids are the LLM's ids with a random suffix ("3" -> "3-1f2e...").
    mine = [row for rid, row in rows.items() if rid in req_ids or rid.rsplit("-", 1)[0] in req_ids]
    selected = sum(r["selected"] for r in mine)
    hits = sum(r["hits"] for r in mine)
    steps = sum(r["decode_steps"] for r in mine)
    fetched = sum(r["bytes_fetched"] for r in mine)
    return {
        "requests_seen": len(mine),
        "modes": {m: sum(r["mode"] == m for r in mine) for m in ("dense", "sparse")},
        "hit_rate": hits / selected if selected else 0.0,
        "selected_chunks": selected,
        "bytes_fetched": fetched,
        "bytes_fetched_per_request": fetched / len(mine) if mine else 0,
        "bytes_fetched_per_decode_step_layer": fetched / steps if steps else 0,
        "sparse_decode_calls": steps,
        "store_used_bytes": stats["store"]["used_bytes"],
    }


def child_main(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_shadowkv.introspect import EXTENSION_CLASS

    job = json.loads(args.child_job)
    backend, context, gen = job["backend"], job["context"], job["gen"]
    kwargs = {}
    if backend != "default":
        kwargs = {"attention_backend": backend, "worker_extension_cls": EXTENSION_CLASS,
                  "additional_config": {backend: job["settings"]}}
    start = time.perf_counter()
    llm = LLM(model=job["model"], max_model_len=context + gen, enable_prefix_caching=False,
              enforce_eager=not job["compile"], seed=0, kv_cache_memory_bytes=job["kv_bytes"],
              dtype=job["dtype"], disable_log_stats=False, **kwargs)
    startup_s = time.perf_counter() - start
    vllm_config = llm.llm_engine.vllm_config
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    (group,) = scheduler.kv_cache_config.kv_cache_groups
    spec = group.kv_cache_spec  # CompressedKVSpec carries its layout and the layer count
    num_blocks = vllm_config.cache_config.num_gpu_blocks
    fit = largest_batch(backend, spec, num_blocks, context, gen)
    batch = min(fit["batch"], job["max_batch"]) if job["max_batch"] else fit["batch"]
    result = {"backend": backend, "context": context, "gen": gen, "kv_bytes": job["kv_bytes"],
              "num_blocks": num_blocks, "page_size_bytes_per_layer": spec.page_size_bytes,
              "vllm_max_concurrency": vllm_config.cache_config.kv_cache_max_concurrency,
              "fit": fit, "batch": batch, "startup_s": round(startup_s, 1),
              "settings": job.get("settings")}
    if batch < 1:
        result["error"] = "no request fits in this KV memory"
        Path(args.child_out).write_text(json.dumps(result, indent=1))
        os._exit(0)

    # Warm-up: one short request through every phase (for a method a compressed one: it also
    # compiles the CPU kernels before the clock starts).
    warm_len = job["warmup_len"]
    rng = random.Random(1)
    warm = TokensPrompt(prompt_token_ids=[rng.randrange(256) for _ in range(warm_len)])
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)

    rng = random.Random(context)  # the same prompts for both backends
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(256) for _ in range(context)])
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0

    per_request = []
    for o in outputs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        assert n == gen, f"{o.request_id} generated {n} tokens, expected {gen}"
        assert m is not None, "vLLM returned no request metrics (disable_log_stats?)"
        per_request.append({"id": o.request_id, "ttft_s": m.first_token_latency,
                            "first_token_ts": m.first_token_ts,
                            "tpot_s": (m.last_token_ts - m.first_token_ts) / (n - 1),
                            "preemptions": m.num_preemptions})
    t_first = min(r["first_token_ts"] for r in per_request)
    for r in per_request:
        r["first_token_ts"] -= t_first  # relative to the batch's first token
    tpot = [r["tpot_s"] for r in per_request]
    ttft = [r["ttft_s"] for r in per_request]
    preemptions = sum(r["preemptions"] for r in per_request)
    # The request whose prompt finished last decodes with no other prompt being prefilled.
    last = max(per_request, key=lambda r: r["first_token_ts"])
    # Requests still running when the last one got its first token: == batch when the whole
    # batch was resident at once (it really fit).
    resident = sum(r["first_token_ts"] + r["tpot_s"] * (gen - 1) >= last["first_token_ts"]
                   for r in per_request)
    result.update({
        "tpot_last_started_s": last["tpot_s"],
        "resident_at_last_first_token": resident,
        "per_request": per_request,
        "wall_s": wall,
        "output_tok_s": batch * gen / wall,
        "total_tok_s": batch * (context + gen) / wall,
        "tpot_s_mean": sum(tpot) / len(tpot) if tpot else None,
        "tpot_s_max": max(tpot) if tpot else None,
        "ttft_s_mean": sum(ttft) / len(ttft) if ttft else None,
        "ttft_s_max": max(ttft) if ttft else None,
        "preemptions": preemptions,
        "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outputs[:2]],
    })
    if backend != "default":
        stats = llm.collective_rpc("kv_compression_stats")[0]
        result["kv_compression_stats"] = method_summary(stats, {o.request_id for o in outputs})
    Path(args.child_out).write_text(json.dumps(result, indent=1))
    os._exit(0)  # skip engine teardown


# -- parent ------------------------------------------------------------------------------------
def run_child(job: dict, out: Path, timeout: float, cores_env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child-out", str(out), "--child-job", json.dumps(job)]
    proc = subprocess.run(cmd, env=engine_env(cores_env), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{job['backend']} @ {job['context']} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-8000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def ratios(runs: list[dict], contexts, method: str) -> list[dict]:
    """Per context: both backends' figures (the method's under ``method_*``) and their ratios."""
    by = {(r["backend"], r["context"]): r for r in runs}
    rows = []
    for n in contexts:
        d, s = by.get(("default", n)), by.get((method, n))
        if not d or not s or "wall_s" not in d or "wall_s" not in s:
            continue
        rows.append({
            "context": n,
            "default_batch": d["batch"], "method_batch": s["batch"],
            "batch_ratio": s["batch"] / d["batch"],
            "default_output_tok_s": d["output_tok_s"], "method_output_tok_s": s["output_tok_s"],
            "throughput_ratio": s["output_tok_s"] / d["output_tok_s"],
            "default_tpot_ms": 1e3 * d["tpot_s_mean"], "method_tpot_ms": 1e3 * s["tpot_s_mean"],
            "tpot_ratio": s["tpot_s_mean"] / d["tpot_s_mean"],
            "default_decode_tpot_ms": 1e3 * d["tpot_last_started_s"],
            "method_decode_tpot_ms": 1e3 * s["tpot_last_started_s"],
            "decode_tpot_ratio": s["tpot_last_started_s"] / d["tpot_last_started_s"],
            "default_ttft_s": d["ttft_s_mean"], "method_ttft_s": s["ttft_s_mean"],
            "method_hit_rate": s["kv_compression_stats"]["hit_rate"],
            "method_bytes_fetched": s["kv_compression_stats"]["bytes_fetched"],
            "method_sparse_requests": s["kv_compression_stats"]["modes"]["sparse"],
            "preemptions": d["preemptions"] + s["preemptions"],
            "default_resident": d["resident_at_last_first_token"],
            "method_resident": s["resident_at_last_first_token"],
        })
    return rows


def plot(runs: list[dict], backends, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"default": "#888888", "shadowkv": "#1f77b4", "minikv": "#ff7f0e",
              "specache": "#2ca02c", "tailorkv": "#d62728"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend in backends:
        pts = sorted((r["context"], r) for r in runs if r["backend"] == backend and "wall_s" in r)
        if not pts:
            continue
        xs = [c for c, _ in pts]
        ax1.plot(xs, [r["output_tok_s"] for _, r in pts], "o-", color=colors[backend],
                 label=backend)
        for c, r in pts:
            ax1.annotate(f"b={r['batch']}", (c, r["output_tok_s"]), textcoords="offset points",
                         xytext=(4, 4), fontsize=8, color=colors[backend])
        ax2.plot(xs, [1e3 * r["tpot_s_mean"] for _, r in pts], "o-", color=colors[backend],
                 label=f"{backend}: mean over requests")
        ax2.plot(xs, [1e3 * r["tpot_last_started_s"] for _, r in pts], "s--",
                 color=colors[backend], alpha=0.7,
                 label=f"{backend}: last-started request (no prefill alongside)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(meta["contexts"], [f"{c // 1024}K" for c in meta["contexts"]])
        ax.set_xlabel("context length (prompt tokens)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("output tokens / s (largest batch that fits)")
    ax1.set_title("End-to-end throughput")
    ax2.set_ylabel("ms per output token")
    ax2.set_yscale("log")
    ax2.set_title("Time per output token")
    fig.suptitle(f"{meta['model']}, CPU ({meta['machine']}), KV {meta['kv_mib']} MiB per engine, "
                 f"{meta['gen']} output tokens, OMP_NUM_THREADS={meta['omp_num_threads']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,2048,4096,8192")
    parser.add_argument("--gen", type=int, default=64, help="output tokens per request")
    parser.add_argument("--kv-mib", type=int, default=64,
                        help="KV cache memory of every engine (MiB), the same for both backends")
    parser.add_argument("--max-batch", type=int, default=0, help="cap on the batch (0: none)")
    parser.add_argument("--model", default=None, help="default: the local tiny model")
    parser.add_argument("--method", default="shadowkv", help="the method against the default")
    parser.add_argument("--settings", default=None,
                        help="the method's settings (JSON); shadowkv: built from the flags below")
    parser.add_argument("--rank", type=int, default=40)
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--sparsity", type=float, default=1 / 64,
                        help="sparse_budget = sparsity x context (rounded to whole chunks)")
    parser.add_argument("--outlier-chunks", type=int, default=48)
    parser.add_argument("--local-window", type=int, default=32)
    parser.add_argument("--min-sparse-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0,
                        help="cores of every engine (0: all of this process's; 1 on a machine "
                             "shared with other jobs, where a second OpenMP thread stalls)")
    parser.add_argument("--compile", action="store_true",
                        help="both engines compile the model as `vllm serve` does without "
                             "--enforce-eager (default: eager)")
    parser.add_argument("--dtype", default="auto",
                        help="the model's dtype, both backends (vLLM's --dtype; float32 on CPUs "
                             "without AVX512-BF16, where bf16 linear layers run slowly)")
    parser.add_argument("--timeout", type=float, default=1500, help="per engine (s)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--child-job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out:
        child_main(args)
        return

    from tqdm import tqdm

    from vllm_shadowkv.models import build_model

    model = args.model or str(build_model("tiny"))
    contexts = [int(c) for c in args.contexts.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    cores_env = engine_cores_env(args.threads)
    jobs = []
    backends = ("default", args.method)

    def settings(context: int) -> dict:
        if args.settings is None and args.method == "shadowkv":
            return shadowkv_settings(args, context)
        return {**json.loads(args.settings or "{}"), "min_sparse_len": args.min_sparse_len}

    for i, context in enumerate(contexts):  # interleaved, alternating order
        for backend in backends if i % 2 == 0 else backends[::-1]:
            jobs.append({"backend": backend, "context": context, "gen": args.gen, "model": model,
                         "kv_bytes": args.kv_mib * MiB, "max_batch": args.max_batch,
                         "compile": args.compile, "dtype": args.dtype,
                         "warmup_len": min(context, args.min_sparse_len),
                         "settings": settings(context) if backend != "default" else None})
    runs = []
    wall = time.perf_counter()
    bar = tqdm(jobs, desc="engines", unit="engine")
    for job in bar:
        bar.set_postfix_str(f"{job['backend']} @ {job['context']}")
        run = run_child(job, args.out / f".run_{job['backend']}_{job['context']}.json",
                        args.timeout, cores_env)
        runs.append(run)
        if "wall_s" in run:
            tqdm.write(f"{run['backend']:>8} @ {run['context']:>6}: batch {run['batch']:>3}, "
                       f"{run['output_tok_s']:.2f} out tok/s, "
                       f"TPOT {1e3 * run['tpot_s_mean']:.1f} ms (last-started "
                       f"{1e3 * run['tpot_last_started_s']:.1f} ms), "
                       f"TTFT {run['ttft_s_mean']:.1f} s, wall {run['wall_s']:.1f} s")
        else:
            tqdm.write(f"{run['backend']} @ {run['context']}: {run.get('error')}")
    rows = ratios(runs, contexts, args.method)
    meta = {
        "command": " ".join([".venv/bin/python", "benchmarks/throughput.py", *sys.argv[1:]]),
        "model": Path(model).name.rsplit("-", 1)[0],
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "contexts": contexts, "gen": args.gen, "kv_mib": args.kv_mib,
        "omp_num_threads": int(cores_env["OMP_NUM_THREADS"]), "compile": args.compile,
        "dtype": args.dtype,
        "method": args.method,
        "wall_s": round(time.perf_counter() - wall, 1),
        "note": "CPU timings do not predict GPU speed",
    }
    (args.out / "throughput.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    plot(runs, backends, meta, args.out / "throughput.png")
    print(f"\n{'ctx':>6} {'batch d/s':>10} {'out tok/s d':>12} {'s':>8} {'ratio':>6} "
          f"{'TPOT ms d':>10} {'s':>9} {'ratio':>6} {'hit':>5} {'fetched MiB':>11}")
    for r in rows:
        print(f"{r['context']:>6} {r['default_batch']:>4}/{r['method_batch']:<5} "
              f"{r['default_output_tok_s']:>12.2f} {r['method_output_tok_s']:>8.2f} "
              f"{r['throughput_ratio']:>5.2f}x {r['default_tpot_ms']:>10.1f} "
              f"{r['method_tpot_ms']:>9.1f} {r['tpot_ratio']:>5.2f}x "
              f"{r['method_hit_rate']:>5.2f} {r['method_bytes_fetched'] / MiB:>11.1f}")
    print(f"wrote {args.out / 'throughput.json'} and throughput.png ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
