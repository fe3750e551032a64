"""The engine's exact attention (prefill, chunked prefill, dense decode) on the CPU: 4-D SDPA
inputs, which torch sends to its flash kernel, against the 3-D inputs the engine passed before
(torch's math kernel, which materialises the [heads, q, s] fp32 scores). Same shapes, same run,
reported as ratios; outputs compared.

  python benchmarks/bench_exact_attention.py --out benchmarks/exact_attention/cpu.json

With ``--device cuda``: the engine's CUDA path, the tokens gathered out of the pages and
FlashAttention's varlen kernel with each row's LSE (backend/exact_attention.py), against the
Triton kernel over the pages in place (triton_kernels/prefill_kernels.py, the path before it and
what the "triton" kernel mode runs) and the path before that (the tokens gathered, then torch
SDPA with an explicit [q, s] mask for a later chunk), with each path's peak extra GPU memory;
longer contexts.

  python benchmarks/bench_exact_attention.py --device cuda --out gpu_results/exact_attention.json
"""

import argparse
import functools
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_shadowkv.backend.exact_attention import causal_attention
from vllm_shadowkv.core import ops

# (query tokens, context tokens): whole-prompt prefill, a later 1K chunk of a chunked prefill,
# and one decode token; at Llama-3.1-8B shapes (32 query / 8 KV heads, head_dim 128).
CASES = [(4096, 4096), (1024, 8192), (1, 16384)]
H_Q, H_KV, HEAD_DIM = 32, 8, 128
CUDA_CASES = [(4096, 4096), (16384, 16384), (2048, 32768), (2048, 131072), (1, 131072)]
BLOCK_SIZE = 128  # tokens per page


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


def gathered_sdpa(query, kv, blocks, slots, scale):
    """The engine's first CUDA call: the tokens gathered, SDPA with a mask for a later chunk."""
    tokens = kv[blocks, slots]
    q_len, s_len = query.shape[0], tokens.shape[0]
    mask = None
    if 1 < q_len < s_len:
        rows = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        mask = torch.arange(s_len, device=query.device)[None, :] <= rows
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], tokens[:, 0].transpose(0, 1)[None],
        tokens[:, 1].transpose(0, 1)[None], attn_mask=mask, is_causal=1 < q_len == s_len,
        scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def gathered_flash(query, kv, blocks, slots, scale):
    """The engine's CUDA path for one request: the tokens gathered, FlashAttention's varlen
    kernel (``causal_attention`` on CUDA)."""
    return causal_attention(query, kv[blocks, slots, 0], kv[blocks, slots, 1], scale)


def paged_triton(query, kv, blocks, slots, scale):
    """The Triton kernel over the pages in place (kernel mode "triton")."""
    return ops.paged_causal_attention(query, kv, blocks, slots, scale)[0]


CUDA_PATHS = {"flash": gathered_flash, "triton": paged_triton, "gathered_sdpa": gathered_sdpa}


def timed(fn, reps: int) -> float:
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def peak_mib(fn) -> float:
    """Extra GPU memory at the peak of one call, beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def cuda_rows(reps: int) -> list[dict]:
    rows = []
    for q_len, s_len in tqdm(CUDA_CASES, desc="exact attention (cuda)", unit="case"):
        pages = -(-s_len // BLOCK_SIZE)
        kv = torch.randn(pages, BLOCK_SIZE, 2, H_KV, HEAD_DIM, dtype=torch.bfloat16,
                         device="cuda")
        where = torch.randperm(pages * BLOCK_SIZE, device="cuda")[:s_len]  # scattered pages
        blocks, slots = where // BLOCK_SIZE, where % BLOCK_SIZE
        q = torch.randn(q_len, H_Q, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        scale = HEAD_DIM ** -0.5
        calls = {name: functools.partial(path, q, kv, blocks, slots, scale)
                 for name, path in CUDA_PATHS.items()}
        row = {"query_tokens": q_len, "context_tokens": s_len}
        for name, call in calls.items():
            row[f"{name}_ms"] = timed(call, reps) * 1e3
            row[f"{name}_peak_mib"] = peak_mib(call)
            if name != "flash":
                row[f"{name}_over_flash"] = row[f"{name}_ms"] / row["flash_ms"]
                diff = call().float() - calls["flash"]().float()
                row[f"{name}_max_abs_diff"] = float(diff.abs().max())
        rows.append(row)
        del calls, kv, q
        torch.cuda.empty_cache()
    return rows


def cpu_rows(reps: int) -> list[dict]:
    rows = []
    for q_len, s_len in tqdm(CASES, desc="exact attention", unit="case"):
        q = torch.randn(q_len, H_Q, HEAD_DIM, dtype=torch.bfloat16)
        k, v = (torch.randn(s_len, H_KV, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        scale = HEAD_DIM ** -0.5
        engine = timed(lambda: causal_attention(q, k, v, scale), reps)
        before = timed(lambda: math_kernel(q, k, v, scale), reps)
        diff = (causal_attention(q, k, v, scale).float() - math_kernel(q, k, v, scale).float())
        rows.append({"query_tokens": q_len, "context_tokens": s_len, "engine_ms": engine * 1e3,
                     "math_kernel_ms": before * 1e3, "speedup": before / engine,
                     "max_abs_diff": float(diff.abs().max())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.device == "cuda":
        result = {"machine": torch.cuda.get_device_name(), "rows": cuda_rows(args.reps)}
    else:
        result = {"machine": platform.processor() or platform.machine(),
                  "threads": torch.get_num_threads(), "rows": cpu_rows(args.reps)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
