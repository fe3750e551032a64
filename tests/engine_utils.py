"""Shared by the engine tests: run vLLM in a fresh process and compare greedy outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

GENERATE_SCRIPT = Path(__file__).parent / "integration" / "generate.py"
# Deterministic prompts of very different lengths (byte tokenizer: one token per byte).
PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole. " * 20,
    "0123456789" * 3,
]


def uses_host_store(method: str) -> bool:
    """Whether the method keeps part of a compressed request in the host store (ShadowKV: the
    values) or all of it in the pages (MiniKV), judged at the tiny model's shapes."""
    import torch

    from vllm_shadowkv.config import parse_settings
    from vllm_shadowkv.methods import METHODS
    from vllm_shadowkv.methods.base import KVShapes

    cls = METHODS[method]
    shapes = KVShapes(4, 64, torch.bfloat16, 16, num_layers=4, max_model_len=4096)
    settings = parse_settings(cls.settings_cls, cls.covering_settings(256, 4096))
    return cls(settings.resolved(shapes), shapes).store_bytes(0, 4096) > 0


# What a method needs beyond its defaults on the project's random-weight models: TailorKV's
# q_layers "auto" needs a family table entry or a profile, and a profile of random weights finds
# every layer dense (all quantized, nothing offloaded): the paper's Llama-3.x set instead.
MODEL_SETTINGS = {"tailorkv": {"q_layers": [0]}}


def default_settings(method: str, **changes) -> dict:
    """The method's defaults on the built-in models, with ``changes``."""
    return MODEL_SETTINGS.get(method, {}) | changes


def engine_env() -> dict[str, str]:
    from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("TRITON_INTERPRET", None)  # the engine's CPU path must not see the interpreter
    # Each engine its own stats directory: a test that built an engine config in this process
    # (test_startup_errors) set one here, and a server's /metrics would add up every engine that
    # inherited it.
    env.pop(STATS_DIR_ENV, None)
    return env


def failure_excerpt(log: str, first: int = 5000, last: int = 3000) -> str:
    """A failed engine's log cut to what tells why: from its first error or traceback (the
    root cause; later ones are its consequences, such as EngineDeadError) and its end."""
    starts = [i for i in (log.find("ERROR"), log.find("Traceback")) if i >= 0]
    start = min(starts, default=max(0, len(log) - last))
    if start + first >= len(log) - last:
        return log[start:]
    return f"{log[start:start + first]}\n[...]\n{log[-last:]}"


def _one_rank(request: dict) -> bool:
    kwargs = request.get("engine_kwargs", {})
    return (kwargs.get("tensor_parallel_size", 1) == 1 and kwargs.get("data_parallel_size", 1) == 1
            and kwargs.get("distributed_executor_backend") in (None, "uni"))


def generate_in_fresh_process(request: dict, tmp_path: Path, timeout: float = 600,
                              env: dict[str, str] | None = None,
                              vllm_processes: bool = False) -> dict:
    """Run tests/integration/generate.py in a new interpreter (``env`` on top of
    ``engine_env()``); return its JSON result, with the process's output under "log".

    A one-rank engine runs in that interpreter (VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core
    and worker in one process, as vLLM's own tests run it): each process imports vLLM for about
    12 s on a slow CPU, so this saves about 25 s of every engine test. ``vllm_processes`` keeps
    vLLM's default layout (engine core and worker each in their own process) for the tests of
    what the plugin does in every process; multi-rank engines always have it."""
    if not vllm_processes and _one_rank(request):
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    spec, out = tmp_path / "request.json", tmp_path / "result.json"
    spec.write_text(json.dumps(request))
    proc = subprocess.run(
        [sys.executable, str(GENERATE_SCRIPT), str(spec), str(out)],
        env={**engine_env(), **(env or {})}, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        (tmp_path / "generate.log").write_text(proc.stdout + proc.stderr)
        raise AssertionError(f"generate.py failed ({proc.returncode}), whole log in "
                             f"{tmp_path / 'generate.log'}:\n{failure_excerpt(proc.stderr)}")
    return json.loads(out.read_text()) | {"log": proc.stdout + proc.stderr}


def assert_one_host_wait_per_layer(calls: list[dict]) -> None:
    """generate.py's host-wait count: every layer's call in a decode-only step waited for the
    device at most once (a read of device data, or a HostCopy round trip)."""
    assert calls, "no decode-only step was counted"
    assert {c["layer"] for c in calls} == set(range(max(c["layer"] for c in calls) + 1))
    bad = [c for c in calls if len(c["reads"]) + c["copies"] > 1]
    assert not bad, bad[:3]


def assert_greedy_close(ref: list[dict], test: list[dict], names=("ref", "test"), tol=0.15,
                        logprob_tol: float | None = None):
    """vLLM's ``check_logprobs_close``: tokens equal, or at the first difference each side's
    token is in the other's top logprobs and the two are a near-tie on both sides. With
    ``logprob_tol``, also every top token the two sides share has the same logprob within it,
    at each position up to the first difference: on the tiny model's flat logits near-ties are
    common, and the logprobs are what tells a close attention from a wrong one (see
    ``exact_reference`` in test_engine_sparse.py)."""
    assert len(ref) == len(test)
    for i, (a, b) in enumerate(zip(ref, test)):
        for pos, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"])):
            la, lb = a["logprobs"][pos], b["logprobs"][pos]
            if logprob_tol is not None:
                worst = max(abs(la[t] - lb[t]) for t in set(la) & set(lb))
                assert worst < logprob_tol, (f"prompt {i}, token {pos}: logprobs differ by "
                                             f"{worst:.4f} ({names[0]} vs {names[1]})")
            if ta == tb:
                continue
            where = f"prompt {i}, token {pos}: {names[0]} chose {ta}, {names[1]} chose {tb}"
            assert str(tb) in la and str(ta) in lb, f"{where}; not in each other's top logprobs"
            assert abs(la[str(ta)] - la[str(tb)]) < tol, f"{where}; not a near-tie in {names[0]}"
            assert abs(lb[str(ta)] - lb[str(tb)]) < tol, f"{where}; not a near-tie in {names[1]}"
            break  # past a near-tie the sequences legitimately diverge
        else:
            assert len(a["token_ids"]) == len(b["token_ids"]), f"prompt {i}: lengths differ"


def fixture_model() -> str:
    from vllm_shadowkv.eval.retrieval_model import FIXTURE

    return str(FIXTURE)


def run_on_fixture(tmp_path: Path, name: str, method: str, prompt: str, settings: dict,
                   max_tokens: int) -> tuple[dict, dict]:
    """One compressed request of ``prompt`` on the retrieval fixture with the in-engine fidelity
    probe, ``max_tokens`` generated whatever the model's end token -> (result, its stats)."""
    path = tmp_path / name
    path.mkdir()
    result = generate_in_fresh_process({
        "model": fixture_model(), "attention_backend": method, "max_tokens": max_tokens,
        "ignore_eos": True,  # the model ends its answer; the probe runs on every step
        "batches": [[prompt]],
        "engine_kwargs": {"max_model_len": 4096, "enable_prefix_caching": False,
                          "additional_config": {method: settings | {
                              "min_sparse_len": 1024, "measure_fidelity": True}}},
    }, path)
    (stats,) = result["stats"][0]["finished"].values()
    assert stats["mode"] == "sparse" and len(result["batches"][0][0]["token_ids"]) == max_tokens
    return result, stats


def one_core_per_rank(ranks: int = 2) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each rank (TP, or DP engine) its own core; vLLM's
    automatic binding wants a NUMA node per rank, and the suite's one-core binding per xdist
    worker would leave the other ranks none."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(map(str, cpus[:ranks])) if len(cpus) >= ranks else "nobind"


def metric(base: str, pattern: str) -> float:
    """The value of the server's /metrics line matching ``pattern`` (0 when absent)."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for(base: str, model: str, check, timeout: float = 60):
    """Poll ``check`` until it returns something; a worker releases a finished or aborted
    request at its next step, so each try sends a one-token request."""
    from vllm_shadowkv.server import post_json

    deadline = time.time() + timeout
    while time.time() < deadline:
        post_json(base + "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1})
        if (found := check()) is not None:
            return found
        time.sleep(1)
    raise AssertionError(f"not reached within {timeout:.0f} s: {check.__name__}")
