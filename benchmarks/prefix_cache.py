"""Time to first token when requests share a long prefix: a method with vLLM's prefix caching vs
vLLM's default backend with it, and vs the same method without it (what every method did before).

  .venv/bin/python benchmarks/prefix_cache.py --model <llama8b-shape> --context 16384

One document of ``--context`` tokens asked ``--questions`` questions, one request at a time (a
chat about one document, or one system prompt): the first request prefills the whole document
(cold), the others find it in the prefix cache (warm) and prefill only their question. Each
engine runs in a fresh process on all the machine's cores with the same KV memory; the figures
are vLLM's own (``first_token_latency``, ``vllm:prefix_cache_hits``). ShadowKV runs at the paper's
ratio (rank 160, budget 1.56 %, 48 outlier chunks) unless ``--method``/``--settings`` say
otherwise. Writes prefix_cache.json and prefix_cache.png under ``--out``.
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
from plots import pyplot  # benchmarks/plots.py
from throughput import shadowkv_settings  # the paper's ratio, as throughput.py runs it

MiB = 1 << 20
PAPER_SHADOWKV = argparse.Namespace(rank=160, chunk_size=8, sparsity=1 / 64, outlier_chunks=48,
                                    local_window=32)


def child(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter

    from vllm_shadowkv.introspect import EXTENSION_CLASS

    kwargs = {}
    if job["backend"] != "default":
        kwargs = {"attention_backend": job["backend"], "worker_extension_cls": EXTENSION_CLASS,
                  "additional_config": {job["backend"]: job["settings"]}}
    llm = LLM(model=job["model"], max_model_len=job["context"] + 256, seed=0, enforce_eager=True,
              enable_prefix_caching=job["prefix_caching"], kv_cache_memory_bytes=job["kv_bytes"],
              dtype=job["dtype"], disable_log_stats=False, **kwargs)
    rng = random.Random(0)  # the same document and questions for every engine
    document = [rng.randrange(256) for _ in range(job["context"])]
    questions = [[rng.randrange(256) for _ in range(32)] for _ in range(job["questions"])]
    params = SamplingParams(temperature=0.0, max_tokens=job["gen"], ignore_eos=True)
    warm = [rng.randrange(256) for _ in range(job["warmup_len"])]  # compiles before the clock
    llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)
    ttft, answers = [], []
    for question in questions:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=document + question)], params,
                              use_tqdm=False)
        ttft.append(out.metrics.first_token_latency)
        answers.append(list(out.outputs[0].token_ids))
    counters = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
    return {**{k: job[k] for k in ("backend", "prefix_caching")}, "ttft_s": ttft,
            "answers": answers, "prefix_cache_hits": counters.get("vllm:prefix_cache_hits", 0)}


def run_child(job: dict, cores_env: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child-job", json.dumps(job)],
                          env=engine_env(cores_env), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{job['backend']} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(run: dict) -> dict:
    cold, *warm = run["ttft_s"]
    return {"cold_s": cold, "warm_s": sum(warm) / len(warm), "hits": run["prefix_cache_hits"]}


def plot(rows: dict, meta: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(rows)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [rows[n]["cold_s"] for n in names], 0.4, label="first request")
    ax.bar([x + 0.2 for x in xs], [rows[n]["warm_s"] for n in names], 0.4,
           label="later requests (mean)")
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{meta['context']}-token shared prefix, {meta['model']} ({meta['machine']})",
                 fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default: the tiny built-in model")
    parser.add_argument("--method", default="shadowkv")
    parser.add_argument("--settings", help="the method's settings (JSON); default: the paper's")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--gen", type=int, default=8)
    parser.add_argument("--kv-mib", type=int, default=2048)
    parser.add_argument("--dtype", default="auto",
                        help="the model's dtype, every engine (vLLM's --dtype; float32 on CPUs "
                             "without a 16-bit matmul)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "prefix_cache")
    parser.add_argument("--child-job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_job:
        print(json.dumps(child(json.loads(args.child_job))))
        os._exit(0)  # skip engine teardown

    from tqdm import tqdm

    from vllm_shadowkv.models import build_model

    model = args.model or str(build_model("tiny"))
    min_sparse_len = min(args.context, 4096)
    settings = json.loads(args.settings) if args.settings else (
        shadowkv_settings(argparse.Namespace(**vars(PAPER_SHADOWKV),
                                             min_sparse_len=min_sparse_len), args.context)
        if args.method == "shadowkv" else {})
    settings |= {"min_sparse_len": min_sparse_len}
    common = {"model": model, "context": args.context, "questions": args.questions,
              "gen": args.gen, "kv_bytes": args.kv_mib * MiB, "dtype": args.dtype,
              "warmup_len": min(args.context, 4096)}
    jobs = [{"backend": "default", "prefix_caching": True},
            {"backend": args.method, "prefix_caching": True, "settings": settings},
            {"backend": args.method, "prefix_caching": False, "settings": settings}]
    cores_env, runs, start = engine_cores_env(), [], time.perf_counter()
    for job in tqdm(jobs, desc="engines", unit="engine"):
        runs.append(run_child(common | job, cores_env, args.timeout))
    rows = {f"{r['backend']}{'' if r['prefix_caching'] else ', no prefix caching'}": summary(r)
            for r in runs}
    default, method, before = rows.values()
    meta = {"command": " ".join([".venv/bin/python", "benchmarks/prefix_cache.py", *sys.argv[1:]]),
            "model": Path(model).name.rsplit("-", 1)[0], "machine": machine(),
            "date": datetime.date.today().isoformat(), "context": args.context,
            "questions": args.questions, "gen": args.gen, "kv_mib": args.kv_mib,
            "dtype": args.dtype,
            "settings": settings, "wall_s": round(time.perf_counter() - start, 1)}
    ratios = {"warm_ttft_method_over_default": method["warm_s"] / default["warm_s"],
              "warm_over_cold_method": method["warm_s"] / method["cold_s"],
              "warm_ttft_method_over_method_without_caching": method["warm_s"] / before["warm_s"],
              "same_answers_with_and_without_caching": runs[1]["answers"] == runs[2]["answers"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "ratios": ratios, "runs": runs}, indent=1))
    plot(rows, meta, args.out / "prefix_cache.png")
    for name, row in rows.items():
        print(f"{name:>32}: first {row['cold_s']:.2f} s, later {row['warm_s']:.2f} s, "
              f"{row['hits']:.0f} prefix-cache hits (tokens)")
    print(json.dumps(ratios, indent=1))
    print(f"wrote {args.out / 'prefix_cache.json'} and prefix_cache.png ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
