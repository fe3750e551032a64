"""The accuracy benchmark of RESULTS.md ("## Accuracy"): RULER-style tasks on the committed
retrieval fixture model, vLLM's default backend and, with ``--shadowkv``, ShadowKV at sparse
budgets of 1.56 %, 3 % and 6 % of the context and the naive sink + local-window baseline at the
same budgets.

    VLLM_CPU_KVCACHE_SPACE=2 python benchmarks/accuracy.py [--shadowkv] [--out DIR] [run.py options]

Any further option goes to ``python -m vllm_shadowkv.eval.run`` (e.g. ``--lengths``, or
``--model``/``--tokenizer``/``--chat`` for a real model on a GPU machine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm_shadowkv.eval import run
from vllm_shadowkv.eval.retrieval_model import FIXTURE

BUDGET_RATIOS = (0.0156, 0.03, 0.06)


def backends(shadowkv: bool) -> list[str]:
    specs = ["default"]
    if shadowkv:
        for ratio in BUDGET_RATIOS:
            setting = json.dumps({"sparse_budget_ratio": ratio})
            specs += [f"shadowkv:{setting}", f"shadowkv-naive:{setting}"]
    return specs


if __name__ == "__main__":
    argv = sys.argv[1:]
    shadowkv = "--shadowkv" in argv
    argv = [a for a in argv if a != "--shadowkv"]
    defaults = ["--model", str(FIXTURE), "--lengths", "1024,4096,8192,16384",
                "--depths", "0,0.25,0.5,0.75,1", "--samples", "1", "--enforce-eager",
                "--out", str(Path(__file__).parent / "accuracy")]
    run.main(defaults + ["--backends", *backends(shadowkv)] + argv)
