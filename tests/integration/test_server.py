"""The OpenAI-compatible server with --attention-backend on loopback, in a fresh process."""

import json

import pytest
from engine_utils import engine_env

from vllm_shadowkv.introspect import EXTENSION_CLASS
from vllm_shadowkv.server import post_json, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = engine_env() | {"VLLM_SERVER_DEV_MODE": "1"}  # enables POST /collective_rpc
    args = [
        "--attention-backend", "SHADOWKV", "--enforce-eager", "--max-model-len", "2048",
        "--worker-extension-cls", EXTENSION_CLASS,
        "--additional-config", json.dumps({"shadowkv": {"min_sparse_len": 1024}}),
    ]
    with serve(tiny_model, args, log, env, timeout=300) as base:
        yield base, tiny_model


def test_server_uses_shadowkv(server):
    base, _ = server
    per_worker = post_json(base + "/collective_rpc", {"method": "shadowkv_attention_backends"})
    backends = per_worker["results"][0]
    assert backends and set(backends.values()) == {"SHADOWKV"}


def test_completion(server):
    base, model = server
    reply = post_json(base + "/v1/completions", {
        "model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
    })
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 8


def test_chat(server):
    base, model = server
    reply = post_json(base + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 8, "temperature": 0,
    })
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] == 8
