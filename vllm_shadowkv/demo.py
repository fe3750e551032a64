"""Demo: serve a local model with ``--attention-backend shadowkv`` and ask it something.

Starts vLLM's OpenAI-compatible server on loopback (the command a user runs: ``vllm serve MODEL
--attention-backend shadowkv``). By default it serves the committed retrieval model and asks a
needle-in-a-haystack question of about 4K tokens that the server decodes sparsely at the paper's
ratio (budget / context = 64 / 4096 = 1.56 %). It prints the answer next to the expected one,
then, asked from the engine's workers (not read from a log), the attention backend of every
layer and how the request ran (sparse or dense, chunks selected, hit rate), and the server's
``kv_compression_*`` Prometheus metrics; then it stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import urllib.request
from pathlib import Path

from vllm_shadowkv.eval import tasks
from vllm_shadowkv.eval.retrieval_model import FIXTURE
from vllm_shadowkv.introspect import EXTENSION_CLASS
from vllm_shadowkv.server import post_json, serve

# 1.56 % of a 4096-token context (the paper's 2048 of 128K), outliers scaled alike; prompts from
# 1024 tokens are compressed, so this one decodes sparsely.
DEMO_SETTINGS = {"rank": 160, "sparse_budget": 64, "outlier_chunks": 2, "min_sparse_len": 1024}
DEMO_LENGTH = 4096


def needle_question() -> tasks.Sample:
    """A niah_multivalue sample for the retrieval model: four values for one key, three of which
    the model can only give from sparse decode steps (the first comes from the exact prefill)."""
    from transformers import AutoTokenizer

    return tasks.generate("niah_multivalue", AutoTokenizer.from_pretrained(str(FIXTURE)),
                          DEMO_LENGTH, depth=0.5, seed=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the committed retrieval model)")
    parser.add_argument("--prompt", help="your own prompt (default: a ~4K-token needle question)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--shadowkv", default=json.dumps(DEMO_SETTINGS),
                        help=f"JSON settings (default: {json.dumps(DEMO_SETTINGS)})")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="serve the model eagerly (default: compiled, as `vllm serve` runs "
                             "it; about 20 s more start-up)")
    args = parser.parse_args(argv)

    model = args.model or str(FIXTURE)
    sample = None if args.prompt else needle_question()
    prompt = args.prompt or sample.prompt + sample.answer_prefix
    serve_args = [
        "--attention-backend", "shadowkv",
        "--additional-config", json.dumps({"shadowkv": json.loads(args.shadowkv)}),
        "--worker-extension-cls", EXTENSION_CLASS, "--max-model-len", str(DEMO_LENGTH + 256),
    ] + (["--enforce-eager"] if args.enforce_eager else [])
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # exposes POST /collective_rpc
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = Path(tempfile.mkdtemp(prefix="shadowkv-demo-")) / "server.log"
    print(f"$ vllm serve {model} {' '.join(serve_args)}\n  (server log: {log})", flush=True)
    with serve(model, serve_args, log, env) as base:
        reply = post_json(base + "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
        })
        layers = post_json(base + "/collective_rpc",
                           {"method": "kv_compression_backends"})["results"][0]
        stats = post_json(base + "/collective_rpc", {"method": "kv_compression_stats"})["results"][0]
        with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
            metrics = [line for line in response.read().decode().splitlines()
                       if line.startswith("kv_compression_")]
    answer = reply["choices"][0]["text"]
    usage = reply["usage"]
    print(f"\nprompt:   {usage['prompt_tokens']} tokens, ...{prompt[-90:]!r}")
    print(f"answer:   {answer!r}")
    if sample is not None:
        print(f"expected: {', '.join(sample.answers)} -> score "
              f"{tasks.score(sample, answer):.2f} (all four values found = 1.00)")
    print(f"backend:  {', '.join(sorted(set(layers.values())))} in all {len(layers)} attention "
          "layers (reported by the engine's worker)")
    for req_id, row in (stats["finished"] | stats["requests"]).items():
        print(f"request:  {req_id}: {row['mode']}, prompt {row['prompt_len']} tokens, "
              f"{row['decode_steps']} sparse layer-steps, {row['selected']} chunks selected, "
              f"hit rate {row['hit_rate']:.2f}, {row['bytes_fetched'] / 1024:.0f} KiB of values "
              "fetched from the CPU value store")
    print("metrics:\n  " + "\n  ".join(metrics))


if __name__ == "__main__":
    main()
