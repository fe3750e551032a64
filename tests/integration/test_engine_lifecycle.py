"""Preemption, aborts, a full host store and 1,000 requests through the engine, for every
method of the table; random load; seeded sampling across a chunked prefill.

Each scenario runs in a fresh process (tests/integration/lifecycle.py) with the engine core
in-process, so the scheduler's block pool is read directly.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_utils import assert_greedy_close, engine_env, failure_excerpt, uses_host_store

from vllm_shadowkv.methods import METHODS

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "lifecycle.py"


def run(scenario, model, tmp_path, method="none"):
    out = tmp_path / f"{scenario}.json"
    env = engine_env() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(SCRIPT), scenario, method, model, str(out)],
                          env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    return json.loads(out.read_text())


def assert_empty(state):
    assert state["free_blocks"] == state["total_blocks"] - 1  # all but vLLM's null block
    assert state["store"]["used_bytes"] == 0 and state["store"]["num_keys"] == 0
    assert state["compressed_requests"] == 0 and state["manager_tracked"] == 0
    assert state["suspended"] == 0


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    return run("reference", tiny_model, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("method", list(METHODS))
def test_preemption_recomputes_sparse_request(method, tiny_model, tmp_path):
    """vLLM preempts a compressed request when pages run out and recomputes it (its prompt is
    compressed again); both requests finish and everything is given back."""
    result = run("preemption", tiny_model, tmp_path, method)
    assert result["preemptions"] and result["preemptions"] > 0
    assert [len(o["token_ids"]) for o in result["outputs"]] == [400, 400]
    assert result["after"]["finished_modes"] == ["sparse", "sparse"]
    assert_empty(result["after"])


@pytest.mark.parametrize("method", list(METHODS))
def test_abort_mid_generation_frees_everything(method, tiny_model, tmp_path):
    result = run("abort", tiny_model, tmp_path, method)
    assert result["finished"] == ["r2", "r3"]  # aborted requests report no finish
    assert_empty(result["before"])
    assert_empty(result["after"])


@pytest.mark.parametrize("method", list(METHODS))
def test_full_host_store_waits_then_completes(method, tiny_model, tmp_path, reference):
    result = run("store_full", tiny_model, tmp_path, method)
    assert_greedy_close(reference["store_full"], result["outputs"], ("default", method))
    assert result["after"]["finished_modes"] == ["sparse", "sparse"]
    assert_empty(result["after"])


@pytest.mark.parametrize("method", list(METHODS))
def test_thousand_mixed_requests_leave_pool_and_store_empty(method, tiny_model, tmp_path):
    result = run("thousand_requests", tiny_model, tmp_path, method)
    assert_empty(result["before"])
    assert_empty(result["after"])
    # long requests did use the store (the methods that have one)
    assert (result["after"]["store"]["allocated_bytes"] > 0) == uses_host_store(method)


@pytest.mark.parametrize("method", list(METHODS) + ["specache+speculative"] + [
    f"{m}+prefix" for m, cls in METHODS.items() if not cls.prefix_caching_off])
def test_random_load_with_preemptions_and_aborts_leaves_pool_and_store_empty(method, tiny_model,
                                                                           tmp_path):
    result = run("random_load", tiny_model, tmp_path, method)
    assert len(result["finished"]) + len(result["aborted"]) == 60
    assert not set(result["finished"]) & set(result["aborted"])
    metrics = result["metrics"]
    assert metrics["vllm:num_preemptions"] > 0
    if "+speculative" in method:  # guess rows ran, none accepted
        assert metrics["vllm:spec_decode_num_drafts"] > 0
        assert metrics["vllm:spec_decode_num_accepted_tokens"] == 0
    # Long prompts adopted the pages of earlier ones with the same start
    assert (metrics["vllm:prefix_cache_hits"] > 0) == method.endswith("+prefix")
    # Reset halfway with requests running (preempted, then recomputed), and at the end: emptied.
    assert result["resets"] == ([True, True, 0] if method.endswith("+prefix") else [])
    after = result["after"]
    assert "sparse" in after["finished_modes"]
    # Each request counted once however often it was preempted, every preemption recorded
    assert after["finished_counted"] == len(after["finished_modes"])
    # (vLLM appends a suffix to the ids the engine sees)
    assert set(result["finished"]) <= {i.rsplit("-", 1)[0] for i in after["finished_ids"]}
    assert after["preemptions_counted"] == metrics["vllm:num_preemptions"]
    assert_empty(after)


def test_seeded_request_survives_a_chunked_prefill(tiny_model, tmp_path):
    """A seeded request gives the same tokens whether its prompt was prefilled in one step or
    in two (the first step's sample discarded), and the engine lives: the runner's patch is the
    same for every method, so one runs it."""
    result = run("seeded_sampling", tiny_model, tmp_path, "shadowkv")
    assert len(result["alone"]) == 16
    assert result["behind"] == result["alone"]
    assert result["after"]["finished_modes"] == ["dense", "sparse", "sparse"]
    assert_empty(result["after"])


@pytest.fixture(scope="module")
def default_features(tiny_model, tmp_path_factory):
    return run("serving_features", tiny_model, tmp_path_factory.mktemp("features"))


@pytest.mark.parametrize("method", list(METHODS))
def test_lora_parallel_sampling_and_structured_output(method, default_features, tiny_model,
                                                      tmp_path):
    """With covering settings a LoRA adapter changes the output exactly as under the default
    backend, alone and mixed with base requests in one batch (the long prompt compressed);
    n=2 and a structured choice complete."""
    result = run("serving_features", tiny_model, tmp_path, method)
    default = default_features
    assert default["lora"] != default["base"]  # the adapter is applied
    assert default["mixed"] == [default["lora"][0], default["base"][1]]
    for key in ("base", "lora", "mixed"):
        assert_greedy_close(default[key], result[key], ("default", method))
    assert result["n2"] == [8, 8]
    assert result["choice"] in result["choices"]
    assert "sparse" in result["after"]["finished_modes"]
    assert_empty(result["after"])
