#!/usr/bin/env bash
# The GPU checks in one call, for a CUDA machine with torch and Triton (vLLM not needed): the
# Triton kernels against their torch references, the CUDA decode path (pinned store, copy
# stream) against the CPU's, its one host wait per layer (CUDA's sync debug mode,
# tests/core/test_host_waits.py), TailorKV's channel scores read from pinned host pages in place
# (tests/core/test_critical_channels.py), SpeCache's deferred slot fetch on CUDA, the decode-step
# benchmark at Llama-3.1-8B shapes, the engine's exact attention (the paged Triton kernel
# against its gathered-SDPA predecessor, time and peak memory) and MiniKV's column sums
# (Triton) against it.
# Results go to ${OUT:-gpu_results}/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.gpu_pkg:${PYTHONPATH:-}"
# The package layout as setup.py installs it (triton_kernels/ under vllm_shadowkv), without pip.
mkdir -p .gpu_pkg && rm -rf .gpu_pkg/vllm_shadowkv && cp -r vllm_shadowkv .gpu_pkg/
cp -r triton_kernels .gpu_pkg/vllm_shadowkv/triton_kernels
python -m pytest -q -p no:cacheprovider --rootdir=. -c /dev/null tests/core \
    "tests/unit/test_pages.py::test_paged_sparse_decode_on_cuda_matches_cpu" \
    "tests/unit/test_specache_pages.py::test_a_slot_fetch_completed_later_brings_the_wanted_rows" \
    2>&1 | tee "$OUT/gpu_tests.txt"
python benchmarks/bench_decode_step.py --device cuda --out "$OUT/decode_step_cuda.json" \
    2>&1 | tee "$OUT/decode_step_cuda.txt"
python benchmarks/bench_exact_attention.py --device cuda --reps 3 \
    --out "$OUT/exact_attention_cuda.json" 2>&1 | tee "$OUT/exact_attention_cuda.txt"
python benchmarks/bench_heavy_hitters.py --device cuda --lengths 16384,32768 --reps 3 \
    --out "$OUT/heavy_hitters_cuda.json" 2>&1 | tee "$OUT/heavy_hitters_cuda.txt"
