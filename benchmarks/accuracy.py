"""The accuracy benchmark of RESULTS.md ("## Accuracy"): RULER-style needle tasks on the
committed retrieval fixture model, vLLM's default backend and, with ``--shadowkv``, ShadowKV
at sparse budgets of 1.56 %, 3 % and 6 % of each context length (one engine per backend and
length: sparse_budget = ratio x length rounded down to 8-token chunks, outlier_chunks = the
paper's 48-chunks-at-128K share of the length), rank 160, chunk 8, local window 32,
min_sparse_len 1024 (every task prompt decodes sparsely; the runner fails if one does not),
and the naive baseline ``sink_recent@1.56%``: the same number of attended tokens, taken as the
first chunk plus the most recent chunks instead of by landmark selection.

    VLLM_CPU_KVCACHE_SPACE=2 python benchmarks/accuracy.py [--shadowkv] [--out DIR] [run.py options]

Any further option goes to ``python -m vllm_shadowkv.eval.run`` (later options win, e.g.
``--lengths 4096``, or ``--model``/``--tokenizer``/``--chat`` for a real model on a GPU machine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm_shadowkv.eval import run, tasks
from vllm_shadowkv.eval.retrieval_model import FIXTURE

BUDGETS = ("1.56%", "3%", "6%")
BASELINES = ("sink_recent@1.56%",)
SHADOWKV_SETTINGS = {"rank": 160, "chunk_size": 8, "local_window": 32, "min_sparse_len": 1024}
ENGINE_ARGS = {"enable_prefix_caching": False}


def backends(shadowkv: bool) -> list[str]:
    return ["default"] + ([f"shadowkv@{b}" for b in BUDGETS] + list(BASELINES) if shadowkv else [])


def argv_for(argv: list[str]) -> list[str]:
    shadowkv = "--shadowkv" in argv
    rest = [a for a in argv if a != "--shadowkv"]
    defaults = ["--model", str(FIXTURE), "--tasks", ",".join(tasks.NIAH_TASKS),
                "--lengths", "4096,8192", "--depths", "0,0.25,0.5,0.75,1", "--samples", "1",
                "--enforce-eager", "--shadowkv-settings", json.dumps(SHADOWKV_SETTINGS),
                "--engine-args", json.dumps(ENGINE_ARGS),
                "--out", str(Path(__file__).parent / "accuracy")]
    return defaults + ["--backends", *backends(shadowkv)] + rest


if __name__ == "__main__":
    run.main(argv_for(sys.argv[1:]))
