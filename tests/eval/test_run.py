"""One small end-to-end run of the accuracy runner (vLLM's default backend; the shadowkv
backends join once they land)."""

import json
import os
import subprocess
import sys

import pytest

from vllm_shadowkv.eval.retrieval_model import FIXTURE


@pytest.mark.slow
def test_runner_end_to_end(tmp_path):
    out = tmp_path / "acc"
    cmd = [sys.executable, "-m", "vllm_shadowkv.eval.run", "--model", str(FIXTURE),
           "--lengths", "512,1024", "--depths", "0.5", "--samples", "1", "--enforce-eager",
           "--backends", "default", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=240, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    result = json.loads((out / "results.json").read_text())
    assert len(result["records"]) == 6 * 2  # every task at both lengths
    needles = [r for r in result["summary"]["by_task"] if r["task"].startswith("niah")]
    assert needles and all(r["accuracy"] == 100.0 for r in needles)
    assert "| niah_single | 512 |" in (out / "results.md").read_text()
    assert (out / "accuracy_vs_length.png").stat().st_size > 0
    assert (out / "heatmap_default.png").stat().st_size > 0
