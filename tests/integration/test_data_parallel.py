"""Data parallelism: ``--data-parallel-size 2`` runs two engines, each with its own pool, host
store, stats and prefix cache; the server's /metrics adds the engines up (tensor-parallel ranks
of one engine share its requests and count them once, engines do not)."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_utils import engine_env, metric, one_core_per_rank, wait_for

from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV
from vllm_shadowkv.server import post_json, serve

pytestmark = pytest.mark.slow
REQUESTS = 4


def test_two_engines_serve_sparse_requests_and_metrics_add_them_up(tiny_model, tmp_path):
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    env = engine_env() | {STATS_DIR_ENV: str(stats_dir),
                          "VLLM_CPU_OMP_THREADS_BIND": one_core_per_rank()}  # by DP rank
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
        series = r'^kv_compression_requests_finished_total\{method="shadowkv",mode="sparse"\} (\S+)'

        def all_finished():  # the workers' snapshots land within a step or two
            value = metric(base, series)
            return value if value >= REQUESTS else None

        finished = wait_for(base, tiny_model, all_finished, timeout=30)
        snaps = [json.loads(p.read_text()) for p in stats_dir.glob("worker-*.json")]

        # A prefix-aware router sends a document's follow-up to the engine that holds it
        # (vLLM's X-data-parallel-rank header): that engine's prefix cache serves it.
        document = "A shared document. " + "The quick brown fox jumps over the lazy dog. " * 40
        for question in ("First question?", "Second question?"):
            reply = post_json(base + "/v1/completions", {
                "model": tiny_model, "prompt": document + question, "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}, headers={"X-data-parallel-rank": "1"})
            assert reply["usage"]["completion_tokens"] == 8
        by_engine = [metric(base, rf'^vllm:prefix_cache_hits_total\{{engine="{e}".*\}} (\S+)')
                     for e in (0, 1)]
    assert sorted(s["data_parallel_rank"] for s in snaps) == [0, 1]
    assert sum(s["finished_sparse"] for s in snaps) == REQUESTS
    assert finished == REQUESTS
    assert by_engine[1] >= 1024 and by_engine[0] == 0, by_engine
