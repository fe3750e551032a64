#!/usr/bin/env bash
# One command on a fresh machine: set up, then run the whole test suite (unit, kernels under
# TRITON_INTERPRET=1, and integration tests that start real vLLM engines and a server on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The pytest script, not `python -m pytest`: the latter puts the repository root on sys.path,
# where the top-level triton_kernels/ folder would shadow the name vLLM probes for.
exec .venv/bin/pytest "$@"
