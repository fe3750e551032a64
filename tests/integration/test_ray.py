"""vLLM's Ray executor with tensor parallelism (TP=2) on the CPU, offline and behind the server.

The module starts a one-node Ray cluster on loopback and stops it at the end. vLLM's CPU platform
gets a Ray device from the test-only plugin in tests/ray_cpu_plugin (installed by
scripts/setup.sh): a custom resource, which the cluster declares here, one per worker.
"""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from engine_utils import (PROMPTS, assert_greedy_close, engine_env, generate_in_fresh_process,
                          metric, uses_host_store, wait_for)
from ray_cpu_for_tests import RESOURCE
from test_engine_sparse import long_prompt

from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV
from vllm_shadowkv.introspect import EXTENSION_CLASS
from vllm_shadowkv.methods import METHODS

# Ray is the executor, the same for every method: one method with a host store runs through it
# (CI time). Every method's tensor-parallel compression, each rank its own KV heads and store,
# is tested with the multiprocessing executor in test_engine_sparse.py.
RAY_METHODS = ["shadowkv"]
from vllm_shadowkv.server import free_port, post_json, serve

pytestmark = pytest.mark.slow

TP = 2
MAX_MODEL_LEN = 4096
LONG = long_prompt(450, 2)  # 2302 tokens: compressed above min_sparse_len 2048; short ones dense


def covering(method: str) -> dict:
    """The method's covering settings for one rank's 2 of the tiny model's 4 KV heads (2 x 64)."""
    return METHODS[method].covering_settings(128, MAX_MODEL_LEN) | {"min_sparse_len": 2048}


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory):
    """A one-node Ray cluster on loopback, no dashboard, with one RESOURCE per worker and no
    CPUs to schedule (vLLM's workers ask for none); yields the variables that point vLLM at it.
    ``ray start --block`` stops its own cluster when terminated, whatever happened (``ray stop``
    would stop every Ray cluster on the machine: another test worker's, the user's)."""
    ray = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    root = tmp_path_factory.mktemp("ray")
    start = [ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
             "--num-cpus=0", f"--resources={json.dumps({RESOURCE: TP})}",
             "--include-dashboard=false", "--disable-usage-stats",
             f"--object-store-memory={100 << 20}", f"--temp-dir={root}"]
    # Ray's switch for a local-only cluster: without it Ray replaces 127.0.0.1 by the machine's
    # routable address and listens on every interface. Set for the cluster and its clients.
    ray_vars = {"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                # vLLM's own binding for the two ranks, not the one core of a test worker
                # (tests/conftest.py): a single core list for two ranks fails the engine's start
                "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    # Ray's workers inherit the environment of `ray start` (vLLM's Ray executor only adds the
    # variables missing there): the engines' environment, without a test worker's one-thread
    # default (tests/conftest.py). No drain wait at the end.
    env = {k: v for k, v in engine_env().items() if k != "OMP_NUM_THREADS"} | ray_vars
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    log = root / "ray_start.log"
    began = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(start, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None, f"ray start failed:\n{log.read_text()}"
            assert time.monotonic() - began < 180, f"no Ray cluster after 180 s:\n{log.read_text()}"
            time.sleep(0.5)
        print(f"\nray start: {time.monotonic() - began:.1f} s")
        yield ray_vars
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ray_request(model: str, backend: str | None, **engine_kwargs) -> dict:
    return {
        "model": model, "attention_backend": backend, "batches": [[PROMPTS[0], LONG]],
        "max_tokens": 8,
        "engine_kwargs": {"max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": False,
                          "tensor_parallel_size": TP, "distributed_executor_backend": "ray",
                          **engine_kwargs},
    }


@pytest.fixture(scope="module")
def default_over_ray(ray_env, tiny_model, tmp_path_factory):
    result = generate_in_fresh_process(ray_request(tiny_model, None),
                                       tmp_path_factory.mktemp("default"), env=ray_env)
    assert len(result["rank_backends"]) == TP
    print(f"\ndefault backend over Ray: engine started in {result['start_s']:.1f} s")
    return result


@pytest.mark.parametrize("method", RAY_METHODS)
def test_offline_over_ray_equals_default_and_each_rank_compresses(
        method, ray_env, default_over_ray, tiny_model, tmp_path):
    """LLM(...) over Ray, TP=2: both ranks run the method, each compresses its own KV heads
    (full rank for 2 heads: the output equals the default backend's only if each rank has its
    own) into its own store, which is empty once the requests finished."""
    test = generate_in_fresh_process(
        ray_request(tiny_model, method, additional_config={method: covering(method)}),
        tmp_path, env=ray_env)
    print(f"\n{method} over Ray: engine started in {test['start_s']:.1f} s")
    assert len(test["rank_backends"]) == TP
    for backends in test["rank_backends"]:
        assert backends and set(backends.values()) == {method.upper()}
    for runner in test["rank_runners"]:  # Model Runner V1 in every Ray worker
        assert runner["v1"] and runner["use_v2_model_runner"] is False, runner
    assert_greedy_close(default_over_ray["batches"][0], test["batches"][0],
                        names=("default over Ray", f"{method} over Ray"))
    for rank, stats in enumerate(test["rank_stats"][0]):
        print(f"rank {rank} store after: {stats['store']}")
        modes = sorted(s["mode"] for s in stats["finished"].values())
        assert modes == ["dense", "sparse"], modes
        sparse = next(s for s in stats["finished"].values() if s["mode"] == "sparse")
        assert sparse["decode_steps"] > 0 and sparse["selected"] > 0
        store = stats["store"]
        assert (store["bytes_fetched"] > 0) == uses_host_store(method)
        assert store["used_bytes"] == store["num_keys"] == stats["compressed_requests"] == 0


@pytest.fixture(scope="module", params=RAY_METHODS)
def ray_server(request, ray_env, tiny_model, tmp_path_factory):
    """The OpenAI server over Ray, TP=2, with the stats directory named here so the test can
    read the ranks' snapshots next to /metrics."""
    method = request.param
    root = tmp_path_factory.mktemp(f"server-{method}")
    stats_dir = root / "stats"
    stats_dir.mkdir()
    env = engine_env() | ray_env | {"VLLM_SERVER_DEV_MODE": "1", STATS_DIR_ENV: str(stats_dir)}
    args = [
        "--attention-backend", method, "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--tensor-parallel-size", str(TP), "--distributed-executor-backend", "ray",
        "--worker-extension-cls", EXTENSION_CLASS,
        "--additional-config", json.dumps({method: covering(method)}),
    ]
    began = time.monotonic()
    with serve(tiny_model, args, root / "server.log", env, timeout=600) as base:
        print(f"\n{method} server over Ray: healthy after {time.monotonic() - began:.1f} s")
        yield base, tiny_model, method, stats_dir


def test_server_over_ray_answers_with_the_method_on_both_ranks(ray_server):
    base, model, method, _ = ray_server
    ranks = post_json(base + "/collective_rpc", {"method": "kv_compression_backends"})["results"]
    assert len(ranks) == TP
    for backends in ranks:
        assert backends and set(backends.values()) == {method.upper()}
    reply = post_json(base + "/v1/completions", {
        "model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
    })
    assert reply["usage"]["completion_tokens"] == 8


def test_server_over_ray_counts_a_sparse_request_once(ray_server):
    """Every rank runs every request (on its own KV heads): /metrics counts a compressed request
    once, not once per rank, and adds up what the ranks hold (store capacity)."""
    base, model, method, stats_dir = ray_server
    series = rf'^kv_compression_requests_finished_total\{{method="{method}",mode="sparse"\}} (\S+)'
    before = metric(base, series)
    reply = post_json(base + "/v1/completions", {
        "model": model, "prompt": LONG, "max_tokens": 8, "temperature": 0,
    })
    assert reply["usage"]["prompt_tokens"] > 2048
    snapshots = wait_for(base, model, lambda: _all_finished(stats_dir, before + 1))
    assert metric(base, series) == before + 1
    capacity = rf'^kv_compression_host_store_capacity_bytes\{{method="{method}"\}} (\S+)'
    assert metric(base, capacity) == sum(s["store_capacity_bytes"] for s in snapshots) > 0
    assert metric(base, rf'^kv_compression_selected_rows_total\{{method="{method}"\}} (\S+)') > 0


def test_server_over_ray_abort_leaves_both_stores_empty(ray_server):
    """A compressed request aborted by its client mid-decode gives its rows back on both ranks."""
    base, model, _, _ = ray_server
    finished_before = [set(r["finished"]) for r in rank_stats(base)]
    generated = r'^vllm:generation_tokens_total\{[^}]*\} (\S+)'
    generated_before = metric(base, generated)
    body = {"model": model, "prompt": LONG, "max_tokens": 1000, "temperature": 0, "stream": True}
    request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as stream:
        assert stream.readline().startswith(b"data: ")  # decoding: the prompt is compressed
    # the client is gone: vLLM aborts the request

    def ranks_empty():
        ranks = rank_stats(base)
        empty = all(not r["requests"] and r["compressed_requests"] == 0
                    and r["store"]["used_bytes"] == r["store"]["num_keys"] == 0 for r in ranks)
        return ranks if empty else None

    ranks = wait_for(base, model, ranks_empty)
    assert len(ranks) == TP
    for rank, (stats, before) in enumerate(zip(ranks, finished_before)):
        print(f"rank {rank} store after abort: {stats['store']}")
        aborted = [s for req_id, s in stats["finished"].items()
                   if req_id not in before and s["mode"] == "sparse"]
        assert len(aborted) == 1 and aborted[0]["decode_steps"] > 0  # it decoded compressed
    # aborted, not finished: far fewer tokens than its 1000 (with the one-token requests)
    assert metric(base, generated) - generated_before < 1000


def rank_stats(base: str) -> list[dict]:
    return post_json(base + "/collective_rpc", {"method": "kv_compression_stats"})["results"]


def _all_finished(stats_dir: Path, sparse: int) -> list[dict] | None:
    """The ranks' snapshots once there is one per rank and each counts ``sparse`` finished."""
    snapshots = [json.loads(p.read_text()) for p in stats_dir.glob("worker-*.json")]
    done = len(snapshots) == TP and all(s["finished_sparse"] == sparse for s in snapshots)
    return snapshots if done else None
