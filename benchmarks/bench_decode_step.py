"""Decode step of one attention layer at Llama-3.1-8B shapes: ShadowKV core sparse path vs dense
attention (torch SDPA over the whole context), in the same run, reported as ratios.

  python benchmarks/bench_decode_step.py                       # CPU: torch references
  python benchmarks/bench_decode_step.py --device cuda         # GPU: Triton kernels vs SDPA
                                                               # (FlashAttention), per-kernel
                                                               # bandwidth, kernel-vs-reference

Imports only torch, triton and vllm_shadowkv.core / .store / .triton_kernels, so a GPU machine
without vLLM runs it. On CUDA the values sit in the engine's pinned CpuValueStore (the first GPU
run, 2026-11-27, had them in an unpinned CPU tensor). Writes JSON and a PNG plot (if matplotlib is present).
"""

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_shadowkv.core import reconstruct, select
from vllm_shadowkv.core.compress import compress_prompt
from vllm_shadowkv.core.decode import DecodeBatch, decode_step
from vllm_shadowkv.core.params import ShadowKVParams
from vllm_shadowkv.core.rope import RopeCache, apply_rope
from vllm_shadowkv.core.store import InMemoryValueStore
from vllm_shadowkv.store import CpuValueStore

from plots import ratio_by_context  # benchmarks/plots.py

H_Q, H_KV, HEAD_DIM = 32, 8, 128
PARAMS = ShadowKVParams()  # paper defaults: rank 160, chunk 8, budget 2048, 48 outliers


def _rope(max_pos, device):
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return RopeCache(torch.cat((freqs.cos(), freqs.sin()), -1).to(device, torch.bfloat16),
                     HEAD_DIM, True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, reps, warm_up=True):
    if warm_up:
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def _prompt(context, device, rope):
    """Keys with a low-rank pre-RoPE part (as real keys), random values; compressed once per
    context and shared by every request of a batch (timing does not depend on content)."""
    g = torch.Generator(device="cpu").manual_seed(context)
    latent = torch.randn(context, 64, generator=g) @ torch.randn(64, H_KV * HEAD_DIM, generator=g)
    noise = 0.1 * torch.randn(context, H_KV * HEAD_DIM, generator=g)
    keys_pre = (latent + noise).view(context, H_KV, HEAD_DIM).to(device, torch.bfloat16)
    positions = torch.arange(context, device=device)
    keys = apply_rope(keys_pre, positions, rope)
    values = torch.randn(context, H_KV, HEAD_DIM, generator=g).to(device, torch.bfloat16)
    return keys, values, positions


def bench_point(context, batch_size, reps, device, rope, cache):
    if context not in cache:
        cache.clear()
        keys, values, positions = _prompt(context, device, rope)
        store = InMemoryValueStore("cpu")
        prompt = compress_prompt(keys, values, positions, rope, PARAMS, store, 0)
        cache[context] = (keys, values, prompt, store)
    keys, values, prompt, store = cache[context]
    shared = store._values[0]
    if device.type == "cuda":  # the engine's store: pinned host pages, fetched on a copy stream
        per_request = shared.numel() * shared.element_size() + (1 << 20)  # + page rounding
        store = CpuValueStore(batch_size * per_request, shared.dtype,
                              tuple(shared.shape[2:]), pin_memory=True)
        store.put(0, shared)
    for i in range(1, batch_size):  # the one prompt's values under every request
        store.put(i, shared)
    ids = list(range(batch_size))
    state = DecodeBatch.build([prompt] * batch_size, ids, rope, PARAMS, gen_capacity=64)
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(batch_size, 1, H_Q, HEAD_DIM, generator=g)
    hits, steps = [], []

    def sparse_step():
        # Successive queries are correlated, as in real decoding (the paper's ~60 % hit rate).
        q.mul_(0.9).add_(0.45 * torch.randn(q.shape, generator=g))
        before = state.slot_chunks.clone()
        decode_step(state, q.to(device, torch.bfloat16),
                    torch.randn(batch_size, 1, H_KV, HEAD_DIM, device=device, dtype=torch.bfloat16),
                    torch.randn(batch_size, 1, H_KV, HEAD_DIM, device=device, dtype=torch.bfloat16),
                    store)
        kept = (before == state.slot_chunks) & (before >= 0)
        hits.append(float(kept.float().mean()))
        steps.append(1)

    k_dense = keys.transpose(0, 1).unsqueeze(0).expand(batch_size, -1, -1, -1).contiguous()
    v_dense = values.transpose(0, 1).unsqueeze(0).expand(batch_size, -1, -1, -1).contiguous()
    q_dense = torch.randn(batch_size, H_Q, 1, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def dense_step():
        torch.nn.functional.scaled_dot_product_attention(q_dense, k_dense, v_dense,
                                                         enable_gqa=True)

    t_sparse = _time(sparse_step, device, reps)
    t_dense = _time(dense_step, device, reps)
    del k_dense, v_dense
    attended = prompt.exact_k.shape[1] + PARAMS.sparse_budget
    return dict(context=context, batch=batch_size, sparse_ms=t_sparse * 1e3,
                dense_ms=t_dense * 1e3, speedup=t_dense / t_sparse,
                hit_rate=sum(hits[1:]) / max(len(hits) - 1, 1), attended_tokens=attended)


def _bandwidth(fn, nbytes, device):
    import triton.testing
    ms = triton.testing.do_bench(fn)
    return dict(ms=ms, gbps=nbytes / ms / 1e6)


def bench_kernels_cuda(context, batch_size, rope):
    """Each Triton kernel alone (every slot a miss), its bandwidth, its agreement with the torch
    reference on the same CUDA tensors."""
    from vllm_shadowkv.triton_kernels import rebuild_kernels, select_kernels

    device = torch.device("cuda")
    bf16, elt = torch.bfloat16, 2
    k, c, r = PARAMS.select_chunks, PARAMS.chunk_size, PARAMS.rank
    n_lm = context // c - PARAMS.local_chunks - PARAMS.outlier_chunks
    n_tok = (n_lm + PARAMS.outlier_chunks) * c
    lm = torch.randn(batch_size * n_lm, H_KV, HEAD_DIM, device=device, dtype=bf16)
    lm_chunks = torch.arange(n_lm, device=device, dtype=torch.int32).repeat(batch_size)
    lm_chunks = lm_chunks.view(-1, 1).expand(-1, H_KV).contiguous()
    lm_start = torch.arange(batch_size, device=device, dtype=torch.int32) * n_lm
    lm_rows = torch.arange(batch_size * n_lm, device=device)
    lm_count = torch.full((batch_size,), n_lm, device=device, dtype=torch.int32)
    q = torch.randn(batch_size, 1, H_Q, HEAD_DIM, device=device, dtype=bf16)
    scale = HEAD_DIM ** -0.5
    a = torch.randn(batch_size * n_tok, r, device=device, dtype=bf16)
    a_rows = torch.arange(batch_size * n_tok, device=device)
    a_pos = torch.arange(n_tok, device=device, dtype=torch.int32).repeat(batch_size)
    a_start = torch.arange(batch_size, device=device, dtype=torch.int32) * n_tok
    b = torch.randn(batch_size, H_KV, r, HEAD_DIM, device=device, dtype=bf16) / math.sqrt(r)
    slot_chunks = torch.stack([torch.randperm(n_lm, device=device)[:k] for _ in
                               range(batch_size * H_KV)]).view(batch_size, H_KV, k).int()
    miss_slots = torch.arange(k, device=device, dtype=torch.int32).expand(batch_size, H_KV, k).contiguous()
    miss_count = torch.full((batch_size, H_KV), k, device=device, dtype=torch.int32)
    slot_k = torch.empty(batch_size, H_KV, k * c, HEAD_DIM, device=device, dtype=bf16)
    staging = torch.randn(batch_size * H_KV * k, c, HEAD_DIM, device=device, dtype=bf16)
    staging_start = (torch.arange(batch_size * H_KV, device=device, dtype=torch.int32) * k).view(batch_size, H_KV)
    slot_v = torch.empty_like(slot_k)

    rows = H_Q // H_KV
    out = {}
    scores = select_kernels.landmark_scores(q, lm, lm_rows, lm_start, lm_count, n_lm, scale)
    ref = select.landmark_scores(q, lm, lm_rows, lm_start, lm_count, n_lm, scale)
    out["landmark_scores"] = _bandwidth(
        lambda: select_kernels.landmark_scores(q, lm, lm_rows, lm_start, lm_count, n_lm, scale),
        lm.numel() * elt + batch_size * H_KV * n_lm * 4 * (2 * rows + 1), device)
    out["landmark_scores"]["max_abs_err_vs_torch"] = float((scores - ref).abs().max())
    chosen = select_kernels.select_chunks(scores, lm_chunks, lm_start, lm_count, k)
    want = select.select_chunks(scores, lm_chunks, lm_start, lm_count, k)
    out["select_chunks"] = _bandwidth(
        lambda: select_kernels.select_chunks(scores, lm_chunks, lm_start, lm_count, k),
        scores.numel() * 4, device)
    out["select_chunks"]["same_sets_as_torch"] = bool(torch.equal(chosen.sort(-1).values,
                                                                  want.sort(-1).values))
    args = (a, a_rows, a_pos, a_start, b, slot_chunks, miss_slots, miss_count, rope)
    rebuild_kernels.rebuild_keys(*args, slot_k)
    ref_k = torch.empty_like(slot_k)
    reconstruct.rebuild_keys(*args, ref_k)
    misses = batch_size * H_KV * k
    out["rebuild_keys"] = _bandwidth(
        lambda: rebuild_kernels.rebuild_keys(*args, slot_k),
        misses * c * (r + HEAD_DIM) * elt + b.numel() * elt, device)
    out["rebuild_keys"]["max_abs_err_vs_torch"] = float((slot_k.float() - ref_k.float()).abs().max())
    vargs = (staging, staging_start, miss_slots, miss_count)
    rebuild_kernels.scatter_values(*vargs, slot_v)
    ref_v = torch.empty_like(slot_v)
    reconstruct.scatter_values(*vargs, ref_v)
    out["scatter_values"] = _bandwidth(lambda: rebuild_kernels.scatter_values(*vargs, slot_v),
                                       2 * staging.numel() * elt, device)
    out["scatter_values"]["exact_vs_torch"] = bool(torch.equal(slot_v, ref_v))
    big = torch.empty(1 << 28, device=device, dtype=torch.uint8)
    copy = _bandwidth(lambda: big.clone(), 2 * big.numel(), device)
    for stats in out.values():
        stats["fraction_of_copy_bw"] = stats["gbps"] / copy["gbps"]
    out["copy_gbps"] = copy["gbps"]
    return out


def _plot(results, path):
    series = {}
    for batch_size in sorted({r["batch"] for r in results}):
        pts = [r for r in results if r["batch"] == batch_size]
        series[f"batch {batch_size}"] = ([p["context"] for p in pts], [p["speedup"] for p in pts])
    ratio_by_context(series, "dense time / ShadowKV time",
                     "Decode step, one layer, Llama-3.1-8B shapes", path)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--contexts", default=None, help="comma list, tokens")
    parser.add_argument("--batches", default=None, help="comma list")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON path (PNG written beside it)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    contexts = [int(x) for x in (args.contexts or ("8192,32768,131072")).split(",")]
    batches = [int(x) for x in (args.batches or ("1,4,8,16" if cuda else "1,4,8")).split(",")]
    reps = args.reps or (20 if cuda else 3)
    out = Path(args.out or Path(__file__).with_name(f"decode_step_{args.device}.json"))
    rope = _rope(max(contexts) + 256, device)
    torch.manual_seed(0)
    results, cache = [], {}
    points = [(c, b) for c in contexts for b in batches]
    for context, batch_size in tqdm(points, desc="decode step"):
        results.append(bench_point(context, batch_size, reps, device, rope, cache))
    report = dict(device=args.device, machine=platform.processor() or platform.machine(),
                  torch=torch.__version__, params=PARAMS.__dict__, heads=[H_Q, H_KV, HEAD_DIM],
                  reps=reps, results=results)
    if cuda:
        report["gpu"] = torch.cuda.get_device_name()
        report["kernels"] = {f"{c}x{b}": bench_kernels_cuda(c, b, rope)
                             for c in contexts for b in batches}
    out.write_text(json.dumps(report, indent=1))
    _plot(results, out.with_suffix(".png"))
    print(f"{'context':>8} {'batch':>5} {'sparse ms':>10} {'dense ms':>10} {'speedup':>8} {'hit':>5}")
    for r in results:
        print(f"{r['context']:>8} {r['batch']:>5} {r['sparse_ms']:>10.2f} {r['dense_ms']:>10.2f} "
              f"{r['speedup']:>8.2f} {r['hit_rate']:>5.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
