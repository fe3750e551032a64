"""The OpenAI-compatible server with --attention-backend on loopback, in a fresh process."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from engine_utils import engine_env

from vllm_shadowkv.introspect import EXTENSION_CLASS

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = engine_env() | {"VLLM_SERVER_DEV_MODE": "1"}  # enables POST /collective_rpc
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
        "--host", "127.0.0.1", "--port", str(port), "--attention-backend", "SHADOWKV",
        "--enforce-eager", "--max-model-len", "2048", "--worker-extension-cls", EXTENSION_CLASS,
        "--additional-config", json.dumps({"shadowkv": {"min_sparse_len": 1024}}),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()[-5000:]}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            proc.kill()
            raise AssertionError(f"server not up in 300 s:\n{log.read_text()[-5000:]}")
        yield base, tiny_model
        proc.terminate()
        proc.wait(timeout=60)


def test_server_uses_shadowkv(server):
    base, _ = server
    per_worker = _post(base + "/collective_rpc", {"method": "shadowkv_attention_backends"})
    backends = per_worker["results"][0]
    assert backends and set(backends.values()) == {"SHADOWKV"}


def test_completion(server):
    base, model = server
    reply = _post(base + "/v1/completions", {
        "model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
    })
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 8


def test_chat(server):
    base, model = server
    reply = _post(base + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 8, "temperature": 0,
    })
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] == 8
