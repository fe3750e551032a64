"""The four methods' token selection on a real model, computed a second way: is a lost needle
the method's or the engine's?

An independent reference, outside vLLM and outside this package's kernels: the model runs in
Hugging Face transformers in fp32 with an attention of its own (explicit softmax). The prefill is
exact; every decode step attends, per KV head, only the tokens the method keeps visible, with
keys and values exact (the engine's ``"bits": 16`` for MiniKV, ``"rank"`` = the key width for
ShadowKV, ``"q_layers": []`` for TailorKV: the selection alone is compared; SpeCache's low-bit
copies are part of its selection, so they are rebuilt here in fp32).

* MiniKV (``h2o``, ...): at prompt end each KV head keeps the recent window and its top heavy
  hitters by H2O column sums (the prefill's probabilities summed over the group's query heads and
  the scored query rows), within each layer's budget; the kept set is frozen.
* ShadowKV (``shadowkv@R%``): the prompt's chunks of 8 tokens before the local window get a
  landmark (mean post-RoPE key) and the least coherent ones are kept exact (outliers); at every
  step each KV head attends its outliers, the top chunks by the step's query (softmax over the
  landmarks per query head, max over the group), the local window and the generated tokens.
* TailorKV (``tailorkv``, ``tailorkv@128``, ``tailorkv@0.68%``): at every step each KV head
  sums its group's queries, picks the critical channels (largest |q| x max over the prompt of
  |K|), scores the prompt's middle on them and attends its top-k tokens, the sink, the recent
  window and the generated tokens (the "current" channel query; every layer
  sparsity-friendly).
* SpeCache (``specache``, ``specache-2``; ``kivi-1`` fetches nothing): the prompt's whole
  groups are KIVI-quantized (1 bit: SpeCache's modified levels), and at every step each KV head
  attends exactly, in place of their low-bit copies, the top-k tokens of the step's own
  attention over them ("current" prefetch).

Each answer carries the relative error of the decode steps' attention against exact attention
over the same context (mean over steps and layers), as the engine's ``measure_fidelity`` reports
it. With ``--engine`` it prints, beside each answer, which engine backends
(``vllm_shadowkv.eval.run`` records on the same prompts) wrote the same text.

  python benchmarks/reference_selection.py --depths 0.1,0.5,0.9 \\
      --engine benchmarks/accuracy/smollm2_minikv_reference/results.json \\
      --out benchmarks/accuracy/smollm2_minikv_reference/reference.json
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from vllm_shadowkv import models
from vllm_shadowkv.core.heavy_hitters import layer_budgets
from vllm_shadowkv.eval import backends, tasks
from vllm_shadowkv.eval.run import prompt_ids
from vllm_shadowkv.methods.shadowkv.settings import ShadowKVSettings
from vllm_shadowkv.methods.specache.settings import SpeCacheSettings
from vllm_shadowkv.methods.tailorkv.settings import TailorKVSettings


class Selection:
    """What a decode step attends of the prompt: by default all of it, exact."""

    def prefill(self, layer: int, probs: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> None:
        """Sees each layer's exact prefill: probabilities [h_kv, G, L, L], keys and values
        [h_kv, L, d]."""

    def finish(self, prompt_len: int) -> None:
        """Called once the prompt is in."""

    def visible(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """[h_kv, L] mask of the prompt tokens the step attends; None: every token."""
        return None

    def substitute(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the step attends in place of the exact ones."""
        return keys, values


class HeavyHitters(Selection):
    """MiniKV's prompt-end selection, frozen for the generation."""

    def __init__(self, heavy_ratio: float, recent_ratio: float, policy: str, score_window: int):
        self.heavy_ratio, self.recent_ratio = heavy_ratio, recent_ratio
        self.policy, self.score_window = policy, score_window
        self.column_sums: dict[int, torch.Tensor] = {}  # layer -> [h_kv, L]
        self.kept: dict[int, torch.Tensor] = {}  # layer -> [h_kv, L] bool

    def prefill(self, layer: int, probs: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> None:
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


class ChunkSelection(Selection):
    """ShadowKV's per-step chunk selection over landmarks, outliers and the local window."""

    def __init__(self, budget: int, outliers: int, chunk: int, local_chunks: int):
        self.k, self.outliers = budget // chunk, outliers
        self.chunk, self.local_chunks = chunk, local_chunks
        self.state: dict[int, tuple] = {}  # layer -> (landmarks [h, n, d], outlier mask [h, n], L)

    def prefill(self, layer: int, probs: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> None:
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


class CriticalChannels(Selection):
    """TailorKV's per-step top-k over the critical channels, with the sink and recent window."""

    def __init__(self, settings: TailorKVSettings):
        self.settings = settings
        self.state: dict[int, tuple] = {}  # layer -> (prompt keys [h, L, d], max|K| [h, d])

    def prefill(self, layer: int, probs: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> None:
        self.state[layer] = (keys, keys.abs().amax(1))

    def visible(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        keys, key_absmax = self.state[layer]
        h_kv, length, _ = keys.shape
        s = self.settings
        top_k, middle = s.top_k_for(length), length - s.recent - s.sink
        if middle <= top_k:
            return None  # every token would be attended: dense
        group_q = q[:, :, 0].sum(1)  # [h_kv, d], signed
        chosen = (group_q.abs() * key_absmax).topk(s.critical_channels, dim=-1).indices
        partial = (group_q.gather(1, chosen).unsqueeze(1)
                   * keys[:, s.sink:length - s.recent].gather(
                       2, chosen.unsqueeze(1).expand(-1, middle, -1))).sum(-1)
        visible = torch.ones(h_kv, length, dtype=torch.bool)
        visible[:, s.sink:length - s.recent] = False
        visible.scatter_(1, partial.topk(top_k).indices + s.sink, True)
        return visible


def kivi(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """x quantized along dim to `bits` and back (fp32): KIVI's min/max levels, at 1 bit
    SpeCache's modified levels (zero (3 min + max) / 4, scale (max - min) / 2)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    if bits == 1:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    else:
        zero, scale = lo, (hi - lo) / (2 ** bits - 1)
    safe = torch.where(scale > 0, scale, 1.0)
    return ((x - zero) / safe).round().clamp(0, 2 ** bits - 1) * scale + zero


class LowBitFetch(Selection):
    """SpeCache's "current" step: the prompt's whole groups attended from their low-bit copies
    (keys per channel over `group` tokens, values per token over `group` channels; the partial
    last group exact), except each KV head's top-k tokens by the step's own attention over
    them (probabilities summed over the group's query heads), which are attended exact."""

    def __init__(self, settings: SpeCacheSettings):
        self.settings = settings
        self.state: dict[int, tuple] = {}  # layer -> (keys, values) with the groups low-bit

    def prefill(self, layer: int, probs: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> None:
        h_kv, length, d = keys.shape
        g, bits = self.settings.group_size, self.settings.bits
        n = length // g * g
        low_keys, low_values = keys.clone(), values.clone()
        low_keys[:, :n] = kivi(keys[:, :n].reshape(h_kv, n // g, g, d), 2, bits).view(h_kv, n, d)
        low_values[:, :n] = kivi(values[:, :n].reshape(h_kv, n, d // g, g), 3,
                                 bits).view(h_kv, n, d)
        self.state[layer] = (low_keys, low_values, n)

    def substitute(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        low_keys, low_values, n = self.state[layer]
        length = low_keys.shape[1]  # the prompt; the generated tokens after it stay exact
        mixed_keys = torch.cat([low_keys, keys[:, length:]], dim=1)
        mixed_values = torch.cat([low_values, values[:, length:]], dim=1)
        if not n or not self.settings.top_k:
            return mixed_keys, mixed_values
        probs = (q[:, :, 0] @ mixed_keys.transpose(1, 2) * scale).softmax(-1)  # [h_kv, G, L]
        top = probs[:, :, :n].sum(1).topk(min(self.settings.top_k, n)).indices
        exact = torch.zeros(keys.shape[:2], dtype=torch.bool).scatter_(1, top, True)
        exact = exact.unsqueeze(-1)
        return torch.where(exact, keys, mixed_keys), torch.where(exact, values, mixed_values)


def selections(length: int) -> dict:
    """Name -> a fresh selection (None: dense) for prompts of ``length`` requested tokens."""
    defaults = ShadowKVSettings()
    local_chunks = math.ceil(defaults.local_window / defaults.chunk_size)

    def shadowkv(ratio: str):
        settings = backends.parse(f"shadowkv@{ratio}").resolve(length).settings
        return lambda: ChunkSelection(settings["sparse_budget"], settings["outlier_chunks"],
                                      defaults.chunk_size, local_chunks)

    def tailorkv(**changes):
        return lambda: CriticalChannels(TailorKVSettings(**changes))

    return {
        "dense": lambda: None,
        "h2o": lambda: HeavyHitters(0.25, 0.25, "pyramid", 0),  # MiniKV's defaults
        "h2o-uniform": lambda: HeavyHitters(0.25, 0.25, "uniform", 0),
        "question64": lambda: HeavyHitters(0.25, 0.25, "pyramid", 64),  # SnapKV's window
        "recent50": lambda: HeavyHitters(0.0, 0.5, "uniform", 0),
        "shadowkv@1.56%": shadowkv("1.56%"),
        "shadowkv@6%": shadowkv("6%"),
        "tailorkv": tailorkv(),  # the paper's RULER budget: top 896
        "tailorkv@128": tailorkv(top_k=128),  # its LongBench top-k
        "tailorkv@0.68%": tailorkv(top_k_ratio=0.0068),  # 896 of 128K, scaled to the prompt
        "specache": lambda: LowBitFetch(SpeCacheSettings()),  # 1 bit, top 64
        "specache-2": lambda: LowBitFetch(SpeCacheSettings(bits=2)),
        "kivi-1": lambda: LowBitFetch(SpeCacheSettings(top_k=0)),  # nothing fetched
        "kivi-2": lambda: LowBitFetch(SpeCacheSettings(bits=2, top_k=0)),
    }


class ReferenceAttention:
    """Exact causal prefill (handing its probabilities to the selection); decode over what the
    selection keeps visible of the prompt, as it substitutes it, and every generated token."""

    def __init__(self) -> None:
        self.selection: Selection | None = None
        self.errors: list[float] = []  # per decode step and layer: |out - exact| / |exact|

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
        _, h_q, n, d = query.shape
        h_kv, length = key.shape[1], key.shape[2]
        q = query[0].float().reshape(h_kv, h_q // h_kv, n, d)  # the attention in fp32
        keys, values = key[0].float(), value[0].float()
        step = self.selection if n == 1 else None
        if step is not None:
            keys, values = step.substitute(module.layer_idx, q, keys, values, scaling)
        logits = q @ keys.unsqueeze(1).transpose(-1, -2) * scaling  # [h_kv, G, n, L]
        if n > 1:
            causal = torch.ones(n, length, dtype=torch.bool).tril(length - n)
            logits = logits.masked_fill(~causal, float("-inf"))
        elif step is not None and (kept := step.visible(module.layer_idx, q, scaling)) is not None:
            visible = torch.ones(h_kv, length, dtype=torch.bool)
            visible[:, :kept.shape[1]] = kept
            logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
        probs = logits.softmax(-1)
        if n > 1 and self.selection is not None:
            self.selection.prefill(module.layer_idx, probs, keys, values)
        out = probs @ values.unsqueeze(1)  # [h_kv, G, n, d]
        if step is not None:  # the engine's in-engine fidelity, measured the same way
            exact_keys, exact_values = key[0].float(), value[0].float()
            exact = (q @ exact_keys.unsqueeze(1).transpose(-1, -2) * scaling).softmax(-1)
            exact = exact @ exact_values.unsqueeze(1)
            self.errors.append(float((out - exact).norm() / exact.norm()))
        return out.reshape(h_q, n, d).transpose(0, 1).unsqueeze(0).to(query.dtype), None


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


def compare(rows: list[dict], records: list[dict], tokenizer, tokens: int) -> None:
    """Beside each answer: the engine backends that wrote the same text, and each engine
    backend's score on its first ``tokens`` tokens (the reference's answer length)."""
    for row in rows:
        mine = [r for r in records if (r["task"], r["depth"]) == (row["task"], row["depth"])]
        text = row["prediction"].strip()
        row["engine_backends_same_text"] = [
            r["backend"] for r in mine if r["prediction"][:len(row["prediction"])].strip() == text]
        row["engine_scores"] = {
            r["backend"]: tasks.string_match_all(tokenizer.decode(r["output_token_ids"][:tokens]),
                                                 row["answers"]) for r in mine}


def finished_run(path: Path) -> dict:
    """The engine's results once its run is complete (it may go on beside this one)."""
    while True:
        run = json.loads(path.read_text()) if path.exists() else {}
        if run.get("meta", {}).get("complete"):
            return run
        print(f"waiting for the engine's run to complete: {path}", flush=True)
        time.sleep(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Llama checkpoint (default: smollm2)")
    parser.add_argument("--tasks", default="niah_single")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--depths", default="0.25,0.75")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--selections", default="dense,h2o,h2o-uniform,question64,recent50",
                        help=", ".join(selections(2048)).replace("%", "%%"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's weights and activations (the attention is fp32)")
    parser.add_argument("--tokens", type=int, default=20, help="greedy tokens per answer")
    parser.add_argument("--engine", type=Path, help="the engine's results.json on the same prompts")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--saved", type=Path,
                        help="compare the answers of an earlier --out with --engine, run nothing")
    args = parser.parse_args()

    path = args.model or str(models.build_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.saved:
        saved = json.loads(args.saved.read_text())
        rows, args.tokens = saved["rows"], saved["argv"]["tokens"]
    else:
        rows = answer(args, path, tokenizer)
    if args.engine:
        compare(rows, finished_run(args.engine)["records"], tokenizer, args.tokens)
    for row in rows:
        same = row.get("engine_backends_same_text", "-")
        print(f"{row['selection']:14} {row['task']} depth {row['depth']}: {row['prediction']!r} "
              f"score {100 * row['score']:.0f}, "
              f"relative error {row.get('relative_error', float('nan')):.3f}; "
              f"engine writes the same: {same}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"argv": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in vars(args).items()},
                                        "rows": rows}, indent=1))


def answer(args, path: str, tokenizer) -> list[dict]:
    """The reference's greedy answers, one per prompt and selection."""
    attention = ReferenceAttention()
    AttentionInterface.register("selection_reference", attention)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype),
                                                 attn_implementation="selection_reference").eval()
    choices = selections(args.length)
    samples = [tasks.generate(task, tokenizer, args.length, float(depth), args.seed)
               for task in args.tasks.split(",") for depth in args.depths.split(",")]
    rows = []
    jobs = [(s, name) for s in samples for name in args.selections.split(",")]
    for sample, name in tqdm(jobs, desc="reference", unit="answer"):
        ids = prompt_ids(tokenizer, sample, chat=True)
        attention.selection, attention.errors = choices[name](), []
        text = tokenizer.decode(greedy(model, ids, args.tokens, attention.selection))
        rows.append({"selection": name, "task": sample.task, "depth": sample.depth,
                     "answers": sample.answers, "prediction": text,
                     "score": tasks.score(sample, text),
                     "relative_error": sum(attention.errors) / max(1, len(attention.errors))})
    return rows


if __name__ == "__main__":
    main()
