"""Decode attention over KIVI-quantized pages at Llama-3.1-8B shapes (one layer): the fused
dequantize-and-attend kernel that MiniKV's pages, TailorKV's Q-layers and SpeCache's low-bit
pass run (``core.ops.quant_attention``; Triton on CUDA), against dense 16-bit attention over
the same context in the same run.

  python benchmarks/bench_quant_attention.py --device cuda --out gpu_results/quant_attention.json
  python benchmarks/bench_quant_attention.py --contexts 4096 --batches 1,2   # CPU smoke run

For the 1-bit format also SpeCache's speculative step (two query rows, the second's logits for
the next top-k): a separate logits pass against the logits returned by the attention pass.
Two dense figures: torch SDPA over contiguous 16-bit K/V (its FlashAttention on CUDA), and the
floor of any dense kernel, the 16-bit K/V bytes at the measured copy bandwidth. Each request
has its own pages, scattered through the pool as vLLM's block manager leaves them, so a batch
is not served from L2. Error: ``||out - ref|| / ||ref||`` against dequantize-then-attend in
fp32 (``core.quant_attention``, the reference). Imports no vLLM (runs on a bare GPU machine).
"""

import argparse
import itertools
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_shadowkv.core import ops
from vllm_shadowkv.core import quant_attention as reference
from vllm_shadowkv.core.kivi import KiviFormat, QuantizedGroups

from plots import ratio_by_context  # benchmarks/plots.py

H_Q, H_KV, HEAD_DIM = 32, 8, 128
FORMATS = {  # each method's default format
    "minikv 2-bit G16": KiviFormat(2, 16, HEAD_DIM, 16, midpoint_one_bit=False),
    "specache/tailorkv 1-bit G64": KiviFormat(1, 64, HEAD_DIM, 64, midpoint_one_bit=True),
}


def _time_ms(fn, device, reps):
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=reps * 10, return_mode="median")
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def _pool(fmt, n_groups, device, g):
    """Random codes and scales: the kernel's time does not depend on the values, and the
    reference is defined for any codes."""
    words = (n_groups, H_KV, fmt.group, fmt.words_per_token)
    codes = lambda: torch.randint(-2**31, 2**31 - 1, words, generator=g, dtype=torch.int32,
                                  device=device)
    params = lambda *shape: (0.1 * torch.randn(*shape, generator=g, device=device)).bfloat16()
    value_params = (n_groups, H_KV, fmt.group, HEAD_DIM // fmt.value_group)
    pool = QuantizedGroups(codes(), params(n_groups, H_KV, HEAD_DIM),
                           params(n_groups, H_KV, HEAD_DIM), codes(), params(*value_params),
                           params(*value_params))
    return pool


def _requests(fmt, context, batch, device):
    """``batch`` requests of ``context`` tokens, their groups scattered through one pool: (the
    generator, groups per request, pool, group table, group counts, one decode query each)."""
    g = torch.Generator(device).manual_seed(context * 31 + batch)
    per_request = context // fmt.group
    pool = _pool(fmt, batch * per_request, device, g)
    table = torch.randperm(batch * per_request, generator=g, device=device).int()
    table = table.view(batch, per_request)
    count = torch.full((batch,), per_request, dtype=torch.int32, device=device)
    q = torch.randn(batch, 1, H_Q, HEAD_DIM, generator=g, device=device).bfloat16()
    return g, per_request, pool, table, count, q


def bench_point(fmt, context, batch, reps, device, copy_gbps):
    g, per_request, pool, table, count, q = _requests(fmt, context, batch, device)
    scale = HEAD_DIM ** -0.5
    quant_ms = _time_ms(lambda: ops.quant_attention(q, pool, table, count, fmt, scale),
                        device, reps)
    quant_bytes = batch * per_request * H_KV * fmt.group_bytes()
    row = dict(format=str(fmt), context=context, batch=batch, quant_ms=quant_ms,
               quant_bytes=quant_bytes, quant_gbps=quant_bytes / quant_ms / 1e6)
    if fmt.bits == 1:  # SpeCache scores every low-bit key before its top-k
        logits_ms = _time_ms(lambda: ops.quant_logits(q[:, 0], pool, table, count, fmt, scale),
                             device, reps)
        logits_bytes = (batch * per_request * H_KV * fmt.group * fmt.words_per_token * 4
                        + batch * H_Q * context * 4)
        row.update(logits_ms=logits_ms, logits_gbps=logits_bytes / logits_ms / 1e6)
        # SpeCache's speculative step: two query rows attend, the second's logits pick the
        # next top-k; a separate logits pass against the one the attention returns.
        q2 = torch.randn(batch, 2, H_Q, HEAD_DIM, generator=g, device=device).bfloat16()
        row["spec_two_pass_ms"] = _time_ms(lambda: (
            ops.quant_attention(q2, pool, table, count, fmt, scale),
            ops.quant_logits(q2[:, 1], pool, table, count, fmt, scale)), device, reps)
        row["spec_one_pass_ms"] = _time_ms(lambda: ops.quant_attention(
            q2, pool, table, count, fmt, scale, 1), device, reps)
    if batch == 1:
        out, lse = ops.quant_attention(q, pool, table, count, fmt, scale)
        want, want_lse = reference.quant_attention(q.float(), pool, table, count, fmt, scale)
        row["rel_err_vs_reference"] = float((out.float() - want).norm() / want.norm())
        row["lse_max_abs_err"] = float((lse - want_lse).abs().max())
    del pool
    k = torch.randn(batch, H_KV, context, HEAD_DIM, generator=g, device=device).bfloat16()
    v = torch.randn(batch, H_KV, context, HEAD_DIM, generator=g, device=device).bfloat16()
    q_dense = q.transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dense_ms = _time_ms(lambda: sdpa(q_dense, k, v, enable_gqa=True), device, reps)
    dense_bytes = 2 * k.numel() * k.element_size()
    row.update(dense_sdpa_ms=dense_ms, dense_bytes=dense_bytes,
               dense_floor_ms=dense_bytes / copy_gbps / 1e6 if copy_gbps else None,
               speedup_vs_sdpa=dense_ms / quant_ms)
    if copy_gbps:
        row["speedup_vs_dense_floor"] = row["dense_floor_ms"] / quant_ms
        row["quant_fraction_of_copy_bw"] = row["quant_gbps"] / copy_gbps
    return row


SWEEP = dict(TOKENS_PER_STEP=(16, 32, 64, 128), MIN_GROUPS_PER_STEP=(1, 2), NUM_WARPS=(4, 8),
             PROGRAMS_PER_SM=(2, 4, 8), DOT_16BIT=(False, True))


def sweep_point(fmt, context, batch, reps, device):
    """The Triton kernel's time under each launch setting of ``SWEEP`` (CUDA)."""
    from vllm_shadowkv.triton_kernels import quant_kernels
    _, _, pool, table, count, q = _requests(fmt, context, batch, device)
    want = quant_kernels.quant_attention(q, pool, table, count, fmt, HEAD_DIM ** -0.5)[0]
    defaults = {name: getattr(quant_kernels, name) for name in SWEEP}
    timed = {}  # launch -> its first setting's timing
    for values in itertools.product(*SWEEP.values()):
        setting = dict(zip(SWEEP, values))
        launch = _launch(setting, fmt)
        if launch in timed:  # the same launch as a setting timed already
            continue
        for name, value in setting.items():
            setattr(quant_kernels, name, value)
        run = lambda: quant_kernels.quant_attention(q, pool, table, count, fmt, HEAD_DIM ** -0.5)
        err = float((run()[0].float() - want.float()).norm() / want.float().norm())
        timed[launch] = dict(setting, ms=_time_ms(run, device, reps), rel_diff=err)
    for name, value in defaults.items():
        setattr(quant_kernels, name, value)
    timings = list(timed.values())
    return dict(format=str(fmt), context=context, batch=batch,
                default_ms=timed[_launch(defaults, fmt)]["ms"],
                best=min(timings, key=lambda t: t["ms"]), timings=timings)


def _launch(setting, fmt):
    """A setting's launch: the token groups per step it gives ``fmt``, and the other
    settings."""
    from vllm_shadowkv.triton_kernels.quant_kernels import groups_per_step
    groups = groups_per_step(fmt.group, setting["TOKENS_PER_STEP"],
                             setting["MIN_GROUPS_PER_STEP"])
    rest = tuple(setting[k] for k in SWEEP if k not in ("TOKENS_PER_STEP",
                                                          "MIN_GROUPS_PER_STEP"))
    return (groups, *rest)


def _copy_gbps(device):
    if device.type != "cuda":
        return None
    big = torch.empty(1 << 30, device=device, dtype=torch.uint8).random_()
    ms = _time_ms(lambda: big.clone(), device, 20)
    return 2 * big.numel() / ms / 1e6


def _plot(results, path):
    key = "speedup_vs_dense_floor" if "speedup_vs_dense_floor" in results[0] else "speedup_vs_sdpa"
    series = {}
    for name, fmt in FORMATS.items():
        for batch in sorted({r["batch"] for r in results}):
            pts = [r for r in results if r["format"] == str(fmt) and r["batch"] == batch]
            series[f"{name}, batch {batch}"] = ([p["context"] for p in pts], [p[key] for p in pts])
    ratio_by_context(series, key.replace("_", " "),
                     "Quantized-page decode attention, one layer, Llama-3.1-8B shapes", path)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--contexts", default="32768,131072", help="comma list, tokens")
    parser.add_argument("--batches", default="1,8,16", help="comma list")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (PNG written beside it)")
    parser.add_argument("--sweep", action="store_true",
                        help="CUDA: time the Triton kernel under each launch setting instead")
    args = parser.parse_args()
    device = torch.device(args.device)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    points = [(f, c, b) for f in FORMATS.values() for c in contexts for b in batches]
    if args.sweep:
        _sweep(points, args, device)
        return
    copy_gbps = _copy_gbps(device)
    results = [bench_point(f, c, b, args.reps, device, copy_gbps)
               for f, c, b in tqdm(points, desc="quant attention")]
    report = dict(device=args.device, machine=platform.processor() or platform.machine(),
                  gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                  torch=torch.__version__, heads=[H_Q, H_KV, HEAD_DIM], copy_gbps=copy_gbps,
                  formats={k: str(v) for k, v in FORMATS.items()}, results=results)
    out = Path(args.out or Path(__file__).with_name(f"quant_attention_{args.device}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    _plot(results, out.with_suffix(".png"))
    print(f"copy bandwidth: {copy_gbps} GB/s")
    print(f"{'bits':>4} {'ctx':>7} {'B':>3} {'quant ms':>9} {'GB/s':>7} {'sdpa ms':>8} "
          f"{'floor ms':>8} {'x sdpa':>6} {'x floor':>7} {'logits ms':>9} {'2 rows, 2 passes':>16} "
          f"{'1 pass':>7} {'err':>8}")
    for r in results:
        floor = "-" if r["dense_floor_ms"] is None else f"{r['dense_floor_ms']:.3f}"
        print(f"{r['format'].split('bits=')[1].split(',')[0]:>4} {r['context']:>7} "
              f"{r['batch']:>3} {r['quant_ms']:>9.3f} {r['quant_gbps']:>7.0f} "
              f"{r['dense_sdpa_ms']:>8.3f} {floor:>8} "
              f"{r['speedup_vs_sdpa']:>6.2f} {r.get('speedup_vs_dense_floor', 0):>7.2f} "
              f"{r.get('logits_ms', 0):>9.3f} {r.get('spec_two_pass_ms', 0):>16.3f} "
              f"{r.get('spec_one_pass_ms', 0):>7.3f} {r.get('rel_err_vs_reference', float('nan')):>8.1e}")
    print(f"wrote {out}")


def _sweep(points, args, device):
    results = [sweep_point(f, c, b, args.reps, device) for f, c, b in tqdm(points, desc="sweep")]
    out = Path(args.out or Path(__file__).with_name(f"quant_attention_sweep_{args.device}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                   sweep=SWEEP, results=results), indent=1))
    print(f"{'bits':>4} {'ctx':>7} {'B':>3} {'default ms':>10} {'best ms':>8}  best setting")
    for r in results:
        best = {k: v for k, v in r["best"].items() if k in SWEEP}
        print(f"{r['format'].split('bits=')[1].split(',')[0]:>4} {r['context']:>7} "
              f"{r['batch']:>3} {r['default_ms']:>10.3f} {r['best']['ms']:>8.3f}  {best}")
    # One setting for every point: the least total time relative to each point's best.
    settings = {tuple((k, t[k]) for k in SWEEP) for r in results for t in r["timings"]}

    def cost(setting):  # a point may have timed this setting's launch under another name
        setting, total = dict(setting), 0.0
        for r in results:
            fmt = next(f for f in FORMATS.values() if str(f) == r["format"])
            launch = _launch(setting, fmt)
            total += next(t["ms"] for t in r["timings"]
                          if _launch(t, fmt) == launch) / r["best"]["ms"]
        return total
    ranked = sorted(settings, key=cost)[:5]
    for setting in ranked:
        print(f"mean of time / best over the points {cost(setting) / len(results):.3f}: "
              f"{dict(setting)}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
