"""One small end-to-end run of the accuracy runner through real vLLM engines: the default backend
and shadowkv decoding sparsely with a budget that covers the whole context at full rank, which
must answer exactly as the default backend does."""

import json
import os
import subprocess
import sys

import pytest

from vllm_shadowkv.eval import tasks
from vllm_shadowkv.eval.retrieval_model import FIXTURE

# Full rank (key width 2 x 128), every chunk selectable: sparse decode is exact up to rounding.
COVERING = {"rank": 256, "sparse_budget": 2048, "outlier_chunks": 8, "min_sparse_len": 1024}


@pytest.mark.slow
def test_runner_default_and_covering_shadowkv_agree_and_run_sparse(tmp_path):
    out = tmp_path / "acc"
    shadowkv = f"shadowkv:{json.dumps(COVERING)}"
    cmd = [sys.executable, "-m", "vllm_shadowkv.eval.run", "--model", str(FIXTURE),
           "--tasks", ",".join(tasks.NIAH_TASKS), "--lengths", "2048", "--depths", "0.5",
           "--samples", "1", "--enforce-eager", "--engine-args", '{"enable_prefix_caching": false}',
           "--backends", "default", shadowkv, "--out", str(out)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("TRITON_INTERPRET", None)  # the engine's CPU path must not see the interpreter
    # cwd: not the repository root, whose top-level triton_kernels/ would shadow vLLM's probe.
    subprocess.run(cmd, check=True, timeout=600, env=env, cwd=tmp_path)

    result = json.loads((out / "results.json").read_text())
    records = {b: [r for r in result["records"] if r["backend"] == b] for b in ("default", shadowkv)}
    assert [len(rs) for rs in records.values()] == [4, 4]  # every needle family, once
    for r in records[shadowkv]:  # the runner asked the engine: every request decoded sparsely
        assert r["prompt_tokens"] >= 1024 and r["expected_sparse"], r
        assert r["mode"] == "sparse" and r["decode_steps"] > 0, r
    for ref, test in zip(records["default"], records[shadowkv]):
        assert (ref["task"], ref["seed"]) == (test["task"], test["seed"])
        assert ref["score"] == test["score"] == 1.0, (ref, test)
        assert ref["prediction"] == test["prediction"], (ref, test)
    # multivalue/multiquery give 3 of their 4 answers in decode steps, and get them right.
    decoded = [r for r in records[shadowkv] if r["decode_score"] is not None]
    assert {r["task"] for r in decoded} == {"niah_multivalue", "niah_multiquery"}
    assert all(r["decode_score"] == 1.0 for r in decoded)
    modes = result["summary"]["by_length"]
    assert modes == [{"backend": shadowkv, "length": 2048, "requests": 4, "sparse": 4,
                      "hit_rate": modes[0]["hit_rate"], "speculation_hit_rate": None,
                      "relative_error": None, "chunk_recall": None}]  # no measure_fidelity
    table = (out / "results.md").read_text()
    assert "| niah_single | 2048 | 100.0 | 100.0 |" in table and "| 4/4 |" in table
    assert (out / "accuracy_vs_length.png").stat().st_size > 0
    assert (out / "heatmap_default.png").stat().st_size > 0


def test_build_samples_gives_the_harder_task_its_depths(byte_tokenizer):
    from vllm_shadowkv.eval.run import MAX_TOKENS, build_samples

    assert set(MAX_TOKENS) == set(tasks.TASKS + tasks.HARD_TASKS)
    out = build_samples(byte_tokenizer, ["niah_collide", "vt"], [1024], [0.25, 0.75], 2, 5)
    assert [(s.task, s.depth, s.seed) for s in out] == [
        ("niah_collide", 0.25, 5), ("niah_collide", 0.25, 6), ("niah_collide", 0.75, 5),
        ("niah_collide", 0.75, 6), ("vt", None, 5), ("vt", None, 6)]
