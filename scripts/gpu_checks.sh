#!/usr/bin/env bash
# The GPU checks in one call, for a CUDA machine with torch and Triton (vLLM not needed): the
# Triton kernels against their torch references, the CUDA decode path (pinned store, copy
# stream) against the CPU's, its one host wait per layer (CUDA's sync debug mode,
# tests/core/test_host_waits.py), TailorKV's channel scores read from pinned host pages in place
# (tests/core/test_critical_channels.py), SpeCache's deferred slot fetch on CUDA, FlashAttention's
# varlen kernel against its reference (tests/core/test_varlen_attention.py); then the
# benchmarks at Llama-3.1-8B shapes: the quantized-page decode attention (MiniKV, TailorKV,
# SpeCache), ShadowKV's decode step, the engine's exact attention (FlashAttention varlen over
# gathered tokens against the paged Triton kernel and gathered SDPA, time and peak memory),
# MiniKV's column sums and ShadowKV's prompt end (its Gram, eigh and the rest against the layer's
# exact prefill attention: what a cold prefill and a prefix-cache hit add to TTFT).
# Each phase has its own time limit and a failed phase does not stop the next; ONLY names the
# phases to run (default all but quant_sweep, the quantized-page kernel's launch settings, and
# profile_quant, Nsight Compute on that kernel).
# On an H200: the tests about 260 s with 14 workers (kernel compilation; 2026-11-28), the four
# benchmarks 80 s, the sweep 65 s, Nsight Compute 40 s; a machine's start about 35 s of device
# time. The prompt end (added 2026-12-07) has not run on a GPU yet.
#   bash scripts/gpu_checks.sh [RESULTS_DIR]      (default gpu_results/)
#   ONLY="gpu_tests quant_attention" bash scripts/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-gpu_results}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD/.gpu_pkg:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# The package layout as setup.py installs it (triton_kernels/ under vllm_shadowkv), without pip.
mkdir -p .gpu_pkg && rm -rf .gpu_pkg/vllm_shadowkv && cp -r vllm_shadowkv .gpu_pkg/
cp -r triton_kernels .gpu_pkg/vllm_shadowkv/triton_kernels
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
    >"$RESULTS/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >>"$RESULTS/gpu.txt" 2>&1
ONLY=${ONLY:-gpu_tests quant_attention decode_step exact_attention heavy_hitters prompt_end}
phase() {  # phase NAME SECONDS CMD...: run, log to RESULTS/NAME.txt, record the exit status
    local name=$1 limit=$2; shift 2
    [[ " $ONLY " == *" $name "* ]] || return 0
    local start=$SECONDS
    timeout "$limit" "$@" >"$RESULTS/$name.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$RESULTS/phases.txt"
}
# Kernel compilation dominates the tests: one worker per core. test_rope.py needs vLLM. -P: the
# package from .gpu_pkg, not the checkout (which has no vllm_shadowkv/triton_kernels). The
# compiled CPU kernels are left to CI, on the torch that vLLM pins (torch 2.11's dynamo fails
# on their shift by a symbolic bit count).
# TESTS picks a subset of these.
phase gpu_tests "${TESTS_S:-300}" $PY -P -m pytest -v -p no:cacheprovider --rootdir=. -c /dev/null \
    -n "${WORKERS:-14}" -k "not compile" ${TESTS:-tests/core --ignore=tests/core/test_rope.py \
    "tests/unit/test_pages.py::test_paged_sparse_decode_on_cuda_matches_cpu" \
    "tests/unit/test_specache_pages.py::test_a_slot_fetch_completed_later_brings_the_wanted_rows"}
phase quant_attention 90 $PY benchmarks/bench_quant_attention.py --device cuda \
    --out "$RESULTS/quant_attention_cuda.json"
phase quant_sweep "${SWEEP_S:-240}" $PY benchmarks/bench_quant_attention.py --device cuda --sweep \
    --batches 1,16 --reps 5 --out "$RESULTS/quant_attention_sweep_cuda.json"
phase decode_step 120 $PY benchmarks/bench_decode_step.py --device cuda \
    --contexts 32768,131072 --batches 1,4,16 --out "$RESULTS/decode_step_cuda.json"
phase exact_attention 60 $PY benchmarks/bench_exact_attention.py --device cuda --reps 3 \
    --out "$RESULTS/exact_attention_cuda.json"
phase heavy_hitters 45 $PY benchmarks/bench_heavy_hitters.py --device cuda \
    --lengths 16384,32768 --reps 3 --out "$RESULTS/heavy_hitters_cuda.json"
phase prompt_end 120 $PY benchmarks/bench_prompt_end.py --device cuda \
    --contexts 8192,32768,131072 --reps 3 --out "$RESULTS/prompt_end_cuda.json"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
phase profile_quant 120 "${NCU:-ncu}" --clock-control none -k regex:_quant_attention_kernel \
    --launch-skip 5 -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis \
    $PY benchmarks/bench_quant_attention.py --device cuda --contexts 131072 --batches 16 \
    --reps 1 --out "$RESULTS/quant_attention_profiled.json"
for name in $ONLY; do
    echo "== $name"; tail -n 25 "$RESULTS/$name.txt"
done
cat "$RESULTS/gpu.txt" "$RESULTS/phases.txt"
