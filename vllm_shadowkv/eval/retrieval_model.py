"""A Llama checkpoint whose weights are written by hand so that it solves the needle tasks.

Training a small model to retrieve across thousands of tokens on two CPU cores fails, so the
weights are set by construction. The model is an ordinary Llama (GQA: 4 query heads over 2 KV
heads, head_dim 128, Llama-3.1's RoPE: theta 500000 with llama3 scaling), 3 layers, with a
word-level tokenizer in which every needle key and every needle value is one token.

Residual stream (hidden 400), one job per block of dimensions:
  CONST        128 in every token: the bias source (Llama has no biases) and the RMSNorm
               anchor: it dominates the norm, so RMSNorm scales every token alike (~1 %)
  flags        is-BOS, is-key, is-value, is-"What", and QFLAG (the question has started)
  OWNKEY  x40  one-hot of the token's own key; then the weighted keys asked for
  PREVKEY x40  one-hot of the key three tokens back ("for KEY is : VALUE")
  QSET    x40  the keys asked for, 0 or 1 each
  VALUE  x128  one-hot of the token's own value; then the answer being assembled
  EMIT   x128  the weighted values already given
  SEM     x16  a random "meaning" per token, feeding random q/k projections in every head
               (score noise of std ``noise`` logits): no head is unnaturally clean

  layer 0  head 0: previous-token head at offset 3. q and k are constants in the 16 fastest
           RoPE pairs with q pre-rotated by -3 theta, so q_m.k_n = S sum_p cos((m-n-3) theta_p),
           which peaks at m-n = 3 (next best 25 logits lower); it copies the key found there
           into PREVKEY. head 2: attends to the marker "What" if one came before: QFLAG = 1.
  layer 1  head 0 gathers the key tokens after the marker (the keys asked for) into OWNKEY,
           head 2 the value tokens after the marker (the answers given so far) into EMIT;
           both fall back on BOS (value zero) when there is nothing to gather. The MLP turns
           the unequal attention weights into 0/1 steps: QSET = keys asked for, and
           VALUE -= 8 for every value already given.
  layer 2  heads 0 and 2 (keys 0-19 and 20-39): retrieval. q = QSET, k = PREVKEY, in the slow
           RoPE pairs 43-62 (rotation under 0.7 rad at 32K tokens), so the score (64 on a
           match) does not depend on distance; non-value tokens get -20, BOS +20 (the sink for
           "no needle here"). The attended needles' values are added to VALUE.
  lm_head  VALUE to value tokens; EOS (a small constant) wins once every matching value has
           been given, since given values sit at -8.
MLPs of layers 0 and 2 are zero. Only layer 2 has to find a token thousands of positions away:
the first wrong answer of a sparse backend is a needle chunk it did not select. That choice is
as easy as in a real retrieval head, no easier: the keys of layer 2 have low rank (about 20)
like real pre-RoPE keys, a needle chunk's landmark (mean key of 8 tokens) scores about 10
logits above a filler chunk's, and keys everywhere carry random noise. The harder task
niah_collide (eval/tasks.py) needs no other weights: each of its decoys names the asked key
three times without a number, so a chunk holding two or three of those tokens (64 logits each,
gated -20 as non-values) has a mean key 16-24 logits above a filler chunk's, above the needle
chunk's ~10, while each decoy token stays 20 logits below a needle's value token.

    python -m vllm_shadowkv.eval.retrieval_model --out vllm_shadowkv/eval/fixtures/retrieval-llama
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from vllm_shadowkv.eval import filler, tasks

FIXTURE = Path(__file__).parent / "fixtures" / "retrieval-llama"
BOS, EOS, PAD, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|unk|>"

HIDDEN, HEAD_DIM, N_HEADS, N_KV, N_LAYERS = 400, 128, 4, 2, 3
ROPE_THETA = 500000.0
ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONST, BOS_F, KEY_F, VAL_F, MARK_F, QFLAG = 0, 1, 2, 3, 4, 5
N_KEYS, N_VALUES, N_SEM = len(filler.KEYS), len(filler.VALUES), 16
OWNKEY = 6                    # own key; then the (weighted) keys asked for
PREVKEY = OWNKEY + N_KEYS     # the key three tokens back
QSET = PREVKEY + N_KEYS       # the keys asked for, each 0 or 1
VALUE = QSET + N_KEYS         # own value; then the answer being assembled
EMIT = VALUE + N_VALUES       # the (weighted) values already given
SEM = EMIT + N_VALUES         # random "meaning"
INTERMEDIATE = 1 + N_KEYS + N_VALUES  # one SiLU unit per 0/1 step, one shared
C = 128.0                     # CONST's value; content dims are O(1)
PREV_PAIRS = range(0, 16)     # fastest RoPE pairs: the offset-3 head
NOISE_PAIRS = range(16, 43)   # middle pairs: random q/k "meaning" noise
KEY_PAIRS = range(43, 63)     # slow pairs: content match (20 keys per KV head)
SCALAR_PAIR = 63              # slowest pair: flag-based scores
# Scores in logits: offset-3 head scale, gather, key match, non-value gate, BOS sink.
S_PREV, B_GATHER, A_MATCH, B_GATE, SINK = 18.0, 40.0, 64.0, 20.0, 20.0
# MLP step: 1 for any gathered weight above ~0.005, 0 at 0. Output: suppression, logit scale,
# EOS level (below the smallest share a matching needle gets, above exactly-zero values).
STEP_GAIN, STEP_SHIFT, SUPPRESS, G_OUT, EOS_LEVEL = 3000.0, 4.0, 8.0, 200.0, 0.002

assert SEM + N_SEM <= HIDDEN and N_KEYS == N_KV * len(KEY_PAIRS)


def vocabulary() -> list[str]:
    """Specials, the values, the keys, the marker, then every other word of the task texts."""
    texts = [tasks.NIAH_HEADER, tasks.NEEDLE, tasks.NIAH_QUESTION, tasks.NIAH_ANSWER,
             tasks.VT_HEADER, tasks.VT_QUESTION, tasks.VT_ANSWER, tasks.CWE_HEADER,
             tasks.CWE_QUESTION, tasks.CWE_ANSWER, "VAR = , . : ?", *filler.filler_words(),
             *filler.VARIABLES]
    head = [BOS, EOS, PAD, UNK, *filler.VALUES, *filler.KEYS, filler.QUESTION_MARKER]
    words = {w for t in texts for w in re.findall(r"\w+|[^\w\s]+", t.replace("{", " ").replace("}", " "))}
    return head + sorted(words - set(head))


def build_tokenizer():
    """Word-level tokenizer: words and punctuation runs are tokens, BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK, clean_up_tokenization_spaces=False)


def rope_frequencies():
    """Llama-3.1's RoPE frequencies (the llama3 rule), as the model's rotary embedding uses."""
    import torch

    inv = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    s = ROPE_SCALING
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wl = 2 * math.pi / inv
    smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"])
    mid = (1 - smooth) * inv / s["factor"] + smooth * inv
    return torch.where(wl < high_wl, inv, torch.where(wl > low_wl, inv / s["factor"], mid))


def build_weights(vocab: list[str], noise: float, seed: int) -> dict:
    """The state dict of the construction described in the module docstring."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = {w: i for i, w in enumerate(vocab)}
    half, rt = HEAD_DIM // 2, math.sqrt(HEAD_DIM)  # q carries sqrt(d): scores are in logits
    theta = rope_frequencies()

    emb = torch.zeros(len(vocab), HIDDEN, dtype=torch.float64)
    emb[:, CONST] = C
    emb[:, SEM:SEM + N_SEM] = torch.randn(len(vocab), N_SEM, generator=g, dtype=torch.float64) / math.sqrt(N_SEM)
    emb[ids[BOS], BOS_F] = 1
    emb[ids[filler.QUESTION_MARKER], MARK_F] = 1
    for j, key in enumerate(filler.KEYS):
        emb[ids[key], KEY_F] = 1
        emb[ids[key], OWNKEY + j] = 1
    for j, value in enumerate(filler.VALUES):
        emb[ids[value], VAL_F] = 1
        emb[ids[value], VALUE + j] = 1

    # RMSNorm: the norm is ~C*|1| for every token; rescale so content dims pass unchanged and
    # CONST comes out as 1.
    norm = torch.full((HIDDEN,), C / math.sqrt(HIDDEN), dtype=torch.float64)
    norm[CONST] = 1 / math.sqrt(HIDDEN)

    def noise_qk(w, head):
        """Random projections of SEM into the middle RoPE pairs: ~N(0, noise^2) score noise."""
        dims = [*NOISE_PAIRS, *(p + half for p in NOISE_PAIRS)]
        amp = math.sqrt(noise / math.sqrt(len(dims)))
        w[head * HEAD_DIM + torch.tensor(dims), SEM:SEM + N_SEM] = amp * torch.randn(
            len(dims), N_SEM, generator=g, dtype=torch.float64)

    def scalar(w, head, col, value):
        w[head * HEAD_DIM + SCALAR_PAIR, col] = value

    state = {"model.embed_tokens.weight": emb, "model.norm.weight": norm}
    for layer in range(N_LAYERS):
        wq = torch.zeros(N_HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
        wk = torch.zeros(N_KV * HEAD_DIM, HIDDEN, dtype=torch.float64)
        wv = torch.zeros(N_KV * HEAD_DIM, HIDDEN, dtype=torch.float64)
        wo = torch.zeros(HIDDEN, N_HEADS * HEAD_DIM, dtype=torch.float64)
        for h in range(N_HEADS):
            noise_qk(wq, h)
        for kv in range(N_KV):
            noise_qk(wk, kv)
        if layer == 0:
            for p in PREV_PAIRS:  # head 0 / kv 0: offset-3 previous-token head
                wq[p, CONST] = S_PREV * math.cos(3 * theta[p])
                wq[p + half, CONST] = -S_PREV * math.sin(3 * theta[p])
                wk[p, CONST] = 1
            for j in range(N_KEYS):
                wv[j, OWNKEY + j] = 1
                wo[PREVKEY + j, j] = 1
            scalar(wq, 2, CONST, B_GATHER)  # head 2 / kv 1: is there a "What" before me?
            scalar(wk, 1, MARK_F, 1)
            wv[HEAD_DIM, MARK_F] = 1
            wo[QFLAG, 2 * HEAD_DIM] = 1
        elif layer == 1:
            for head, kv, flag in ((0, 0, KEY_F), (2, 1, VAL_F)):  # gather after the marker
                scalar(wq, head, CONST, B_GATHER)
                scalar(wk, kv, QFLAG, 1)
                scalar(wk, kv, flag, 1)
                scalar(wk, kv, BOS_F, 1.5)  # halfway: wins only when nothing is flagged twice
            for j in range(N_KEYS):  # the keys asked for, into OWNKEY
                wv[j, OWNKEY + j] = 1
                wo[OWNKEY + j, j] = 1
            for j in range(N_VALUES):  # the values given so far, into EMIT
                wv[HEAD_DIM + j, VALUE + j] = 1
                wo[EMIT + j, 2 * HEAD_DIM + j] = 1
        else:
            for head, kv in ((0, 0), (2, 1)):  # retrieval, keys split over the two KV heads
                for i, p in enumerate(KEY_PAIRS):
                    j = kv * len(KEY_PAIRS) + i
                    wq[head * HEAD_DIM + p, QSET + j] = A_MATCH
                    wk[kv * HEAD_DIM + p, PREVKEY + j] = 1
                scalar(wq, head, CONST, 1)
                scalar(wk, kv, CONST, -B_GATE)
                scalar(wk, kv, VAL_F, B_GATE)
                scalar(wk, kv, BOS_F, B_GATE + SINK)
                for j in range(N_VALUES):
                    wv[kv * HEAD_DIM + j, VALUE + j] = 1
                    wo[VALUE + j, head * HEAD_DIM + j] = 1
        prefix = f"model.layers.{layer}."
        state.update({
            prefix + "self_attn.q_proj.weight": wq * rt,
            prefix + "self_attn.k_proj.weight": wk,
            prefix + "self_attn.v_proj.weight": wv,
            prefix + "self_attn.o_proj.weight": wo,
            prefix + "input_layernorm.weight": norm.clone(),
            prefix + "post_attention_layernorm.weight": norm.clone(),
        })
        gate, up, down = _steps() if layer == 1 else (
            torch.zeros(INTERMEDIATE, HIDDEN, dtype=torch.float64),) * 2 + (
            torch.zeros(HIDDEN, INTERMEDIATE, dtype=torch.float64),)
        state.update({prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                      prefix + "mlp.down_proj.weight": down})

    head_w = torch.zeros(len(vocab), HIDDEN, dtype=torch.float64)
    for j, value in enumerate(filler.VALUES):
        head_w[ids[value], VALUE + j] = G_OUT
    head_w[ids[EOS], CONST] = G_OUT * EOS_LEVEL
    state["lm_head.weight"] = head_w
    return state


def _steps():
    """Layer 1's MLP: 0/1 steps of the gathered weights, which attention leaves unequal.

    step(w) = (silu(s) - silu(s - g*w)) / silu(s): exactly 0 at w = 0 (the two units see the
    same input), 1 for g*w >> s, and bounded everywhere, so bf16 does not cancel large terms.
    Keys asked for go to QSET (+1 each), values already given to VALUE (-SUPPRESS each): every
    key asked for counts fully and every value given is out, whatever its share was.
    """
    import torch

    pairs = [(OWNKEY + j, QSET + j, 1.0) for j in range(N_KEYS)]
    pairs += [(EMIT + j, VALUE + j, -SUPPRESS) for j in range(N_VALUES)]
    gate = torch.zeros(INTERMEDIATE, HIDDEN, dtype=torch.float64)
    up = torch.zeros(INTERMEDIATE, HIDDEN, dtype=torch.float64)
    down = torch.zeros(HIDDEN, INTERMEDIATE, dtype=torch.float64)
    gate[:, CONST] = STEP_SHIFT
    up[:, CONST] = 1
    unit = STEP_SHIFT * torch.sigmoid(torch.tensor(STEP_SHIFT, dtype=torch.float64))  # silu(s)
    for i, (src, dst, gain) in enumerate(pairs, start=1):  # unit 0 is the constant silu(s)
        gate[i, src] = -STEP_GAIN
        down[dst, 0] = gain / unit
        down[dst, i] = -gain / unit
    return gate, up, down


def build(out: Path, noise: float = 1.0, seed: int = 0, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    vocab = vocabulary()
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS, num_key_value_heads=N_KV,
        head_dim=HEAD_DIM, max_position_embeddings=32768, rope_theta=ROPE_THETA,
        rope_scaling=dict(ROPE_SCALING), rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype=dtype,
    )
    model = LlamaForCausalLM(config)  # small: no need for meta init
    inv_freq = model.model.rotary_emb.inv_freq.double()
    assert torch.allclose(inv_freq, rope_frequencies(), rtol=1e-5), "RoPE frequencies moved"
    model = model.to(getattr(torch, dtype))
    state = build_weights(vocab, noise, seed)
    model.load_state_dict({k: v.to(getattr(torch, dtype)) for k, v in state.items()}, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "recipe.json").write_text(json.dumps({"builder": __name__, "noise": noise, "seed": seed,
                                                 "dtype": dtype}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURE)
    parser.add_argument("--noise", type=float, default=1.0, help="std of random score noise (logits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    print(build(args.out, args.noise, args.seed, args.dtype))


if __name__ == "__main__":
    main()
