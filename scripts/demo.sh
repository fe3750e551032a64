#!/usr/bin/env bash
# One command on a fresh machine: set up, build the tiny local model, serve it with
# `--attention-backend shadowkv`, ask it something over the OpenAI API, print the answer and the
# backend the engine is running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m vllm_shadowkv.demo "$@"
