"""Data parallelism: ``--data-parallel-size 2`` runs two engines, each with its own pool, host
store and stats; the server's /metrics adds the engines up (tensor-parallel ranks of one engine
share its requests and count them once, engines do not)."""

import json
import os
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_utils import engine_env

from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV
from vllm_shadowkv.server import post_json, serve

pytestmark = pytest.mark.slow
REQUESTS = 4


def test_two_engines_serve_sparse_requests_and_metrics_add_them_up(tiny_model, tmp_path):
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    cpus = sorted(os.sched_getaffinity(0))
    # Each engine its own core ("a|b", by DP rank); the suite's one-core binding would leave the
    # second engine none.
    bind = "|".join(map(str, cpus[:2])) if len(cpus) >= 2 else "nobind"
    env = engine_env() | {STATS_DIR_ENV: str(stats_dir), "VLLM_CPU_OMP_THREADS_BIND": bind}
    args = ["--attention-backend", "shadowkv", "--enforce-eager", "--max-model-len", "2048",
            "--data-parallel-size", "2",
            "--additional-config", json.dumps({"shadowkv": {"min_sparse_len": 1024}})]
    with serve(tiny_model, args, tmp_path / "server.log", env, timeout=300) as base:
        def complete(i):
            prompt = f"Request {i}. " + "The quick brown fox jumps over the lazy dog. " * 40
            return post_json(base + "/v1/completions", {
                "model": tiny_model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})

        with ThreadPoolExecutor(REQUESTS) as pool:
            replies = list(pool.map(complete, range(REQUESTS)))
        assert all(r["usage"]["prompt_tokens"] > 1024 and r["usage"]["completion_tokens"] == 8
                   for r in replies)
        pattern = r'^kv_compression_requests_finished_total\{method="shadowkv",mode="sparse"\} (\S+)'
        finished, deadline = None, time.time() + 30
        while time.time() < deadline:  # the workers' snapshots land within a step or two
            metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
            finished = re.search(pattern, metrics, re.M)
            if finished and float(finished.group(1)) >= REQUESTS:
                break
            time.sleep(1)
        snaps = [json.loads(p.read_text()) for p in stats_dir.glob("worker-*.json")]
    assert sorted(s["data_parallel_rank"] for s in snaps) == [0, 1]
    assert sum(s["finished_sparse"] for s in snaps) == REQUESTS
    assert finished and float(finished.group(1)) == REQUESTS
