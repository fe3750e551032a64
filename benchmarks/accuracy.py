"""The accuracy benchmark of RESULTS.md ("## Accuracy"): RULER-style needle tasks on the
committed retrieval fixture model, vLLM's default backend and, with ``--shadowkv``, ShadowKV
at sparse budgets of 1.56 %, 3 % and 6 % of each context length (one engine per backend and
length: sparse_budget = ratio x length rounded down to 8-token chunks, outlier_chunks = the
paper's 48-chunks-at-128K share of the length), rank 160, chunk 8, local window 32,
min_sparse_len 1024 (every task prompt decodes sparsely; the runner fails if one does not),
and the naive baseline ``sink_recent@1.56%``: the same number of attended tokens, taken as the
first chunk plus the most recent chunks instead of by landmark selection.

With ``--minikv``: MiniKV at its defaults (2-bit KIVI, 25 % heavy hitters + 25 % recent window,
pyramid), which is also the same KV bytes as shadowkv at 1.56 % with the paper's rank share
(160 of 1024 key channels; 16.7 % vs 16.4-18.0 % of dense on the fixture and SmolLM2), the
recent-window-only baseline at the same bytes (heavy 0 %, recent 50 %), and both again at a
tighter 10 % of the prompt (heavy 5 % + recent 5 % vs recent 10 %), every prompt compressed.

With ``--specache``: SpeCache at its defaults (1-bit KIVI groups of 64, top-64 tokens per KV head
exact each step, prefetch "current": the output row picks its own), with the speculative
prefetch (the guess row picks the next step's; also with the paper's guess chain,
``guess_lookup`` 0, and with ``verify_guess``) and with it ``accept_guess`` (a confirmed guess
emitted too), both modes again at 2 bits, and plain 1-bit and 2-bit KIVI (``top_k`` 0: nothing
fetched), the paper's Table 1 comparison; every SpeCache engine measures its fidelity and
speculation hit rate (``measure_fidelity``).

With ``--tailorkv``: TailorKV-1 and TailorKV-2 with layer 0 quantized (Llama-3.x's set) and the
paper's RULER budget scaled to the context: 8 sink + 120 recent tokens kept, top-k 896 of 128K
(0.68 % of the prompt) selected on 12 critical channels each step, the channels chosen with the
layer's own query ("current") and with the query predicted from the previous layer
("predicted"); and the sink + recent control (a top-k of 1).

    VLLM_CPU_KVCACHE_SPACE=2 python benchmarks/accuracy.py [--shadowkv] [--minikv] [--specache] [--tailorkv] [--out DIR] [run.py options]

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
MINIKV = {"minikv": {}, "recent@50%": {"heavy_ratio": 0.0, "recent_ratio": 0.5},
          "minikv@10%": {"heavy_ratio": 0.05, "recent_ratio": 0.05},
          "recent@10%": {"heavy_ratio": 0.0, "recent_ratio": 0.1}}
SPECACHE = {"specache-current": {"prefetch": "current"},
            "specache-speculative": {"prefetch": "speculative"},
            "specache-speculative-chain": {"prefetch": "speculative", "guess_lookup": 0},
            "specache-verified": {"prefetch": "speculative", "verify_guess": True},
            "specache-accept": {"prefetch": "speculative", "accept_guess": True},
            "specache-2bit-current": {"bits": 2, "prefetch": "current"},
            "specache-2bit-speculative": {"bits": 2, "prefetch": "speculative"},
            "kivi-1bit": {"top_k": 0}, "kivi-2bit": {"bits": 2, "top_k": 0}}
SPECACHE = {label: s | {"measure_fidelity": True} for label, s in SPECACHE.items()}
TAILORKV_SCALED = {"q_layers": [0], "top_k_ratio": round(896 / 131072, 4)}
TAILORKV = {"tailorkv-1": TAILORKV_SCALED, "tailorkv-2": TAILORKV_SCALED | {"bits": 2}}
TAILORKV |= {f"{label}-predicted": s | {"channel_query": "predicted"}
             for label, s in TAILORKV.items()}
TAILORKV["sink+recent"] = {"q_layers": [0], "top_k": 1}
ENGINE_ARGS = {"enable_prefix_caching": False}
FLAGS = ("--shadowkv", "--minikv", "--specache", "--tailorkv")


def backends(shadowkv: bool, minikv: bool, specache: bool = False,
             tailorkv: bool = False) -> list[str]:
    out = ["default"]
    if shadowkv:
        out += [f"shadowkv@{b}" for b in BUDGETS] + list(BASELINES)
    for wanted, method, table in ((minikv, "minikv", MINIKV), (specache, "specache", SPECACHE),
                                  (tailorkv, "tailorkv", TAILORKV)):
        if wanted:
            out += [f"{label}={method}:" + json.dumps({**s, "min_sparse_len": 1024})
                    for label, s in table.items()]
    return out


def argv_for(argv: list[str]) -> list[str]:
    chosen = [flag in argv for flag in FLAGS]
    rest = [a for a in argv if a not in FLAGS]
    defaults = ["--model", str(FIXTURE), "--tasks", ",".join(tasks.NIAH_TASKS),
                "--lengths", "4096,8192", "--depths", "0,0.25,0.5,0.75,1", "--samples", "1",
                "--enforce-eager", "--shadowkv-settings", json.dumps(SHADOWKV_SETTINGS),
                "--engine-args", json.dumps(ENGINE_ARGS),
                "--out", str(Path(__file__).parent / "accuracy")]
    return defaults + ["--backends", *backends(*chosen)] + rest


if __name__ == "__main__":
    run.main(argv_for(sys.argv[1:]))
