"""ShadowKV's prompt end of one attention layer at Llama-3.1-8B shapes, stage by stage, as a share
of the same layer's exact prefill attention (the paper's Table 12 reports it so: SVD, reduce,
cosine similarity, top-k and gather against attention + FFN):

* rope inversion (``ops.invert_rope``), the keys' Gram matrix (``lowrank._gram``, oneDNN's bf16
  products on CPUs that have them), its top-r eigenvectors (``lowrank._top_eigenvectors``), the
  projection A = K Psi, the chunks' landmarks and cosines (``ops.chunk_geometry``);
* the whole ``compress_prompt`` (the above, the outliers, the exact rows, the values into a
  store), which a cold prefill runs once per request and layer, and a prefix-cache hit again;
* the exact causal attention of the prompt in chunks of 4,096 query rows, once
  (``causal_attention``: the C kernel on the CPU where it applies, FlashAttention varlen on CUDA).

  python benchmarks/bench_prompt_end.py --out benchmarks/prompt_end/cpu.json
  python benchmarks/bench_prompt_end.py --device cuda --contexts 8192,32768,131072

Imports only torch and vllm_shadowkv.core, so a GPU machine without vLLM runs it. Writes JSON and a
PNG (stacked stages per context) beside it.
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from bench_decode_step import H_Q, HEAD_DIM, _prompt, _rope, _time  # benchmarks/
from engine_cores import machine
from plots import pyplot
from vllm_shadowkv.backend.exact_attention import causal_attention
from vllm_shadowkv.core import lowrank, ops
from vllm_shadowkv.core.compress import compress_prompt
from vllm_shadowkv.core.params import ShadowKVParams
from vllm_shadowkv.core.store import InMemoryValueStore

CHUNK = 4096  # query rows per prefill chunk
PARAMS = ShadowKVParams(min_compress_tokens=0)  # the paper's settings, at any length
STAGES = ("rope_inversion", "gram", "eigh", "projection", "chunk_geometry")


def measure(context: int, dtype: torch.dtype, reps: int, device: torch.device) -> dict:
    rope = _rope(context + 1, device)
    keys, values, positions = _prompt(context, device, rope)
    keys, values = keys.to(dtype), values.to(dtype)
    query = torch.randn(context, H_Q, HEAD_DIM, device=device, dtype=dtype)
    split = PARAMS.compressed_chunks(context) * PARAMS.chunk_size
    rank, scale = PARAMS.rank, HEAD_DIM ** -0.5
    keys_pre = ops.invert_rope(keys[:split], positions[:split], rope)
    flat = keys_pre.reshape(split, -1).float()
    with lowrank._fp32_products_as_bf16(device):
        gram = lowrank._gram(flat)
    psi = lowrank._top_eigenvectors(gram, rank)

    def products(fn):
        def run():
            with lowrank._fp32_products_as_bf16(device):
                fn()
        return run

    def attention():
        for start in range(0, context, CHUNK):
            end = min(start + CHUNK, context)
            causal_attention(query[start:end], keys[:end], values[:end], scale)

    stages = {
        "rope_inversion": lambda: ops.invert_rope(keys[:split], positions[:split], rope),
        "gram": products(lambda: lowrank._gram(flat)),
        "eigh": lambda: lowrank._top_eigenvectors(gram, rank),
        "projection": products(lambda: flat @ psi),
        "chunk_geometry": lambda: ops.chunk_geometry(keys[:split], PARAMS.chunk_size),
    }
    row = {"context": context, "dtype": str(dtype).removeprefix("torch."),
           **{f"{name}_s": _time(fn, device, reps) for name, fn in stages.items()}}
    row["compress_s"] = _time(lambda: compress_prompt(keys, values, positions, rope, PARAMS,
                                                      InMemoryValueStore(), 0), device, reps)
    causal_attention(query[:CHUNK], keys[:CHUNK], values[:CHUNK], scale)  # warm-up: one chunk
    row["attention_s"] = _time(attention, device, 1, warm_up=False)
    row["compress_over_attention"] = row["compress_s"] / row["attention_s"]
    return row


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [f"{r['context'] // 1024}K" for r in rows]
    bottom = [0.0] * len(rows)
    for name in STAGES:
        ms = [r[f"{name}_s"] * 1e3 for r in rows]
        ax.bar(labels, ms, bottom=bottom, label=name.replace("_", " "))
        bottom = [b + m for b, m in zip(bottom, ms)]
    rest = [max(r["compress_s"] * 1e3 - b, 0.0) for r, b in zip(rows, bottom)]
    ax.bar(labels, rest, bottom=bottom, label="the rest of compress_prompt", color="lightgrey")
    for i, r in enumerate(rows):
        ax.annotate(f"{100 * r['compress_over_attention']:.1f} % of attention",
                    (i, r["compress_s"] * 1e3), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("ms per layer")
    ax.set_xlabel("prompt tokens")
    ax.set_title(f"ShadowKV's prompt end, one layer ({meta['machine']}, {meta['dtype']})",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="4096,16384")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = [measure(int(n), dtype, args.reps, device)
            for n in tqdm(args.contexts.split(","), desc="contexts")]
    for r in rows:
        stages = ", ".join(f"{name.replace('_', ' ')} {r[f'{name}_s'] * 1e3:.1f}"
                           for name in STAGES)
        print(f"{r['context']:>7} tokens: compress_prompt {r['compress_s'] * 1e3:.1f} ms "
              f"({stages}) = {100 * r['compress_over_attention']:.2f} % of the exact attention's "
              f"{r['attention_s'] * 1e3:.0f} ms")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"machine": torch.cuda.get_device_name() if device.type == "cuda" else machine(),
                "device": args.device, "threads": args.threads,
                "torch": torch.__version__, "dtype": args.dtype, "rank": PARAMS.rank,
                "chunk_size": PARAMS.chunk_size, "prefill_chunk": CHUNK}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot(rows, meta, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
