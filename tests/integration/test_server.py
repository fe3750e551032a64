"""The OpenAI-compatible server with --attention-backend on loopback, in a fresh process."""

import json

import pytest
from engine_utils import default_settings, engine_env

from vllm_shadowkv.introspect import EXTENSION_CLASS
from vllm_shadowkv.methods import METHODS
from vllm_shadowkv.server import post_json, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(METHODS))
def server(request, tiny_model, tmp_path_factory):
    method = request.param
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = engine_env() | {"VLLM_SERVER_DEV_MODE": "1"}  # enables POST /collective_rpc
    args = [
        "--attention-backend", method.upper(), "--enforce-eager", "--max-model-len", "2048",
        "--worker-extension-cls", EXTENSION_CLASS,
        "--additional-config",
        json.dumps({method: default_settings(method, min_sparse_len=1024)}),
    ]
    with serve(tiny_model, args, log, env, timeout=300) as base:
        yield base, tiny_model, method


def test_server_uses_the_method(server):
    base, _, method = server
    per_worker = post_json(base + "/collective_rpc", {"method": "kv_compression_backends"})
    backends = per_worker["results"][0]
    assert backends and set(backends.values()) == {method.upper()}


def test_completion(server):
    base, model, _ = server
    reply = post_json(base + "/v1/completions", {
        "model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
    })
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 8


def test_chat(server):
    base, model, _ = server
    reply = post_json(base + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 8, "temperature": 0,
    })
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] == 8


def test_long_request_runs_sparse_and_shows_in_metrics(server):
    """A prompt above min_sparse_len (1024 here) decodes compressed; /metrics says so, under
    the method's label."""
    import re
    import time
    import urllib.request

    base, model, method = server
    label = f'method="{method}"'
    prompt = "The quick brown fox jumps over the lazy dog. " * 40  # ~1.8K tokens
    reply = post_json(base + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
    })
    assert reply["usage"]["prompt_tokens"] > 1024
    metrics, deadline = "", time.time() + 30
    while time.time() < deadline:  # the workers' snapshot lands within a step or two
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        found = re.search(rf'^kv_compression_requests_finished_total\{{{label},mode="sparse"\}} '
                          r'(\S+)', metrics, re.M)
        if found and float(found.group(1)) >= 1:
            break
        post_json(base + "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1})
        time.sleep(1)
    else:
        raise AssertionError("no finished sparse request in /metrics:\n"
                             + "\n".join(l for l in metrics.splitlines() if "kv_compression" in l))
    selected = re.search(rf"^kv_compression_selected_rows_total\{{{label}\}} (\S+)", metrics, re.M)
    assert selected and float(selected.group(1)) > 0
    assert re.search(rf"^kv_compression_host_store_capacity_bytes\{{{label}\}} (\S+)", metrics,
                     re.M)
