"""MiniKV's and ShadowKV's token selection on a real model, computed a second way: is a lost
needle the method's or the engine's?

An independent reference, outside vLLM and outside this package's kernels: the model runs in
Hugging Face transformers in fp32 with an attention of its own (explicit softmax). The prefill is
exact; every decode step attends, per KV head, only the tokens the method keeps visible, with
keys and values exact (the engine's ``"bits": 16`` for MiniKV, ``"rank"`` = the key width for
ShadowKV: the selection alone is compared).

* MiniKV (``h2o``, ...): at prompt end each KV head keeps the recent window and its top heavy
  hitters by H2O column sums (the prefill's probabilities summed over the group's query heads and
  the scored query rows), within each layer's budget; the kept set is frozen.
* ShadowKV (``shadowkv@R%``): the prompt's chunks of 8 tokens before the local window get a
  landmark (mean post-RoPE key) and the least coherent ones are kept exact (outliers); at every
  step each KV head attends its outliers, the top chunks by the step's query (softmax over the
  landmarks per query head, max over the group), the local window and the generated tokens.

With ``--engine`` it prints, beside each answer, which engine backends (``vllm_shadowkv.eval.run``
records on the same prompts) wrote the same text.

  python benchmarks/reference_selection.py --depths 0.1,0.5,0.9 \\
      --engine benchmarks/accuracy/smollm2_minikv_reference/results.json \\
      --out benchmarks/accuracy/smollm2_minikv_reference/reference.json
"""

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from vllm_shadowkv import models
from vllm_shadowkv.core.heavy_hitters import layer_budgets
from vllm_shadowkv.eval import backends, tasks
from vllm_shadowkv.eval.run import prompt_ids
from vllm_shadowkv.methods.shadowkv.settings import ShadowKVSettings


class HeavyHitters:
    """MiniKV's prompt-end selection, frozen for the generation."""

    def __init__(self, heavy_ratio: float, recent_ratio: float, policy: str, score_window: int):
        self.heavy_ratio, self.recent_ratio = heavy_ratio, recent_ratio
        self.policy, self.score_window = policy, score_window
        self.column_sums: dict[int, torch.Tensor] = {}  # layer -> [h_kv, L]
        self.kept: dict[int, torch.Tensor] = {}  # layer -> [h_kv, L] bool

    def prefill(self, layer: int, probs: torch.Tensor, keys: torch.Tensor) -> None:
        scored = probs[:, :, probs.shape[2] - (self.score_window or probs.shape[2]):]
        self.column_sums[layer] = scored.sum((1, 2))

    def finish(self, prompt_len: int) -> None:
        recent = int(prompt_len * self.recent_ratio)
        ratios = layer_budgets(len(self.column_sums), self.heavy_ratio, self.policy)
        for layer, ratio in enumerate(ratios):
            sums = self.column_sums[layer][:, :prompt_len - recent]
            kept = torch.zeros(sums.shape[0], prompt_len, dtype=torch.bool)
            kept[:, prompt_len - recent:] = True
            kept.scatter_(1, sums.topk(min(int(prompt_len * ratio), sums.shape[1])).indices, True)
            self.kept[layer] = kept

    def visible(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        return self.kept[layer]


class ChunkSelection:
    """ShadowKV's per-step chunk selection over landmarks, outliers and the local window."""

    def __init__(self, budget: int, outliers: int, chunk: int, local_chunks: int):
        self.k, self.outliers = budget // chunk, outliers
        self.chunk, self.local_chunks = chunk, local_chunks
        self.state: dict[int, tuple] = {}  # layer -> (landmarks [h, n, d], outlier mask [h, n], L)

    def prefill(self, layer: int, probs: torch.Tensor, keys: torch.Tensor) -> None:
        h_kv, length, d = keys.shape
        n = length // self.chunk - self.local_chunks
        if n <= self.outliers:
            self.state[layer] = None  # nothing to select from: dense
            return
        chunks = keys[:, :n * self.chunk].reshape(h_kv, n, self.chunk, d)
        landmarks = chunks.mean(2)
        coherence = torch.cosine_similarity(chunks, landmarks.unsqueeze(2), dim=-1).amin(-1)
        outlier = torch.zeros(h_kv, n, dtype=torch.bool)
        outlier.scatter_(1, coherence.topk(self.outliers, largest=False).indices, True)
        self.state[layer] = (landmarks, outlier, length)

    def finish(self, prompt_len: int) -> None:
        pass

    def visible(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        if self.state[layer] is None:
            return None
        landmarks, outlier, length = self.state[layer]
        logits = (q[:, :, 0] @ landmarks.transpose(1, 2)) * scale  # [h_kv, G, n]
        scores = logits.masked_fill(outlier.unsqueeze(1), float("-inf")).softmax(-1).amax(1)
        chosen = outlier.clone()
        chosen.scatter_(1, scores.topk(min(self.k, scores.shape[1])).indices, True)
        visible = torch.ones(chosen.shape[0], length, dtype=torch.bool)
        visible[:, :chosen.shape[1] * self.chunk] = chosen.repeat_interleave(self.chunk, dim=1)
        return visible


def selections(length: int) -> dict:
    """Name -> a fresh selection (None: dense) for prompts of ``length`` requested tokens."""
    defaults = ShadowKVSettings()
    local_chunks = math.ceil(defaults.local_window / defaults.chunk_size)

    def shadowkv(ratio: str):
        settings = backends.parse(f"shadowkv@{ratio}").resolve(length).settings
        return lambda: ChunkSelection(settings["sparse_budget"], settings["outlier_chunks"],
                                      defaults.chunk_size, local_chunks)

    return {
        "dense": lambda: None,
        "h2o": lambda: HeavyHitters(0.25, 0.25, "pyramid", 0),  # MiniKV's defaults
        "h2o-uniform": lambda: HeavyHitters(0.25, 0.25, "uniform", 0),
        "question64": lambda: HeavyHitters(0.25, 0.25, "pyramid", 64),  # SnapKV's window
        "recent50": lambda: HeavyHitters(0.0, 0.5, "uniform", 0),
        "shadowkv@1.56%": shadowkv("1.56%"),
        "shadowkv@6%": shadowkv("6%"),
    }


class ReferenceAttention:
    """Exact causal prefill (handing its probabilities to the selection); decode over what the
    selection keeps visible of the prompt, and every generated token."""

    def __init__(self) -> None:
        self.selection = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
        _, h_q, n, d = query.shape
        h_kv, length = key.shape[1], key.shape[2]
        q = query[0].reshape(h_kv, h_q // h_kv, n, d)
        logits = q @ key[0].unsqueeze(1).transpose(-1, -2) * scaling  # [h_kv, G, n, L]
        if n > 1:
            causal = torch.ones(n, length, dtype=torch.bool).tril(length - n)
            logits = logits.masked_fill(~causal, float("-inf"))
        elif self.selection is not None:
            kept = self.selection.visible(module.layer_idx, q, scaling)
            if kept is not None:
                visible = torch.ones(h_kv, length, dtype=torch.bool)
                visible[:, :kept.shape[1]] = kept
                logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
        probs = logits.softmax(-1)
        if n > 1 and self.selection is not None:
            self.selection.prefill(module.layer_idx, probs, key[0])
        out = probs @ value[0].unsqueeze(1)  # [h_kv, G, n, d]
        return out.reshape(h_q, n, d).transpose(0, 1).unsqueeze(0), None


@torch.no_grad()
def greedy(model, ids: list[int], tokens: int, selection) -> list[int]:
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    if selection is not None:
        selection.finish(len(ids))
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
    parser.add_argument("--selections", default="dense,h2o,h2o-uniform,question64,recent50",
                        help=", ".join(selections(2048)))
    parser.add_argument("--tokens", type=int, default=20, help="greedy tokens per answer")
    parser.add_argument("--engine", type=Path, help="the engine's results.json on the same prompts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    path = args.model or str(models.build_model("smollm2"))
    attention = ReferenceAttention()
    AttentionInterface.register("selection_reference", attention)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="selection_reference").eval()
    choices = selections(args.length)
    samples = [tasks.generate(task, tokenizer, args.length, float(depth), args.seed)
               for task in args.tasks.split(",") for depth in args.depths.split(",")]
    rows = []
    jobs = [(s, name) for s in samples for name in args.selections.split(",")]
    for sample, name in tqdm(jobs, desc="reference", unit="answer"):
        ids = prompt_ids(tokenizer, sample, chat=True)
        attention.selection = choices[name]()
        text = tokenizer.decode(greedy(model, ids, args.tokens, attention.selection))
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
        print(f"{row['selection']:14} {row['task']} depth {row['depth']}: {row['prediction']!r} "
              f"score {100 * row['score']:.0f}; engine writes the same: {same}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"argv": vars(args) | {"engine": str(args.engine),
                                                              "out": str(args.out)},
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
