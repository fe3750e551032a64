"""One attention layer's decode step on the CPU at Llama-3.1-8B shapes (32 query heads, 8 KV heads,
head_dim 128, bf16): vLLM's CPU attention op (what its default CPU_ATTN backend runs) against
shadowkv through the engine's own code path, for the same batch of B requests of L context tokens,
one decode token per request. Needs vLLM's CPU build (``vllm._custom_ops``).

  .venv/bin/python benchmarks/bench_layer_decode.py     # 32K and 128K, batch 1/4/8, profile 32K x 4
  .venv/bin/python benchmarks/bench_layer_decode.py --contexts 8192 --batches 1 2 --reps 2 \\
      --profile-context 8192 --profile-batch 2 --out /tmp/layer_decode             # smoke test

* dense: the step's K/V written by ``ops.cpu_attn_reshape_and_cache``, then
  ``ops.cpu_attention_with_kv_cache`` over vLLM's CPU paged cache (block size 128, the ISA of
  the backend's ``_get_attn_isa``), called as ``CPUAttentionBackendImpl`` calls them, with the
  scheduler metadata of ``ops.cpu_attn_get_scheduler_metadata`` as its metadata builder makes it.
* shadowkv: the paper's settings (rank 160, chunk 8, budget 2048, 48 outlier chunks, local
  window 32) on ``PageLayout(ShadowKVMethod)``: the prompt written exactly to staging pages,
  read back and compressed by ``method.finalize`` into each request's own region and a
  ``CpuValueStore``; each step writes the step's K/V to the generated-token pages
  (``write_exact``) and runs one ``method.decode`` for the whole batch (the torch references on
  the CPU). Keys are low-rank before RoPE, as in bench_decode_step.py; one prompt per context,
  compressed once per request. Queries drift between steps (q <- 0.9 q + 0.44 noise, ``--drift``
  0.9), so the slot hit cache works as in decoding; the hit rate is the requests'
  ``RequestStats``. ``--drift 0`` (independent queries, hit rate about 0.03) is the regime of
  the end-to-end runs' random-token prompts.

Timed: the per-layer work (K/V write + attention), the median of ``--reps`` steps after
``--warmup`` steps (the first shadowkv step fills every slot); a step's metadata (built once per
step for all layers) is not timed. Both backends use ``--threads`` torch/OpenMP threads. Run
it on an otherwise idle machine: beside a test run, 2 threads on 2 cores made every small torch
op wait for a descheduled thread (shadowkv 0.4 s per step at 8K instead of 24 ms).

Bytes one step reads: dense, B*L*8*128*2 (K and V) * 2 B. shadowkv, from the layout: ``minimum``
= landmarks of every selectable chunk + the slots' K/V (sparse_budget tokens) + the exact region
(outlier chunks + local window) + generated tokens + the A rows and values of the missed chunks
(per missed KV head and chunk, at the measured hit rate); ``structure`` = minimum + B
[8, 160, 128] + the outlier and slot ids (what the step reads from its structures); ``copies``
= the bytes the step gathers out of the pages into new tensors (written, then read again: the
step's memory traffic is at least structure + 2 x copies).

Per context, the dense cache of max(batches) requests is filled, timed and freed, then the
shadowkv requests (the same count) are compressed and timed; batch B decodes the first B. Peak
memory is the larger of the two: at 128K x 8, about 4.5 GiB (dense cache) and 5-7 GiB (pages,
store, compression); the JSON records the peak RSS.

Writes, in ``--out`` (benchmarks/layer_decode), cpu.json, cpu.png (if matplotlib is present)
and profile_<L>k.txt: a torch profile of 3 shadowkv steps, per stage (the engine's and core's
functions labelled while profiling) and per op (top 20 by self CPU time).
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import vllm
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, record_function
from tqdm import tqdm
from vllm import _custom_ops as ops
from vllm import envs

from plots import pyplot
from vllm_shadowkv.backend import exact_attention
from vllm_shadowkv.backend.host_malloc import keep_freed_memory
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.backend.worker_state import RequestStats
from vllm_shadowkv.core import decode as core_decode
from vllm_shadowkv.core import ops as core_ops
from vllm_shadowkv.core.rope import RopeCache, apply_rope
from vllm_shadowkv.methods.base import KVShapes, LayerContext, RequestRows
from vllm_shadowkv.methods.shadowkv import ShadowKVMethod, ShadowKVSettings
from vllm_shadowkv.methods.shadowkv.pages import ShadowKVPages
from vllm_shadowkv.store import CpuValueStore

H_Q, H_KV, HEAD_DIM = 32, 8, 128
BLOCK = exact_attention._VLLM_CPU_BLOCK  # the block its ISA is resolved for
DTYPE = torch.bfloat16
ELT = DTYPE.itemsize
ROW = HEAD_DIM * ELT  # one token of one KV head
SCALE = HEAD_DIM ** -0.5
SETTINGS = ShadowKVSettings(min_sparse_len=1024)  # the paper's defaults; every context compressed
DRIFT = 0.9  # correlation of a request's query from one step to the next
PROFILE_STEPS = 3
# Labelled while profiling: (owner, function, what it does in a step), in the order they run.
STAGES = (
    (exact_attention, "write_exact", "the step's K/V into its generated-token page"),
    (ShadowKVMethod, "_step_rows", "the step's query rows and generated tokens' pages"),
    (ShadowKVMethod, "_generated", "read the generated tokens' K/V from their pages"),
    (ShadowKVMethod, "_generated_rows", "where the generated tokens' K/V are in the pages"),
    (ShadowKVPages, "load_batch", "B and ids from pages (exact region, slots: unless in place)"),
    (core_decode.DecodeBatch, "_append_generated", "append the step's K/V"),
    (core_ops, "landmark_scores", "score every selectable chunk's landmark"),
    (core_ops, "select_slots", "top-k chunks per KV head; hits keep their slot, misses get the "
                               "freed ones"),
    (core_decode.DecodeBatch, "_missed_rows", "the misses to the host (one copy)"),
    (core_ops, "rebuild_keys", "missed keys: A rows x B + RoPE"),
    (core_decode.DecodeBatch, "_fetch_values", "missed values gathered from the store"),
    (core_ops, "scatter_values", "missed values into their slots"),
    (CpuValueStore, "gather_many", "missed values from the store (into their slots)"),
    (core_ops, "decode_attention", "attention over the rows in place (exact region, slots, "
                                   "generated)"),
    (core_decode, "attention_with_lse", "attention: exact region, generated, slots"),
    (core_decode, "merge_attention", "merge the three by log-sum-exp"),
    (ShadowKVPages, "store_slots", "write the refilled slots back to the pages"))
STEP_LABEL = "layer decode step"


# -- inputs -------------------------------------------------------------------------------------
def llama_rope(max_pos: int) -> RopeCache:
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return RopeCache(torch.cat((freqs.cos(), freqs.sin()), -1), HEAD_DIM, True)


def prompt_kv(context: int, rope: RopeCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [L, 8, 128] with a low-rank pre-RoPE part (as real keys), random values."""
    g = torch.Generator().manual_seed(context)
    keys = torch.randn(context, 64, generator=g) @ torch.randn(64, H_KV * HEAD_DIM, generator=g)
    keys += 0.1 * torch.randn(context, H_KV * HEAD_DIM, generator=g)
    keys = apply_rope(keys.view(context, H_KV, HEAD_DIM).to(DTYPE), torch.arange(context), rope)
    return keys, torch.randn(context, H_KV, HEAD_DIM, generator=g).to(DTYPE)


def decode_inputs(batch: int, steps: int) -> list[tuple[torch.Tensor, ...]]:
    """Per step: queries [B, 32, 128] drifting from the previous step's, new K/V [B, 8, 128]."""
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, H_Q, HEAD_DIM, generator=g)
    inputs = []
    for _ in range(steps):
        q = DRIFT * q + (1 - DRIFT ** 2) ** 0.5 * torch.randn(q.shape, generator=g)
        k, v = torch.randn(2, batch, H_KV, HEAD_DIM, generator=g).to(DTYPE)
        inputs.append((q.to(DTYPE), k, v))
    return inputs


@contextlib.contextmanager
def one_thread():
    """For the (untimed) compression: with 2 OpenMP threads on a shared 2-core machine, its
    float64 eigh was seen to stall for seconds (0.4 s alone at 8K, 17 s beside a test run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- the two layers -----------------------------------------------------------------------------
class DenseLayer:
    """vLLM's CPU paged cache holding ``n`` requests of the same prompt (block 0: the null
    block); ``step(batch)`` decodes the first ``batch`` of them at context + 1 tokens."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n: int):
        self.context = len(keys)
        self.isa = exact_attention._vllm_cpu_isa(DTYPE, HEAD_DIM)  # asks for AMX too
        per_request = -(-(self.context + 1) // BLOCK)
        cache = torch.empty(1 + n * per_request, H_KV, BLOCK, 2 * HEAD_DIM, dtype=DTYPE)
        # As CPUAttentionBackendImpl.forward splits it: [blocks, h, 2 * block, d] -> K, V.
        self.k_cache, self.v_cache = cache.view(len(cache), H_KV, 2 * BLOCK, -1).chunk(2, dim=2)
        self.block_table = 1 + torch.arange(n * per_request, dtype=torch.int32).view(n, -1)
        positions = torch.arange(self.context + 1)
        self.slots = self.block_table[:, positions // BLOCK].long() * BLOCK + positions % BLOCK
        for row in self.slots:
            ops.cpu_attn_reshape_and_cache(keys, values, self.k_cache, self.v_cache,
                                           row[: self.context], self.isa)

    def step(self, batch: int):
        seq_lens = torch.full((batch,), self.context + 1, dtype=torch.int32)
        query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=batch, num_heads=H_Q, num_kv_heads=H_KV, head_dim=HEAD_DIM,
            seq_lens=seq_lens, dtype=DTYPE, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype="auto")
        slot_mapping, block_table = self.slots[:batch, self.context], self.block_table[:batch]
        out = torch.empty(batch, H_Q, HEAD_DIM, dtype=DTYPE)

        def run(q, k, v):
            ops.cpu_attn_reshape_and_cache(k, v, self.k_cache, self.v_cache, slot_mapping,
                                           self.isa)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=self.k_cache, value_cache=self.v_cache, output=out,
                query_start_loc=query_start_loc, seq_lens=seq_lens, scale=SCALE, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0,
                scheduler_metadata=metadata, s_aux=None, kv_cache_dtype="auto")
            return out
        return run


class ShadowKVLayer:
    """``n`` compressed requests of the same prompt in the engine's pages, each with its own
    region and generated-token pages after staging pages they share (staging is only read by
    ``finalize``, and the engine frees it after); ``step(batch)`` decodes the first ``batch``."""

    def __init__(self, keys, values, rope, n: int, max_steps: int, progress):
        self.context = context = len(keys)
        shapes = KVShapes(H_KV, HEAD_DIM, DTYPE, BLOCK, num_layers=1,
                          max_model_len=context + max_steps)
        self.layout = layout = PageLayout(ShadowKVMethod(SETTINGS.resolved(shapes), shapes))
        self.method = layout.method
        staging = layout.exact_blocks(context)
        own = layout.blocks_needed(context, context + max_steps) - staging
        cache = torch.zeros(1 + staging + n * own, 1, BLOCK, layout.page_bytes // BLOCK // ELT,
                            dtype=DTYPE)
        self.block_ids = [torch.cat((torch.arange(1, 1 + staging),
                                     1 + staging + i * own + torch.arange(own))) for i in range(n)]
        self.stats = {f"r{i}": RequestStats(mode="sparse", prompt_len=context) for i in range(n)}
        store = CpuValueStore(n * layout.store_bytes(context), DTYPE,
                              (SETTINGS.chunk_size, HEAD_DIM), pin_memory=False)
        self.ctx = LayerContext(index=0, kv_cache=cache, layout=layout, rope=rope, store=store,
                                store_for=None, scale=SCALE, stats=self.stats.__getitem__,
                                reference_kv={})
        positions = torch.arange(context)
        exact_attention.write_exact(
            cache, layout, *layout.exact_token_slots(context, self.block_ids[0], positions),
            keys, values)
        keys, values = exact_attention.read_exact(cache, layout, context, self.block_ids[0],
                                                  positions)  # as the engine's finalize does
        start = time.perf_counter()
        with one_thread():
            for i, (req_id, ids) in enumerate(zip(self.stats, self.block_ids)):
                progress(f"compress {i + 1}/{n}")
                self.method.finalize(self.ctx, RequestRows(req_id, context, context, 0, 0, ids),
                                     keys, values)
        self.compress_s = (time.perf_counter() - start) / n
        self.seq_lens = [context] * n

    def step(self, batch: int):
        reqs, blocks, slots = [], [], []
        for i, req_id in enumerate(list(self.stats)[:batch]):
            pos = self.seq_lens[i]
            self.seq_lens[i] += 1
            reqs.append(RequestRows(req_id, self.context, pos + 1, i, i + 1, self.block_ids[i]))
            block, slot = self.layout.exact_token_slots(self.context, self.block_ids[i],
                                                        torch.tensor([pos]))
            blocks.append(block)
            slots.append(slot)
        blocks, slots = torch.cat(blocks), torch.cat(slots)
        out = torch.empty(batch, H_Q, HEAD_DIM, dtype=DTYPE)

        def run(q, k, v):
            exact_attention.write_exact(self.ctx.kv_cache, self.layout, blocks, slots, k, v)
            self.method.decode(self.ctx, reqs, q, k, v, out)
            return out
        return run

    def counters(self, batch: int) -> tuple[int, int]:
        """(selected, hits) summed over the first ``batch`` requests."""
        stats = list(self.stats.values())[:batch]
        return sum(s.selected for s in stats), sum(s.hits for s in stats)


# -- measurements -------------------------------------------------------------------------------
def run_steps(layer, batch: int, inputs) -> tuple[list[float], bool]:
    """Wall time of each step's per-layer work, and whether every output was finite."""
    times, finite = [], True
    for q, k, v in inputs:
        run = layer.step(batch)
        start = time.perf_counter()
        out = run(q, k, v)
        times.append(time.perf_counter() - start)
        finite &= bool(out.isfinite().all())
    return times, finite


def measure(layer, batch: int, inputs, warmup: int) -> dict:
    run_steps(layer, batch, inputs[:warmup])
    times, finite = run_steps(layer, batch, inputs[warmup:])
    return {"ms": 1e3 * statistics.median(times), "finite": finite, "steps": len(times)}


def measure_shadowkv(layer: ShadowKVLayer, batch: int, inputs, warmup: int) -> dict:
    """``measure``, and the hit rate, misses and generated tokens per request of the timed
    steps."""
    run_steps(layer, batch, inputs[:warmup])
    selected_before, hits_before = layer.counters(batch)
    result = measure(layer, batch, inputs[warmup:], warmup=0)
    selected, hits = layer.counters(batch)
    selected, hits = selected - selected_before, hits - hits_before
    result.update(hit_rate=hits / max(selected, 1),
                  misses=(selected - hits) / (result["steps"] * batch),
                  generated=sum(layer.seq_lens[:batch]) / batch - layer.context)
    return result


def step_bytes(layout: PageLayout, context: int, batch: int, misses: float,
               generated: float) -> dict:
    """Bytes one step reads (see the module docstring), for ``batch`` requests with ``misses``
    missed (KV head, chunk) pairs and ``generated`` tokens each."""
    s = layout.method.settings
    st = layout.method.pages.state(context)
    landmarks = (s.params.compressed_chunks(context) - st.num_outliers) * H_KV * ROW
    slots = 2 * H_KV * st.num_slots * s.chunk_size * ROW
    exact = 2 * H_KV * st.exact_tokens * ROW
    gen = 2 * H_KV * generated * ROW
    missed = misses * s.chunk_size * (s.rank * ELT + ROW)  # A rows + values
    b, ids = H_KV * s.rank * ROW, H_KV * (st.num_outliers + st.num_slots) * 4
    minimum = landmarks + slots + exact + gen + missed
    per_request = {"minimum": minimum, "structure": minimum + b + ids,
                   "copies": landmarks + slots + exact + gen + b}
    out = {"dense": batch * context * 2 * H_KV * ROW}
    out.update({f"shadowkv_{k}": int(batch * v) for k, v in per_request.items()})
    return out


@contextlib.contextmanager
def labelled_stages():
    """Each function of STAGES runs inside ``record_function("stage: <name>")``."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in STAGES]

    def labelled(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with record_function(f"stage: {name}"):
                return fn(*args, **kwargs)
        return wrapper

    for owner, name, fn in saved:
        setattr(owner, name, labelled(name, fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def profile(context: int, batch: int, warmup: int, rope, path: Path) -> None:
    keys, values = prompt_kv(context, rope)
    layer = ShadowKVLayer(keys, values, rope, batch, warmup + PROFILE_STEPS, lambda _: None)
    del keys, values
    inputs = decode_inputs(batch, warmup + PROFILE_STEPS)
    run_steps(layer, batch, inputs[:warmup])
    with labelled_stages(), torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        for q, k, v in inputs[warmup:]:
            run = layer.step(batch)
            with record_function(STEP_LABEL):
                run(q, k, v)
    path.write_text(profile_report(prof.key_averages(), context, batch, warmup))


def profile_report(averages, context: int, batch: int, warmup: int) -> str:
    by_key = {e.key: e for e in averages}
    total = by_key[STEP_LABEL].cpu_time_total
    lines = [f"shadowkv decode step, one layer: context {context}, batch {batch}, "
             f"{PROFILE_STEPS} steps after {warmup} warm-up, {torch.get_num_threads()} threads",
             f"{total / PROFILE_STEPS / 1e3:.2f} ms per step (under the profiler)", "",
             f"{'stage':<20} {'ms/step':>8} {'% step':>7} {'calls':>5}  what"]
    staged = 0.0
    for _, name, what in STAGES:
        event = by_key.get(f"stage: {name}")
        spent, calls = (event.cpu_time_total, event.count) if event else (0.0, 0)
        staged += spent
        lines.append(f"{name:<20} {spent / PROFILE_STEPS / 1e3:>8.2f} {100 * spent / total:>6.1f}% "
                     f"{calls / PROFILE_STEPS:>5.0f}  {what}")
    rest = total - staged
    lines += [f"{'(rest)':<20} {rest / PROFILE_STEPS / 1e3:>8.2f} {100 * rest / total:>6.1f}%"
              "         plans, masks, stats", "", "ops, top 20 by self CPU time:",
              EventList([e for e in averages if e.key != STEP_LABEL
                         and not e.key.startswith("stage: ")])
              .table(sort_by="self_cpu_time_total", row_limit=20)]
    return "\n".join(lines) + "\n"


# -- report -------------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name:")]
    return names[0] if names else "unknown CPU"


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    contexts = sorted({r["context"] for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({r["batch"] for r in rows}):
        pts = [r for r in rows if r["batch"] == batch]
        left.plot([p["context"] // 1024 for p in pts], [p["speedup"] for p in pts], marker="o",
                  label=f"batch {batch}")
    left.axhline(3.0, color="grey", ls="--", lw=0.8, label="goal at 128K: 3x")
    left.set_xscale("log", base=2)
    left.set_xticks([c // 1024 for c in contexts], [f"{c // 1024}K" for c in contexts])
    left.set_xlabel("context per request")
    left.set_ylabel("vLLM CPU attention time / shadowkv time")
    left.legend()
    first = {r["context"]: r for r in rows if r["batch"] == min(x["batch"] for x in rows)}
    width = 0.25
    for i, (key, label) in enumerate((("dense", "dense"), ("shadowkv_structure", "shadowkv"),
                                      ("shadowkv_minimum", "shadowkv minimum"))):
        right.bar([j + (i - 1) * width for j in range(len(contexts))],
                  [first[c]["bytes"][key] / first[c]["batch"] / 2 ** 20 for c in contexts],
                  width, label=label)
    right.set_xticks(range(len(contexts)), [f"{c // 1024}K" for c in contexts])
    right.set_yscale("log")
    right.set_ylabel("MiB read per step and request")
    right.legend()
    fig.suptitle(f"One attention layer's decode step, Llama-3.1-8B shapes, bf16, "
                 f"{meta['machine']}, {meta['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(rows: list[dict]) -> None:
    print(f"{'context':>8} {'batch':>5} {'dense ms':>9} {'skv ms':>8} {'speedup':>7} "
          f"{'hit':>5} {'dense MiB':>9} {'skv MiB':>8} {'min MiB':>8} {'d/skv':>6} {'skv/min':>7}")
    for r in rows:
        b = r["bytes"]
        print(f"{r['context']:>8} {r['batch']:>5} {r['dense_ms']:>9.2f} {r['shadowkv_ms']:>8.2f} "
              f"{r['speedup']:>7.2f} {r['hit_rate']:>5.2f} {b['dense'] / 2**20:>9.1f} "
              f"{b['shadowkv_structure'] / 2**20:>8.2f} {b['shadowkv_minimum'] / 2**20:>8.2f} "
              f"{r['dense_over_shadowkv_bytes']:>6.1f} {r['structure_over_minimum']:>7.3f}")


def main() -> None:
    global SETTINGS, DRIFT
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--reps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--profile-context", type=int, default=32768, help="0: no profile")
    parser.add_argument("--profile-batch", type=int, default=4)
    parser.add_argument("--drift", type=float, default=DRIFT,
                        help="query correlation between steps (0: independent, the engine's "
                             "random-token prompts: hit rate about 0.03)")
    parser.add_argument("--sparse-budget", type=int, default=SETTINGS.sparse_budget,
                        help="tokens selected per KV head (the paper's 2048 is 1.56 %% of 128K)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("layer_decode"))
    args = parser.parse_args()
    SETTINGS = dataclasses.replace(SETTINGS, sparse_budget=args.sparse_budget)
    DRIFT = args.drift
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine's impl does in its worker (both backends run under it)
    args.out.mkdir(parents=True, exist_ok=True)
    batches = sorted(args.batches)
    steps = args.warmup + args.reps
    rope = llama_rope(max(args.contexts + [args.profile_context]) + len(batches) * steps + 64)
    wall = time.perf_counter()
    rows = []
    bar = tqdm(total=2 * len(args.contexts) * len(batches), desc="layer decode", unit="config")
    for context in args.contexts:
        keys, values = prompt_kv(context, rope)
        dense = DenseLayer(keys, values, batches[-1])
        results = {}
        for batch in batches:
            bar.set_description(f"{context // 1024}K dense batch {batch}")
            results[batch] = {"dense": measure(dense, batch, decode_inputs(batch, steps),
                                               args.warmup)}
            bar.update()
        del dense
        bar.set_description(f"{context // 1024}K shadowkv")
        skv = ShadowKVLayer(keys, values, rope, batches[-1], len(batches) * steps,
                            bar.set_postfix_str)
        del keys, values
        for batch in batches:
            bar.set_description(f"{context // 1024}K shadowkv batch {batch}")
            bar.set_postfix_str("")
            sparse = measure_shadowkv(skv, batch, decode_inputs(batch, steps), args.warmup)
            dense_ms = results[batch]["dense"]["ms"]
            nbytes = step_bytes(skv.layout, context, batch, sparse["misses"],
                                sparse["generated"])
            rows.append({
                "context": context, "batch": batch, "dense_ms": dense_ms,
                "shadowkv_ms": sparse["ms"], "speedup": dense_ms / sparse["ms"],
                "hit_rate": sparse["hit_rate"], "misses_per_request_step": sparse["misses"],
                "bytes": nbytes,
                "dense_over_shadowkv_bytes": nbytes["dense"] / nbytes["shadowkv_structure"],
                "structure_over_minimum": (nbytes["shadowkv_structure"]
                                           / nbytes["shadowkv_minimum"]),
                "copies_over_minimum": nbytes["shadowkv_copies"] / nbytes["shadowkv_minimum"],
                "finite": {"dense": results[batch]["dense"]["finite"],
                           "shadowkv": sparse["finite"]},
                "compress_s_per_request": skv.compress_s})
            bar.update()
        del skv
    bar.close()
    if args.profile_context:
        name = f"profile_{args.profile_context // 1024}k.txt"
        print(f"profiling {PROFILE_STEPS} shadowkv steps -> {args.out / name}")
        profile(args.profile_context, args.profile_batch, args.warmup, rope, args.out / name)
    meta = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_layer_decode.py",
                             *sys.argv[1:]]),
        "machine": f"{os.cpu_count()}-core {cpu_name()} ({platform.machine()})",
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "vllm": vllm.__version__, "threads": args.threads,
        "isa": exact_attention._vllm_cpu_isa(DTYPE, HEAD_DIM),
        "heads": [H_Q, H_KV, HEAD_DIM], "dtype": str(DTYPE), "block_size": BLOCK,
        "settings": SETTINGS.resolved(KVShapes(H_KV, HEAD_DIM, DTYPE, BLOCK, 1, 0)).as_dict(),
        "reps": args.reps, "warmup": args.warmup, "query_drift": DRIFT,
        "wall_s": round(time.perf_counter() - wall, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}
    (args.out / "cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, meta, args.out / "cpu.png")
    print_table(rows)
    print(f"wrote {args.out / 'cpu.json'}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
