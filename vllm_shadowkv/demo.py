"""Demo: serve a local model with ``--attention-backend shadowkv`` and ask it something.

Starts vLLM's OpenAI-compatible server on loopback (the command a user runs: ``vllm serve MODEL
--attention-backend shadowkv``), sends a completion request, prints the answer and the attention
backend each layer of the engine runs (asked from the engine's workers, not read from a log),
then stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from vllm_shadowkv.introspect import EXTENSION_CLASS
from vllm_shadowkv.models import build_model
from vllm_shadowkv.server import post_json, serve

DEFAULT_PROMPT = "The three primary colours are"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: build the tiny local model)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--shadowkv", default="{}", help='JSON settings, e.g. {"rank": 96}')
    args = parser.parse_args(argv)

    model = args.model or str(build_model("tiny"))
    serve_args = [
        "--attention-backend", "shadowkv",
        "--additional-config", json.dumps({"shadowkv": json.loads(args.shadowkv)}),
        "--worker-extension-cls", EXTENSION_CLASS, "--enforce-eager", "--max-model-len", "4096",
    ]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # exposes POST /collective_rpc
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = Path(tempfile.mkdtemp(prefix="shadowkv-demo-")) / "server.log"
    print(f"$ vllm serve {model} {' '.join(serve_args)}\n  (server log: {log})", flush=True)
    with serve(model, serve_args, log, env) as base:
        reply = post_json(base + "/v1/completions", {
            "model": model, "prompt": args.prompt, "max_tokens": args.max_tokens,
            "temperature": 0,
        })
        layers = post_json(base + "/collective_rpc",
                           {"method": "shadowkv_attention_backends"})["results"][0]
    print(f"\nprompt:  {args.prompt!r}")
    print(f"answer:  {reply['choices'][0]['text']!r}")
    print(f"backend: {', '.join(sorted(set(layers.values())))} in all {len(layers)} attention "
          "layers (reported by the engine's worker)")


if __name__ == "__main__":
    main()
