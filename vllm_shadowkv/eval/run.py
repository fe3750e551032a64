"""Accuracy runner: RULER-style tasks through vLLM, for several backends side by side.

    python -m vllm_shadowkv.eval.run --model vllm_shadowkv/eval/fixtures/retrieval-llama \\
        --lengths 4096,8192 --depths 0,0.5,1 --samples 2 \\
        --backends default 'shadowkv:{"sparse_budget":64}' shadowkv@1.56% \\
        --shadowkv-settings '{"rank":160,"min_sparse_len":1024}' \\
        --engine-args '{"enable_prefix_caching":false}' --out benchmarks/results/accuracy

One engine at a time (each freed before the next starts), greedy decoding, the same prompts
for every backend. A budget-ratio spec (``shadowkv@1.56%``) starts one engine per context
length with that length's sparse_budget and outlier_chunks (see ``backends``). Shadowkv
engines get the worker extension; each request's mode (sparse/dense) and hit rate go into the
records, and the run fails (after writing its results) if a request that should have decoded
sparsely did not. With ``--server-url`` the prompts go to a running OpenAI-compatible server
instead (one fixed backend: the server's; ``--backends`` then only labels the results).
Writes results.json (every sample and the summary), results.md and the PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import date
from functools import partial
from pathlib import Path

from vllm_shadowkv.cpu_cores import engine_cores_env
from vllm_shadowkv.eval import backends as backend_specs
from vllm_shadowkv.eval import report, tasks

# Tokens to generate per task (RULER's budgets, enough for every answer of a real model).
MAX_TOKENS = {"niah_single": 64, "niah_multikey": 64, "niah_multivalue": 96,
              "niah_multiquery": 96, "vt": 64, "cwe": 128, "niah_collide": 96}


def build_samples(tokenizer, task_names, lengths, depths, samples, seed) -> list[tasks.Sample]:
    out = []
    for task in task_names:
        task_depths = depths if task in tasks.NEEDLE_TASKS else [None]
        for length in lengths:
            for depth in task_depths:
                out += [tasks.generate(task, tokenizer, length, depth, seed + i) for i in range(samples)]
    return out


def prompt_ids(tokenizer, sample: tasks.Sample, chat: bool) -> list[int]:
    """The exact tokens sent: raw text with BOS, or the model's chat template, then the
    answer prefix as the start of the model's turn (as RULER does)."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": sample.prompt}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer(text + sample.answer_prefix, add_special_tokens=False)["input_ids"]
    return tokenizer(sample.prompt + sample.answer_prefix)["input_ids"]


def generate_offline(args, spec, prompts, max_tokens) -> list[dict]:
    """Greedy outputs of one fresh engine: text, token ids and, for a method of this plugin,
    the request's kv_compression_stats row (mode, hit rate, ...) from the worker extension."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {"tokenizer": args.tokenizer or args.model, "seed": args.seed,
              "enforce_eager": args.enforce_eager,
              "max_model_len": args.max_model_len or max(map(len, prompts)) + max(max_tokens) + 16,
              **spec.llm_kwargs(), **json.loads(args.engine_args)}
    if spec.method:
        from vllm_shadowkv.introspect import EXTENSION_CLASS

        kwargs.setdefault("worker_extension_cls", EXTENSION_CLASS)
    llm = LLM(model=args.model, **kwargs)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=partial(tqdm, desc=spec.label))
        stats = {}
        if spec.method:
            raw = llm.collective_rpc("kv_compression_stats")[0]
            # The engine core's request id is the front end's plus "-<8 hex>".
            for req_id, row in [*raw["finished"].items(), *raw["requests"].items()]:
                stats[req_id.rsplit("-", 1)[0] if "-" in req_id else req_id] = row
        return [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                 "stats": stats.get(o.request_id) if spec.method else None} for o in outs]
    finally:  # free the engine (its process and KV cache) before the next backend starts
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate_server(args, spec, prompts, max_tokens) -> list[str]:
    import urllib.request

    from tqdm import tqdm

    base = args.server_url.rstrip("/")

    def call(path, body=None):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=args.request_timeout) as resp:
            return json.loads(resp.read())

    model = call("/v1/models")["data"][0]["id"]

    def one(item):
        ids, m = item
        body = {"model": model, "prompt": ids, "max_tokens": m, "temperature": 0.0}
        return call("/v1/completions", body)["choices"][0]["text"]

    with ThreadPoolExecutor(args.concurrency) as pool:
        texts = list(tqdm(pool.map(one, zip(prompts, max_tokens)), total=len(prompts), desc=spec.label))
    return [{"text": t, "token_ids": None, "stats": None} for t in texts]


def engines(specs, samples) -> list[tuple[backend_specs.BackendSpec, backend_specs.BackendSpec, list[int]]]:
    """(spec as written, spec the engine runs, indices of its samples): one engine per fixed
    spec, one per context length for a ratio spec (``shadowkv@1.56%``)."""
    out = []
    for spec in specs:
        if spec.per_length:
            for n in sorted({s.length for s in samples}):
                out.append((spec, spec.resolve(n), [i for i, s in enumerate(samples) if s.length == n]))
        else:
            out.append((spec, spec, list(range(len(samples)))))
    return out


def fidelity(stats: dict | None) -> dict:
    """The request's in-engine fidelity (a method's ``measure_fidelity``): relative error of the
    compressed attention against dense and the recall of the chunks that hold dense attention's
    mass, averaged over layers and decode steps; empty without the measurement."""
    layers = (stats or {}).get("fidelity") or {}
    steps = sum(m["steps"] for m in layers.values())
    if not steps:
        return {}
    return {name: sum(m[name] * m["steps"] for m in layers.values()) / steps
            for name in ("relative_error", "chunk_recall")}


def expected_sparse(spec, prompt_len: int) -> bool:
    """Whether the method compresses this prompt (shadowkv: and has chunks left to select from
    beyond its outliers, vllm_shadowkv.core.params)."""
    from vllm_shadowkv.config import parse_settings
    from vllm_shadowkv.methods import METHODS

    c = parse_settings(METHODS[spec.method].settings_cls, spec.settings)
    if prompt_len < c.min_sparse_len:
        return False
    if not spec.is_shadowkv:
        return True
    return replace(c, rank=c.rank or 1).params.compressed_chunks(prompt_len) > 0  # any rank


def decode_score(tokenizer, sample: tasks.Sample, token_ids, text: str) -> float | None:
    """Score over the answers that need decode steps: the first generated token comes out of
    the (exact) prefill, so an answer it already holds says nothing about sparse decoding.
    None when the first token holds every answer (or the token ids are unknown)."""
    if not token_ids:
        return None
    first = tokenizer.decode(token_ids[:1]).lower()
    rest = [a for a in sample.answers if a.lower() not in first]
    return tasks.string_match_all(text, rest) if rest else None


def not_sparse(records: list[dict]) -> list[dict]:
    """Shadowkv records that should have decoded sparsely and did not (mode, or no sparse
    decode step although the request generated more than its first token, which comes from
    the prefill)."""
    return [r for r in records if "mode" in r and r["expected_sparse"] and (
        r["mode"] != "sparse" or (len(r["output_token_ids"] or ()) > 1 and not r["decode_steps"]))]


def write_json(args, argv, specs, records, engine_rows, started, complete: bool) -> dict:
    summary = report.summarize(records)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": shlex.join(["python", "-m", "vllm_shadowkv.eval.run",
                                   *(sys.argv[1:] if argv is None else argv)]),
            "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "engine_cores": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "seconds": round(time.time() - started, 1), "backends": [s.label for s in specs],
            "engines": engine_rows, "complete": complete}
    (args.out / "results.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "records": records}, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (or name known to vLLM)")
    p.add_argument("--tokenizer", default=None, help="default: the model's")
    p.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated; also "
                   + ", ".join(tasks.HARD_TASKS) + " (harder, not RULER's)")
    p.add_argument("--lengths", default="4096", help="comma-separated prompt lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths (needle tasks)")
    p.add_argument("--samples", type=int, default=1, help="per task x length x depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backends", nargs="+", default=["default"], help="see vllm_shadowkv.eval.backends")
    p.add_argument("--shadowkv-settings", default="{}",
                   help="JSON settings for every shadowkv spec, under the spec's own")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=None, help="override the per-task budgets")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the engine's longest prompt + budget")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--engine-args", default="{}", help="JSON of extra vllm.LLM keyword arguments")
    p.add_argument("--server-url", default=None, help="an OpenAI-compatible server instead")
    p.add_argument("--concurrency", type=int, default=8, help="parallel requests (server)")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--out", type=Path, default=Path("accuracy-results"))
    p.add_argument("--threads", type=int, default=0,
                   help="CPU cores for the engines (0: all of this process's; vLLM's own binding "
                        "keeps one for its scheduler); a VLLM_CPU_OMP_THREADS_BIND set wins")
    args = p.parse_args(argv)
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and not args.server_url:
        os.environ.update(engine_cores_env(args.threads))

    from transformers import AutoTokenizer

    common = json.loads(args.shadowkv_settings)
    specs = [backend_specs.parse(s).with_shadowkv_settings(common) for s in args.backends]
    if args.server_url and (len(specs) != 1 or specs[0].per_length):
        p.error("--server-url serves one fixed backend: give one --backends label without @R%")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if args.chat and not tokenizer.chat_template:
        p.error("--chat: the tokenizer has no chat template")
    samples = build_samples(tokenizer, args.tasks.split(","), [int(x) for x in args.lengths.split(",")],
                            [float(x) for x in args.depths.split(",")], args.samples, args.seed)
    prompts = [prompt_ids(tokenizer, s, args.chat) for s in samples]
    max_tokens = [args.max_tokens or MAX_TOKENS[s.task] for s in samples]

    records, engine_rows, started = [], [], time.time()
    run = generate_server if args.server_url else generate_offline
    for spec, engine_spec, idx in engines(specs, samples):
        t0 = time.time()
        outs = run(args, engine_spec, [prompts[i] for i in idx], [max_tokens[i] for i in idx])
        rows = []
        for i, out in zip(idx, outs):
            s, stats = samples[i], out["stats"]
            rows.append({"backend": spec.label, "task": s.task, "length": s.length, "depth": s.depth,
                         "seed": s.seed, "prompt_tokens": len(prompts[i]), "answers": s.answers,
                         "prediction": out["text"], "output_token_ids": out["token_ids"],
                         "score": tasks.score(s, out["text"]),
                         "decode_score": decode_score(tokenizer, s, out["token_ids"], out["text"])})
            if stats is not None or (engine_spec.method and not args.server_url):
                rows[-1].update({"mode": stats["mode"] if stats else None,
                                 "expected_sparse": expected_sparse(engine_spec, len(prompts[i])),
                                 "hit_rate": stats["hit_rate"] if stats else None,
                                 "speculation_hit_rate": (stats["speculation_hit_rate"]
                                                          if stats and stats.get("speculated")
                                                          else None),
                                 "decode_steps": stats["decode_steps"] if stats else None,
                                 "verified_steps": (stats.get("verified_steps") if stats
                                                    else None),
                                 **fidelity(stats)})
        records += rows
        engine_rows.append({"backend": spec.label,
                            "length": samples[idx[0]].length if spec.per_length else None,
                            "settings": engine_spec.settings, "requests": len(idx),
                            "seconds": round(time.time() - t0, 1)})
        # After every engine: a long run that dies later keeps what it measured.
        write_json(args, argv, specs, records, engine_rows, started, complete=False)

    labels = [s.label for s in specs]
    summary = write_json(args, argv, specs, records, engine_rows, started, complete=True)
    table = report.markdown(summary, labels, engine_rows)
    (args.out / "results.md").write_text(table)
    report.plots(summary, labels, args.out)
    print(table)
    # A method run that silently decoded densely would measure the wrong thing: refuse it
    # (after writing the results, which show the offending requests' modes).
    wrong = not_sparse(records)
    if wrong:
        raise SystemExit(f"{len(wrong)} request(s) expected to decode compressed (sparse) did not: "
                         + ", ".join(f"{r['backend']} {r['task']} {r['length']} mode={r['mode']} "
                                     f"decode_steps={r['decode_steps']}"
                                     for r in wrong[:10]))
    return summary


if __name__ == "__main__":
    main()
