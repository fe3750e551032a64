"""MiniKV's selection on a real model, computed a second way: is a lost needle the method's or
the engine's?

An independent reference, outside vLLM and outside this package's kernels: the model runs in
Hugging Face transformers in fp32 with an attention of its own (explicit softmax). The prefill is
exact and its probabilities give each KV head its H2O column sums (summed over the group's query
heads and the scored query rows); at prompt end each layer keeps, per KV head, the recent window
and its top heavy hitters (the pyramid or uniform budgets); every decode step then attends the
kept prompt tokens and all generated ones. Values and keys stay exact (MiniKV's selection alone,
``"bits": 16`` in the engine). With ``--engine`` it prints, beside each answer, whether the
engine's records (``vllm_shadowkv.eval.run`` output, same prompts) wrote the same text.

  python benchmarks/reference_minikv.py --depths 0.25,0.75 \
      --engine benchmarks/accuracy/smollm2_minikv_reference/results.json \
      --out benchmarks/accuracy/smollm2_minikv_reference/reference.json
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from vllm_shadowkv import models
from vllm_shadowkv.core.heavy_hitters import layer_budgets
from vllm_shadowkv.eval import tasks
from vllm_shadowkv.eval.run import prompt_ids

# name -> (heavy ratio, recent ratio, layer policy, score window: the last n prompt rows, 0 = all)
SELECTIONS = {
    "dense": None,
    "h2o": (0.25, 0.25, "pyramid", 0),  # MiniKV's defaults
    "h2o-uniform": (0.25, 0.25, "uniform", 0),
    "question64": (0.25, 0.25, "pyramid", 64),  # scored by the prompt's last 64 rows (SnapKV)
    "recent50": (0.0, 0.5, "uniform", 0),
}


class MaskedAttention:
    """Exact causal prefill that records column sums; decode over each KV head's kept tokens."""

    def __init__(self) -> None:
        self.score_window = 0
        self.column_sums: dict[int, torch.Tensor] = {}  # layer -> [h_kv, L]
        self.kept: dict[int, torch.Tensor] | None = None  # layer -> [h_kv, L] bool

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
        _, h_q, n, d = query.shape
        h_kv, length = key.shape[1], key.shape[2]
        q = query[0].reshape(h_kv, h_q // h_kv, n, d)
        logits = q @ key[0].unsqueeze(1).transpose(-1, -2) * scaling  # [h_kv, G, n, L]
        if n > 1:
            causal = torch.ones(n, length, dtype=torch.bool).tril(length - n)
            logits = logits.masked_fill(~causal, float("-inf"))
        elif self.kept is not None:
            visible = torch.ones(h_kv, length, dtype=torch.bool)
            kept = self.kept[module.layer_idx]
            visible[:, :kept.shape[1]] = kept
            logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
        probs = logits.softmax(-1)
        if n > 1:
            scored = probs[:, :, n - (self.score_window or n):]  # the scored query rows
            self.column_sums[module.layer_idx] = scored.sum((1, 2))
        out = probs @ value[0].unsqueeze(1)  # [h_kv, G, n, d]
        return out.reshape(h_q, n, d).transpose(0, 1).unsqueeze(0), None

    def select(self, prompt_len: int, heavy_ratio: float, recent_ratio: float, policy: str):
        recent = int(prompt_len * recent_ratio)
        self.kept = {}
        for layer, ratio in enumerate(layer_budgets(len(self.column_sums), heavy_ratio, policy)):
            sums = self.column_sums[layer][:, :prompt_len - recent]
            kept = torch.zeros(sums.shape[0], prompt_len, dtype=torch.bool)
            kept[:, prompt_len - recent:] = True
            kept.scatter_(1, sums.topk(min(int(prompt_len * ratio), sums.shape[1])).indices, True)
            self.kept[layer] = kept


@torch.no_grad()
def greedy(model, ids: list[int], tokens: int) -> list[int]:
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    generated = []
    for _ in range(tokens):
        generated.append(int(out.logits[0, -1].argmax()))
        out = model(input_ids=torch.tensor([generated[-1:]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Llama checkpoint (default: smollm2)")
    parser.add_argument("--tasks", default="niah_single")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--depths", default="0.25,0.75")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--selections", default=",".join(SELECTIONS), help=", ".join(SELECTIONS))
    parser.add_argument("--tokens", type=int, default=20, help="greedy tokens per answer")
    parser.add_argument("--engine", type=Path, help="the engine's results.json on the same prompts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    path = args.model or str(models.build_model("smollm2"))
    attention = MaskedAttention()
    AttentionInterface.register("masked_reference", attention)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="masked_reference").eval()

    samples = [tasks.generate(task, tokenizer, args.length, float(depth), args.seed)
               for task in args.tasks.split(",") for depth in args.depths.split(",")]
    rows = []
    jobs = [(s, name) for s in samples for name in args.selections.split(",")]
    for sample, name in tqdm(jobs, desc="reference", unit="answer"):
        ids = prompt_ids(tokenizer, sample, chat=True)
        attention.kept = None
        if SELECTIONS[name] is not None:
            heavy, recent, policy, attention.score_window = SELECTIONS[name]
            greedy(model, ids, 0)  # the prefill's column sums
            attention.select(len(ids), heavy, recent, policy)
        text = tokenizer.decode(greedy(model, ids, args.tokens))
        rows.append({"selection": name, "task": sample.task, "depth": sample.depth,
                     "answers": sample.answers, "prediction": text,
                     "score": tasks.score(sample, text)})
    if args.engine:  # read last: the engine's run may go on beside this one
        records = json.loads(args.engine.read_text())["records"]
        for row in rows:
            text = row["prediction"].strip()
            row["engine_backends_same_text"] = [
                r["backend"] for r in records
                if (r["task"], r["depth"]) == (row["task"], row["depth"])
                and r["prediction"][:len(row["prediction"])].strip() == text]
    for row in rows:
        same = row.get("engine_backends_same_text", "-")
        print(f"{row['selection']:12} {row['task']} depth {row['depth']}: {row['prediction']!r} "
              f"score {100 * row['score']:.0f}; engine writes the same: {same}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"argv": vars(args) | {"engine": str(args.engine),
                                                              "out": str(args.out)},
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
