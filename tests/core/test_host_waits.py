"""The sparse decode's host waits: on CUDA, one device-to-host copy per layer and step (the
missed chunks, which the host gathers from its store) and no other read of device data.
Counted on the CPU (tests/host_waits.py) along the path CUDA runs: the Triton kernels,
interpreted."""

import contextlib
import dataclasses

import pytest
import torch

from vllm_shadowkv.backend.exact_attention import write_exact
from vllm_shadowkv.backend.worker_state import RequestStats
from vllm_shadowkv.core import ops, transfer
from vllm_shadowkv.core.decode import DecodeBatch, decode_step
from vllm_shadowkv.core.params import ShadowKVParams
from vllm_shadowkv.core.rope import apply_rope
from vllm_shadowkv.core.store import InMemoryValueStore
from vllm_shadowkv.methods.base import RequestRows

from core_ragged import compress_prompts
from core_rope_util import default_rope
from host_waits import CudaHostWaits, HostWaits
from pages_util import context, make_layout, rope_for


def _in_package(source: str, **names) -> None:
    """Run ``source`` as if it were written in the package (the counter looks at the calling
    file)."""
    exec(compile(source, ops.__file__, "exec"), names)


def test_the_counter_sees_reads_of_device_data_and_not_of_host_copies():
    t = torch.arange(6)
    with HostWaits() as waits:
        _in_package("int(t.max()); t.tolist(); t[t > 2]; t.nonzero(); t.repeat_interleave(t); "
                    "t.repeat_interleave(t, output_size=15)", t=t)
    assert len(waits.reads) == 5 and waits.copies == 0, waits.reads
    with HostWaits() as waits:
        _in_package("h = HostCopy([t]).wait()[0]; int(h.max()); h.tolist(); h[h > 2]; "
                    "(h + 1).nonzero()", t=t, HostCopy=transfer.HostCopy)
    assert waits.reads == [] and waits.copies == 1


def test_decode_step_reads_the_device_once_per_step(interpreted):
    h_kv, group, d = 2, 4, 64
    lengths = [520, 300]
    torch.manual_seed(0)
    rope = default_rope(d, 4096)
    pos = [torch.arange(n) for n in lengths]
    keys = [apply_rope(torch.randn(n, h_kv, d), p, rope).bfloat16() for n, p in zip(lengths, pos)]
    values = [torch.randn(n, h_kv, d).bfloat16() for n in lengths]
    params = ShadowKVParams(rank=32, chunk_size=8, sparse_budget=64, outlier_chunks=2,
                            local_chunks=2, min_compress_tokens=100)
    ids, store = ["a", "b"], InMemoryValueStore()
    prompts = compress_prompts(torch.cat(keys), torch.cat(values), torch.cat(pos),
                               [0, lengths[0], sum(lengths)], rope, params, store, ids)
    batch = DecodeBatch.build(prompts, ids, rope, params)
    for step in range(3):
        q = torch.randn(2, 1, h_kv * group, d).bfloat16()
        k_new, v_new = torch.randn(2, 2, 1, h_kv, d).bfloat16()
        with ops.force_triton(), HostWaits() as waits:
            decode_step(batch, q, k_new, v_new, store)
        assert waits.reads == [] and waits.copies == 1, (step, waits.reads)
        assert sum(batch.step_misses) > 0  # (the copy carried misses to gather)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs CUDA"))])
def test_engine_decode_reads_the_device_once_per_layer_and_step(device, request):
    """ShadowKV's ``decode`` as the engine calls it, two layers per step, a ragged batch: the
    batch's plan (first step) and the step's index tensors are built in the first layer,
    every layer copies its misses to the host once, and nothing else is read from the
    device. On the CPU counted along the interpreted kernels' path; on CUDA by CUDA's sync
    debug mode, from the second step (the first builds the batch's plan: host-to-device copies
    of its index tensors)."""
    if device == "cpu":
        request.getfixturevalue("interpreted")  # the CPU case runs the kernels interpreted
    g = torch.Generator().manual_seed(5)
    h, hq, d, steps = 2, 8, 32, 3
    prompts = {"a": 600, "b": 777}
    layout = make_layout(dtype=torch.bfloat16)
    method, rope = layout.method, rope_for()
    lengths = {r: p + steps for r, p in prompts.items()}
    needed = {r: layout.blocks_needed(p, lengths[r]) for r, p in prompts.items()}
    cache = torch.zeros(sum(needed.values()) + 1, 1, layout.block_size,
                        layout.page_bytes // layout.block_size // 2, dtype=torch.bfloat16,
                        device=device)
    ids = (torch.randperm(len(cache) - 1, generator=g) + 1).to(device).split(
        list(needed.values()))
    blocks = dict(zip(prompts, ids))
    kv = {r: (apply_rope(torch.randn(n, h, d, generator=g), torch.arange(n), rope).bfloat16()
              .to(device), torch.randn(n, h, d, generator=g).bfloat16().to(device))
          for r, n in lengths.items()}
    rope = rope.to(device)
    layers = [dataclasses.replace(context(cache.clone(), layout, rope, _store(device, layout),
                                          RequestStats()), index=i) for i in range(2)]
    for r, p in prompts.items():
        for ctx in layers:
            k, v = kv[r]
            write_exact(ctx.kv_cache, layout, *layout.exact_token_slots(
                p, blocks[r], torch.arange(p, device=device)), k[:p], v[:p])
            method.finalize(ctx, RequestRows(r, p, p, 0, 0, blocks[r]), k[:p], v[:p])
    positions = {r: torch.arange(p, p + steps, device=device).view(-1, 1)
                 for r, p in prompts.items()}
    queries = torch.randn(steps, 2, hq, d, generator=g).bfloat16().to(device)
    for step in range(steps):
        reqs = [RequestRows(r, p, p + step + 1, i, i + 1, blocks[r])
                for i, (r, p) in enumerate(prompts.items())]
        new = [(kv[r][0][p + step: p + step + 1], kv[r][1][p + step: p + step + 1])
               for r, p in prompts.items()]
        key, value = (torch.cat(t) for t in zip(*new))
        metadata = object()  # the engine's metadata: one object per step
        counter = HostWaits() if device == "cpu" else CudaHostWaits()
        mode = ops.force_triton() if device == "cpu" else contextlib.nullcontext()
        if device == "cuda" and step == 0:
            counter = contextlib.nullcontext(counter)
        with mode, counter as waits:
            for ctx in layers:
                for req, (k, v) in zip(reqs, new):
                    write_exact(ctx.kv_cache, layout, *layout.exact_token_slots(
                        req.prompt_len, req.block_ids, positions[req.req_id][step]), k, v)
                out = torch.zeros(2, hq, d, dtype=torch.bfloat16, device=device)
                method.decode(dataclasses.replace(ctx, step=metadata), reqs, queries[step],
                              key, value, out)
        if device == "cpu" or step > 0:
            assert waits.reads == [] and waits.copies == len(layers), (step, waits.reads)


def _store(device: str, layout):
    if device == "cpu":
        return InMemoryValueStore()
    from vllm_shadowkv.store import CpuValueStore

    row = (layout.method.settings.chunk_size, layout.shapes.head_size)
    return CpuValueStore(1 << 24, layout.shapes.dtype, row, pin_memory=True)
