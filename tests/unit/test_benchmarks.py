"""The benchmarks still run: each script's --help, and the kernel-level ones at tiny sizes (a
crash in a benchmark is found here, not by the next person measuring). No timing is checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py")  # plots.py is their module
                 if "argparse" in p.read_text())


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=BENCHMARKS.parent, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    done = _run([f"benchmarks/{script}", "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout


SMOKE_RUNS = {  # the smallest sizes each takes (ShadowKV's store needs a context past 2K)
    "bench_quant_attention.py": ["--contexts", "512", "--batches", "1,2", "--reps", "1"],
    "bench_heavy_hitters.py": ["--lengths", "512", "--reps", "1"],
    "bench_channel_top_k.py": ["--contexts", "1024", "--batches", "1,2", "--reps", "1"],
    "bench_decode_step.py": ["--contexts", "4096", "--batches", "1,2", "--reps", "1"],
    "bench_sparse_kernels.py": ["--contexts", "1024", "--batches", "1", "2", "--reps", "1"],
    "bench_exact_decode.py": ["--contexts", "300", "--batches", "1", "2", "--reps", "1",
                              "--warmup", "0"],
    "bench_layer_decode.py": ["--contexts", "1024", "--batches", "1", "--reps", "1",
                              "--warmup", "0", "--sparse-budget", "64",
                              "--profile-context", "1024", "--profile-batch", "1"],
    "bench_prompt_end.py": ["--contexts", "1024", "--reps", "1"],
    "prefix_cache.py": ["--context", "1024", "--questions", "2", "--gen", "2"],  # engines
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_kernel_benchmark_runs(script, tmp_path):
    out = tmp_path / "result.json"
    done = _run([f"benchmarks/{script}", *SMOKE_RUNS[script], "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    results = next(out.glob("*.json")) if out.is_dir() else out  # some take a folder
    assert json.loads(results.read_text())


def test_every_method_summarises_committed_runs(tmp_path):
    folder = "benchmarks/throughput/llama8b_shape_16k_every_method_s69"
    done = _run(["benchmarks/every_method.py", folder, "--png", str(tmp_path / "p.png")])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][2:]
    assert sorted(line.split(" | ")[0][2:] for line in rows) == sorted(
        p.parent.name for p in (BENCHMARKS.parent / folder).glob("*/throughput.json"))


def test_prefill_floor_measures_the_runs_dtype():
    """The GEMM floor is measured in the dtype the run served: its --dtype, else the model's."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("prefill_floor",
                                                  BENCHMARKS / "prefill_floor.py")
    floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor)
    assert floor.run_dtype({"dtype": "float32"}, {"torch_dtype": "bfloat16"}) == torch.float32
    assert floor.run_dtype({"dtype": "auto"}, {"torch_dtype": "float16"}) == torch.float16
    assert floor.run_dtype({}, {"dtype": "float32"}) == torch.float32  # newer configs' key
    assert floor.run_dtype({}, {}) == torch.bfloat16  # the local models'
