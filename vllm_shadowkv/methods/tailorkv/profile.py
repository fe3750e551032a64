"""Layer profiling for TailorKV: the dense-preference score per layer on calibration prompts, and
the quantization-friendly layer set it implies (digest §3).

    python -m vllm_shadowkv.methods.tailorkv.profile --model PATH [--prompts N --length L --out FILE]

The paper scores a layer by P = n_q - sum of each query row's top-k attention mass and calls it
quantization-friendly when P > 0.2; it gives neither n_q, k nor how heads are combined. The
normalisation here (digest §11.1) makes P a share in [0, 1], comparable across models and
prompt lengths:

    P_l = mean over prompts and query heads of (1 - mean over the last n_q query rows of the
          attention mass in that row's top k keys),   n_q = 64, k = ceil(5 % of the prompt)

(the sparse error of the paper's Fig. 1, top 5 %). A layer whose attention is spread out (dense)
loses much of its mass to a 5 % top-k (P_l high): it is quantized rather than sparsified.

The forward is transformers' on the CPU, float32; the attention function is the model's own
(SDPA) behind a shim that first takes the rows' top-k mass from the post-RoPE queries and keys.
Calibration prompts are the harness's RULER-style tasks (``vllm_shadowkv.eval.tasks``) in the
model's tokenizer, cycling through the task families. The layer set is written as JSON, by
default where ``q_layers: "auto"`` finds it (``layers.profile_path``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vllm_shadowkv.eval import tasks
from vllm_shadowkv.methods.tailorkv.layers import profile_path

THRESHOLD = 0.2
QUERY_ROWS = 64
TOP_SHARE = 0.05
ATTENTION_NAME = "tailorkv_profile"


def sparse_error(query: torch.Tensor, key: torch.Tensor, scaling: float, rows: int,
                 top_share: float) -> torch.Tensor:
    """Per query head: 1 - mean over the last `rows` causal query rows of the softmax mass in
    the top ceil(top_share * n) keys. query [h_q, n, d], key [h_kv, n, d] (post-RoPE) -> [h_q]."""
    h_q, n, _ = query.shape
    rows = min(rows, n)
    keys = key.float().repeat_interleave(h_q // key.shape[0], dim=0)
    logits = query[:, n - rows:].float() @ keys.transpose(1, 2) * scaling  # [h_q, rows, n]
    positions = torch.arange(n - rows, n).view(-1, 1)
    logits = logits.masked_fill(torch.arange(n) > positions, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    k = math.ceil(top_share * n)
    return 1.0 - torch.topk(probs, k, dim=-1).values.sum(dim=-1).mean(dim=-1)


class LayerProfile:
    """Sums each layer's per-head sparse error over the prompts run through the model."""

    def __init__(self, num_layers: int, rows: int = QUERY_ROWS, top_share: float = TOP_SHARE):
        self.rows, self.top_share = rows, top_share
        self.total = [None] * num_layers
        self.prompts = 0

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        assert query.shape[0] == 1, "one prompt per forward"
        error = sparse_error(query[0], key[0], kwargs["scaling"], self.rows, self.top_share)
        layer = module.layer_idx
        self.total[layer] = error if self.total[layer] is None else self.total[layer] + error
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def head_scores(self) -> list[list[float]]:
        """Per layer and query head: the mean over prompts."""
        return [(t / self.prompts).tolist() for t in self.total]


def calibration_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    names = [tasks.TASKS[i % len(tasks.TASKS)] for i in range(count)]
    samples = [tasks.generate(name, tokenizer, length, seed=i) for i, name in enumerate(names)]
    return [tokenizer(s.prompt + s.answer_prefix)["input_ids"] for s in samples]


def profile(model_path: str, prompts: int, length: int, threshold: float = THRESHOLD) -> dict:
    """Run the calibration prompts through the model -> the layer set and each layer's score."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    recorder = LayerProfile(model.config.num_hidden_layers)
    AttentionInterface.register(ATTENTION_NAME, recorder.attention)
    model.set_attn_implementation(ATTENTION_NAME)
    model.eval()
    with torch.inference_mode():
        for ids in tqdm(calibration_prompts(tokenizer, prompts, length), desc="prompts"):
            model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
            recorder.prompts += 1
    heads = recorder.head_scores()
    scores = [sum(h) / len(h) for h in heads]  # P_l: the mean over the heads
    return {
        "model": str(Path(model_path).expanduser().resolve()),
        "q_layers": [layer for layer, p in enumerate(scores) if p > threshold],
        "scores": [round(p, 4) for p in scores],
        "head_scores": [[round(p, 4) for p in h] for h in heads],
        "threshold": threshold,
        "query_rows": recorder.rows,
        "top_share": recorder.top_share,
        "prompts": prompts,
        "length": length,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description="TailorKV layer profiling: the dense-preference score per layer and the "
                    "quantization-friendly layers (score > 0.2).")
    parser.add_argument("--model", required=True, help="local model directory")
    parser.add_argument("--prompts", type=int, default=8, help="calibration prompts")
    parser.add_argument("--length", type=int, default=4096, help="tokens per prompt")
    parser.add_argument("--out", type=Path, help="JSON file (default: where q_layers 'auto' "
                                                 "looks for this model)")
    args = parser.parse_args(argv)
    result = profile(args.model, args.prompts, args.length)
    out = args.out or profile_path(args.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"q_layers {result['q_layers']}  (scores {result['scores']})  -> {out}")
    return result


if __name__ == "__main__":
    main()
