"""The engine's exact attention (prefill, chunked prefill) on the CPU: its C kernel
(csrc/prefill_attention.c: AVX512-BF16 dot products for both products, or fp32 FMAs on AVX2)
against vLLM's own CPU kernel (``cpu_attention_with_kv_cache``, what vLLM's default CPU backend
runs) on the same inputs, at Llama-3.1-8B and SmolLM2-135M attention shapes; whole prompts and
later chunks. Reported as times, GFLOP/s of the causal products and ratios; outputs compared.

  python benchmarks/bench_exact_attention.py --out benchmarks/exact_attention/cpu_c_kernel.json

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

from vllm_shadowkv.backend.exact_attention import (_vllm_cpu_attention, causal_attention,
                                                   prefill_in_c)
from vllm_shadowkv.core import ops

# (query tokens, context tokens): whole-prompt prefills and later 2K chunks of a chunked one
CASES = [(4096, 4096), (8192, 8192), (16384, 16384), (2048, 16384), (2048, 32768)]
# (query heads, KV heads, head_dim): the CPU's shapes; CUDA's are Llama-3.1-8B's
SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
H_Q, H_KV, HEAD_DIM = SHAPES["llama-3.1-8b"]
CUDA_CASES = [(4096, 4096), (16384, 16384), (2048, 32768), (2048, 131072), (1, 131072)]
BLOCK_SIZE = 128  # tokens per page


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


def causal_flops(q_len: int, s_len: int, h_q: int, head_dim: int) -> float:
    """QK^T and PV over the keys each query row sees (token i of the chunk: s - q + i + 1)."""
    seen = q_len * (s_len - q_len) + q_len * (q_len + 1) / 2
    return 4 * h_q * head_dim * seen


def cpu_rows(reps: int) -> list[dict]:
    rows = []
    cases = [(shape, *case) for shape in SHAPES for case in CASES]
    for shape, q_len, s_len in tqdm(cases, desc="exact attention", unit="case"):
        h_q, h_kv, head_dim = SHAPES[shape]
        q = torch.randn(q_len, h_q, head_dim, dtype=torch.bfloat16)
        k, v = (torch.randn(s_len, h_kv, head_dim, dtype=torch.bfloat16) for _ in range(2))
        scale = head_dim ** -0.5
        assert prefill_in_c(q, k, v), "the C kernel does not run here (AVX512-BF16 or AVX2, no AMX?)"
        engine = timed(lambda: causal_attention(q, k, v, scale), reps)
        vllm = timed(lambda: _vllm_cpu_attention(q, k, v, scale), reps)
        diff = (causal_attention(q, k, v, scale).float()
                - _vllm_cpu_attention(q, k, v, scale).float())
        flops = causal_flops(q_len, s_len, h_q, head_dim)
        rows.append({"shape": shape, "query_tokens": q_len, "context_tokens": s_len,
                     "engine_ms": engine * 1e3, "vllm_ms": vllm * 1e3,
                     "engine_gflops": flops / engine / 1e9, "vllm_gflops": flops / vllm / 1e9,
                     "speedup": vllm / engine, "max_abs_diff": float(diff.abs().max()),
                     "mean_abs_diff": float(diff.abs().mean())})
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
