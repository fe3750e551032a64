"""The README's main job: the demo serves the retrieval model with shadowkv and answers, the
model compiled as `vllm serve` runs it without `--enforce-eager`."""

import subprocess
import sys

import pytest
from engine_utils import engine_env, failure_excerpt

pytestmark = pytest.mark.slow


def test_demo_answers_the_needle_question_sparsely(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vllm_shadowkv.demo"], env=engine_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    out = proc.stdout
    assert "-> score 1.00" in out, out
    assert "SHADOWKV in all 3 attention layers" in out, out
    request = next(line for line in out.splitlines() if line.startswith("request:"))
    assert ": sparse, prompt 4096 tokens" in request, out
    assert 'kv_compression_requests_finished_total{method="shadowkv",mode="sparse"} 1.0' in out, out
