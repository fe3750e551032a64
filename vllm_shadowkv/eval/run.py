"""Accuracy runner: RULER-style tasks through vLLM, for several backends side by side.

    python -m vllm_shadowkv.eval.run --model vllm_shadowkv/eval/fixtures/retrieval-llama \\
        --lengths 4096,8192 --depths 0,0.5,1 --samples 2 \\
        --backends default shadowkv 'shadowkv:{"sparse_budget":64}' shadowkv-naive \\
        --out benchmarks/results/accuracy

One engine at a time (each freed before the next starts), greedy decoding, the same prompts
for every backend. With ``--server-url`` the prompts go to a running OpenAI-compatible server
instead (one backend: the server's; ``--backends`` then only labels the results). Writes
results.json (every sample and the summary), results.md and the PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from functools import partial
from pathlib import Path

from vllm_shadowkv.eval import backends as backend_specs
from vllm_shadowkv.eval import report, tasks

# Tokens to generate per task (RULER's budgets, enough for every answer of a real model).
MAX_TOKENS = {"niah_single": 64, "niah_multikey": 64, "niah_multivalue": 96,
              "niah_multiquery": 96, "vt": 64, "cwe": 128}


def build_samples(tokenizer, task_names, lengths, depths, samples, seed) -> list[tasks.Sample]:
    out = []
    for task in task_names:
        task_depths = depths if task in tasks.NIAH_TASKS else [None]
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


def generate_offline(args, spec, prompts, max_tokens) -> list[str]:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, tokenizer=args.tokenizer or args.model, seed=args.seed,
              enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              **spec.llm_kwargs(), **json.loads(args.engine_args))
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=partial(tqdm, desc=spec.label))
        return [o.outputs[0].text for o in outs]
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
        return list(tqdm(pool.map(one, zip(prompts, max_tokens)), total=len(prompts), desc=spec.label))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (or name known to vLLM)")
    p.add_argument("--tokenizer", default=None, help="default: the model's")
    p.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated")
    p.add_argument("--lengths", default="4096", help="comma-separated prompt lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths (needle tasks)")
    p.add_argument("--samples", type=int, default=1, help="per task x length x depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backends", nargs="+", default=["default"], help="see vllm_shadowkv.eval.backends")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=None, help="override the per-task budgets")
    p.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt + budget")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--engine-args", default="{}", help="JSON of extra vllm.LLM keyword arguments")
    p.add_argument("--server-url", default=None, help="an OpenAI-compatible server instead")
    p.add_argument("--concurrency", type=int, default=8, help="parallel requests (server)")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--out", type=Path, default=Path("accuracy-results"))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    specs = [backend_specs.parse(s) for s in args.backends]
    if args.server_url and len(specs) != 1:
        p.error("--server-url serves one backend: give one --backends label")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if args.chat and not tokenizer.chat_template:
        p.error("--chat: the tokenizer has no chat template")
    samples = build_samples(tokenizer, args.tasks.split(","), [int(x) for x in args.lengths.split(",")],
                            [float(x) for x in args.depths.split(",")], args.samples, args.seed)
    prompts = [prompt_ids(tokenizer, s, args.chat) for s in samples]
    max_tokens = [args.max_tokens or MAX_TOKENS[s.task] for s in samples]
    if args.max_model_len is None:
        args.max_model_len = max(len(x) for x in prompts) + max(max_tokens) + 16

    records, started = [], time.time()
    for spec in specs:
        run = generate_server if args.server_url else generate_offline
        for s, ids, text in zip(samples, prompts, run(args, spec, prompts, max_tokens)):
            records.append({"backend": spec.label, "task": s.task, "length": s.length,
                            "depth": s.depth, "seed": s.seed, "prompt_tokens": len(ids),
                            "answers": s.answers, "prediction": text, "score": tasks.score(s, text)})

    labels = [s.label for s in specs]
    summary = report.summarize(records)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": shlex.join(["python", "-m", "vllm_shadowkv.eval.run",
                                   *(sys.argv[1:] if argv is None else argv)]),
            "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "seconds": round(time.time() - started, 1), "backends": labels}
    (args.out / "results.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "records": records}, indent=1) + "\n")
    table = report.markdown(summary, labels)
    (args.out / "results.md").write_text(table)
    report.plots(summary, labels, args.out)
    print(table)
    return summary


if __name__ == "__main__":
    main()
