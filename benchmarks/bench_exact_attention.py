"""The engine's exact attention (prefill, chunked prefill, dense decode) on the CPU: 4-D SDPA
inputs, which torch sends to its flash kernel, against the 3-D inputs the engine passed before
(torch's math kernel, which materialises the [heads, q, s] fp32 scores). Same shapes, same run,
reported as ratios; outputs compared.

  python benchmarks/bench_exact_attention.py --out benchmarks/exact_attention/cpu.json
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_shadowkv.backend.exact_attention import causal_attention

# (query tokens, context tokens): whole-prompt prefill, a later 1K chunk of a chunked prefill,
# and one decode token; at Llama-3.1-8B shapes (32 query / 8 KV heads, head_dim 128).
CASES = [(4096, 4096), (1024, 8192), (1, 16384)]
H_Q, H_KV, HEAD_DIM = 32, 8, 128


def math_kernel(query, key, value, scale):
    """The engine's previous call: 3-D inputs, an explicit mask for a later chunk."""
    q_len, s_len = query.shape[0], key.shape[0]
    mask = None
    if 1 < q_len < s_len:
        rows = torch.arange(s_len - q_len, s_len)[:, None]
        mask = torch.arange(s_len)[None, :] <= rows
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).float(), key.transpose(0, 1).float(),
        value.transpose(0, 1).float(), attn_mask=mask, is_causal=1 < q_len == s_len,
        scale=scale, enable_gqa=True)
    return out.transpose(0, 1).to(query.dtype)


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for q_len, s_len in tqdm(CASES, desc="exact attention", unit="case"):
        q = torch.randn(q_len, H_Q, HEAD_DIM, dtype=torch.bfloat16)
        k, v = (torch.randn(s_len, H_KV, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        scale = HEAD_DIM ** -0.5
        engine = timed(lambda: causal_attention(q, k, v, scale), args.reps)
        before = timed(lambda: math_kernel(q, k, v, scale), args.reps)
        diff = (causal_attention(q, k, v, scale).float() - math_kernel(q, k, v, scale).float())
        rows.append({"query_tokens": q_len, "context_tokens": s_len, "engine_ms": engine * 1e3,
                     "math_kernel_ms": before * 1e3, "speedup": before / engine,
                     "max_abs_diff": float(diff.abs().max())})
    result = {"machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
