"""The engine's step for a method with a generated-token ring (MiniKV), without vLLM's model
runner: a recomputed request (vLLM's way back from preemption) prefills a chunk that crosses its
prompt end with more generated tokens than the ring holds. The engine writes the first ring
segment, decodes the generated rows compressed one ring segment at a time, and the result equals
generating those tokens one step at a time."""

import functools
from types import SimpleNamespace

import pytest
import torch

from vllm_shadowkv.backend.attention import (EngineImpl, EngineMetadataBuilder,
                                             cpu_lengths_exact)
from vllm_shadowkv.backend.exact_attention import write_exact
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.backend.worker_state import STATE
from vllm_shadowkv.methods.base import KVShapes, LayerContext
from vllm_shadowkv.methods.minikv import MiniKVMethod, MiniKVSettings

H, HQ, D, PROMPT, RESIDUAL = 2, 8, 64, 150, 16
# A step's lengths as only a device holds them: reading one would wait for the device (on a
# meta tensor it raises), which the builder does only where the CPU's are not exact.
DEVICE_ONLY = torch.empty(1, dtype=torch.int32, device="meta")


class Engine:
    """Two layers' pages for one request, stepped through the engine's builder and ``_run``
    (the same K/V in both layers; their pages differ under the pyramid)."""

    def __init__(self, settings: MiniKVSettings, total: int, seed: int = 0, layers: int = 2):
        shapes = KVShapes(H, D, torch.float32, 16, num_layers=layers, max_model_len=1024)
        self.method = MiniKVMethod(settings, shapes)
        self.layout = PageLayout(self.method)
        g = torch.Generator().manual_seed(seed)
        n = self.layout.blocks_needed(PROMPT, total)
        self.block_ids = torch.randperm(n + 4, generator=g)[:n] + 1
        self.q = torch.randn(total, HQ, D, generator=g)
        self.k = torch.randn(total, H, D, generator=g)
        self.v = torch.randn(total, H, D, generator=g)
        self.ctxs = [LayerContext(index=layer, layout=self.layout, rope=None, store=None,
                                  kv_cache=torch.zeros(n + 5, 1, 16,
                                                       self.method.token_bytes(layer) // 4),
                                  store_for=None, scale=D ** -0.5,
                                  stats=STATE.requests.__getitem__, reference_kv={})
                     for layer in range(layers)]
        self.impl = SimpleNamespace(scale=D ** -0.5, _ring_rounds=EngineImpl._ring_rounds)
        self.impl._finalize = functools.partial(EngineImpl._finalize, self.impl)
        self.impl._phases = functools.partial(EngineImpl._phases, self.impl)

    def step(self, first: int, end: int, guess: tuple[torch.Tensor, ...] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions [first, end) of the request in one engine step, and ``guess`` (query, key,
        value) as a guess row after them; its output rows in each layer and the rows the KV
        write covered."""
        builder = EngineMetadataBuilder.__new__(EngineMetadataBuilder)
        builder.layout, builder.cpu_lens_exact = self.layout, True
        q, k, v = self.q[first:end], self.k[first:end], self.v[first:end]
        if guess is not None:
            q, k, v = (torch.cat([t, g[None]]) for t, g in zip((q, k, v), guess))
        n = len(q)
        STATE.guesses = {"r": 1} if guess is not None else {}
        common = SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, n]),
                                 seq_lens_cpu_upper_bound=torch.tensor([first + n]),
                                 seq_lens=DEVICE_ONLY, num_actual_tokens=n,
                                 block_table_tensor=self.block_ids[None])
        metadata = builder.build(0, common)
        rows = metadata.write_rows
        written = slice(0, n) if rows is None else rows
        outs = []
        for ctx in self.ctxs:
            write_exact(ctx.kv_cache, self.layout, metadata.write_blocks, metadata.write_slots,
                        k[written], v[written])
            outs.append(torch.zeros(n, HQ, D))
            EngineImpl._run(self.impl, metadata, ctx, q, k, v, outs[-1])
        return torch.stack(outs, dim=1), rows


@pytest.fixture
def one_request(monkeypatch):
    monkeypatch.setattr(STATE, "batch_requests", lambda num_reqs: (["r"], [PROMPT]))
    yield
    STATE.release(["r"])
    STATE.guesses = {}


@pytest.mark.parametrize("bits, policy", [(2, "pyramid"), (16, "uniform")])
def test_a_recomputed_chunk_past_the_ring_equals_step_by_step_generation(bits, policy,
                                                                         one_request):
    """(Under the uniform policy both layers share one plan: the first layer's decode extends
    it before the second layer finalizes in the same step.)"""
    settings = MiniKVSettings(bits=bits, layer_policy=policy, min_sparse_len=100,
                              residual=RESIDUAL)
    total = PROMPT + 5 * RESIDUAL + 7
    stepwise, recomputed = Engine(settings, total), Engine(settings, total)
    want = [stepwise.step(0, 100)[0], stepwise.step(100, PROMPT)[0]]
    want += [stepwise.step(s - 1, s)[0] for s in range(PROMPT + 1, total - 4)]

    got = [recomputed.step(0, 100)[0]]
    crossing, rows = recomputed.step(100, PROMPT + 3 * RESIDUAL + 2)  # 50 generated tokens
    assert rows.tolist() == list(range(PROMPT + RESIDUAL - 100))  # the first ring segment
    got += [crossing, recomputed.step(PROMPT + 3 * RESIDUAL + 2, total - 5)[0]]
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=2e-5, rtol=2e-5)
    # The ring after the long steps holds what step-by-step generation left there.
    for s in range(total - 4, total + 1):
        torch.testing.assert_close(recomputed.step(s - 1, s)[0], stepwise.step(s - 1, s)[0],
                                   atol=2e-5, rtol=2e-5)


def test_guess_rows_are_never_written_nor_folded(one_request):
    """Every decode step with a guess row after the output row (SpeCache's second query row),
    through two folds of the ring: a step whose output row fills the ring is one decode call
    writing the output row only (the guess row's large K/V would show in the pages), and the
    committed rows' outputs and the pages are those of plain steps."""
    settings = MiniKVSettings(min_sparse_len=100, residual=RESIDUAL)
    total = PROMPT + 2 * RESIDUAL + 3
    plain, guessing = Engine(settings, total), Engine(settings, total)
    g = torch.Generator().manual_seed(5)
    for engine in (plain, guessing):
        engine.step(0, 100)
        engine.step(100, PROMPT)
    for s in range(PROMPT + 1, total + 1):
        want = plain.step(s - 1, s)[0]
        guess = (torch.randn(HQ, D, generator=g), 1e3 * torch.randn(H, D, generator=g),
                 torch.randn(H, D, generator=g))
        got, rows = guessing.step(s - 1, s, guess)
        assert rows.tolist() == [0]  # the output row only
        torch.testing.assert_close(got[:1], want, atol=2e-5, rtol=2e-5)
    for a, b in zip(plain.ctxs, guessing.ctxs):
        assert torch.equal(a.kv_cache.view(torch.int32), b.kv_cache.view(torch.int32))


@pytest.mark.parametrize("async_scheduling, speculative, exact", [
    (False, None, True), (True, None, True), (False, {"method": "ngram"}, True),
    (True, {"method": "eagle"}, False)])
def test_step_lengths_are_read_from_the_cpu_where_exact(async_scheduling, speculative, exact,
                                                       one_request):
    """The builder reads vLLM's CPU copy of the lengths (no host wait on a GPU), except under
    async speculative decoding, where that copy assumes every draft was accepted."""
    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
                             speculative_config=speculative)
    assert cpu_lengths_exact(config) is exact
    builder = EngineMetadataBuilder.__new__(EngineMetadataBuilder)
    builder.layout = Engine(MiniKVSettings(), PROMPT + 1).layout
    builder.cpu_lens_exact = exact
    lens = torch.tensor([PROMPT + 1])
    common = SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, 1]),
                             seq_lens_cpu_upper_bound=lens if exact else DEVICE_ONLY,
                             seq_lens=DEVICE_ONLY if exact else lens, num_actual_tokens=1,
                             block_table_tensor=torch.arange(1, 1000)[None])
    assert builder.build(0, common).seq_lens == [PROMPT + 1]
