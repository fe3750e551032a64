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


def _request(url: str, body: dict, read_lines: int | None = None) -> tuple[int, dict | None]:
    """POST ``body``; the status and the JSON reply. With ``read_lines`` (a stream), read that
    many lines and hang up, as a client that goes away does (the server aborts the request)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            if read_lines is not None:
                for _ in range(read_lines):
                    response.readline()
                return response.status, None
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _random_requests(model: str, count: int, seed: int) -> list[tuple[str, dict, dict]]:
    """(endpoint, body, what to check) for ``count`` requests with the sampling parameters an
    OpenAI client sends: a third over min_sparse_len (compressed), some past the context."""
    import random

    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
    document = " ".join(rng.choice(words) for _ in range(260))  # ~1.6K tokens, shared
    cases = []
    for i in range(count):
        kind = rng.random()
        prompt = (document + f" question {i}: " + " ".join(rng.sample(words, 3)) if kind < 0.4
                  else "x " * 1100 if kind < 0.47  # 2200 tokens: past max_model_len
                  else " ".join(rng.choice(words) for _ in range(rng.randint(1, 120))))
        body = {"model": model, "prompt": prompt, "max_tokens": rng.choice([1, 5, 24, 4000])}
        if rng.random() < 0.5:
            body |= {"temperature": 0.8, "top_p": 0.9, "seed": rng.randint(0, 99)}
        else:
            body["temperature"] = 0
        check = {"too_long": len(prompt) + 1 + body["max_tokens"] > 2048,  # + BOS
                 "hang_up": rng.random() < 0.15}
        options = [("n", 2, 0.3 if body["temperature"] else 0.0),  # vLLM: n > 1 samples
                   ("logprobs", 3, 0.25), ("stop", ["gamma"], 0.2),
                   ("min_tokens", min(3, body["max_tokens"]), 0.1),
                   ("repetition_penalty", 1.2, 0.1)]
        if check["hang_up"]:
            body["stream"] = True
        else:  # vLLM refuses prompt logprobs on a stream
            options += [("prompt_logprobs", 1, 0.2), ("echo", True, 0.1)]
        for key, value, share in options:
            if rng.random() < share:
                body[key] = value
        cases.append(("/v1/completions", body, check))
    return cases


def test_random_openai_traffic_leaves_the_server_up_and_empty(server):
    """What clients send, concurrently: sampling parameters, n, logprobs of the prompt and of
    each token, echo, stop strings, prompts past the context, clients hanging up mid-stream.
    Every reply is a 200, or a 400 for a request past the context; none takes the engine down,
    and afterwards no request, page or host-store row is left."""
    from concurrent.futures import ThreadPoolExecutor

    base, model, method = server
    cases = _random_requests(model, 48, seed=sum(map(ord, method)))

    def send(case):
        endpoint, body, check = case
        return case, _request(base + endpoint, body, 2 if check["hang_up"] else None)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(send, cases))
    for (_, body, check), (status, reply) in replies:
        assert status == (400 if check["too_long"] else 200), (status, reply)
        if status != 200 or reply is None:
            continue
        assert len(reply["choices"]) == body.get("n", 1)
        if body.get("prompt_logprobs") is not None:  # one entry per prompt token (first: None)
            assert len(reply["choices"][0]["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
        if body.get("echo"):
            assert reply["choices"][0]["text"].startswith(body["prompt"])
    assert sum(s == 200 for _, (s, _) in replies) > len(cases) // 2
    assert any(c[2]["too_long"] for c, _ in replies) and any(c[2]["hang_up"] for c, _ in replies)

    from engine_utils import metric, wait_for

    def settled():  # a worker releases a finished or aborted request at its next step
        stats = post_json(base + "/collective_rpc",
                          {"method": "kv_compression_stats"})["results"][0]
        empty = (not stats["requests"] and stats["compressed_requests"] == 0
                 and stats["store"]["used_bytes"] == stats["store"]["num_keys"] == 0)
        return stats if empty else None

    wait_for(base, model, settled)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(base, rf"^vllm:{gauge}\{{[^}}]*\}} (\S+)") == 0, gauge
