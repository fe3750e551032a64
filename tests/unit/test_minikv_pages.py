"""MiniKV on the engine's pages, through the method's hooks, without vLLM: page sizes and
vLLM's block counts, the kept tokens and their groups as read back from permuted pages, decode
against an independent reference (selection, KIVI round trip, generated tokens folded every
``residual``), and one batched decode call against each request alone."""

import pytest
import torch

from vllm_shadowkv.backend.exact_attention import causal_attention, write_exact
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.backend.worker_state import RequestStats
from vllm_shadowkv.config import parse_settings
from vllm_shadowkv.core import ops
from vllm_shadowkv.core.attention import attention_with_lse_reference
from vllm_shadowkv.core.heavy_hitters import accumulate_column_sums, select_heavy_hitters
from vllm_shadowkv.core.kivi import KiviFormat, dequantize_groups, quantize_groups
from vllm_shadowkv.methods.base import KVShapes, LayerContext, RequestRows, SettingsError
from vllm_shadowkv.methods.minikv import MiniKVMethod, MiniKVSettings
from vllm_shadowkv.methods.minikv import method as minikv_method

LLAMA8B = {"kv_heads": 8, "head": 128, "dtype": torch.bfloat16}


def make_method(settings: MiniKVSettings, h=2, d=64, block_size=16, num_layers=1,
                dtype=torch.float32, max_len=4096) -> MiniKVMethod:
    shapes = KVShapes(h, d, dtype, block_size, num_layers=num_layers, max_model_len=max_len)
    settings.check_engine(shapes)
    return MiniKVMethod(settings.resolved(shapes), shapes)


# --- sizes --------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("context", [32768, 131072])
def test_llama8b_shapes_hold_7x_the_default_backends_requests(block_size, context):
    """The paper's defaults (2 bits, 25 % pyramid heavy hitters + 25 % recent) at 32 layers of
    Llama-3.1-8B: the pages one max-length prompt holds after compression, in the bytes of
    vLLM's blocks (every layer's page), against 4 KiB per token and layer exact."""
    method = make_method(MiniKVSettings(), LLAMA8B["kv_heads"], LLAMA8B["head"], block_size,
                         num_layers=32, dtype=LLAMA8B["dtype"], max_len=context)
    layout = PageLayout(method)
    block_bytes = block_size * sum(method.token_bytes(layer) for layer in range(32))
    ratio = context * 4096 * 32 / (layout.steady_blocks(context) * block_bytes)
    assert ratio >= 7.0
    # The pyramid: the first layer keeps most (46 % + 25 %), the last least (3.6 % + 25 %).
    token_bytes = [method.token_bytes(layer) for layer in range(32)]
    assert token_bytes == sorted(token_bytes, reverse=True) and token_bytes[0] > token_bytes[-1]


def test_uniform_budget_is_8x_and_pages_are_whole_units():
    """50 % of the tokens at 2 bits (1 KiB per kept token and layer at 8B shapes): 512 B per
    prompt token, exactly 8x; a page is whole 2 KiB units (one group of one KV head)."""
    method = make_method(MiniKVSettings(layer_policy="uniform"), 8, 128, 16, num_layers=2,
                         dtype=torch.bfloat16, max_len=131072)
    assert method.pages.unit_bytes == 2048 and method.token_bytes(0) == 512
    assert method.pages.units_per_page(0) == 4
    layout = PageLayout(method)
    assert layout.steady_blocks(131072) * 16 * 512 * 8 == 131072 * 4096


@pytest.mark.parametrize("settings", [
    MiniKVSettings(),
    MiniKVSettings(bits=4, layer_policy="uniform", heavy_ratio=0.1, recent_ratio=0.05),
    MiniKVSettings(**MiniKVMethod.covering_settings(256, 4096)),
])
def test_block_table_is_wide_enough_for_any_split_of_a_max_length_request(settings):
    """vLLM sizes the block table for ``peak_blocks + exact_blocks`` of max_model_len: every
    (prompt, generated) split must fit in it, growth pages included."""
    max_len = 4096
    method = make_method(settings, h=4, d=64, block_size=16, num_layers=4, max_len=max_len)
    layout = PageLayout(method)
    width = layout.peak_blocks(max_len) + layout.exact_blocks(max_len)
    for prompt_len in range(settings.min_sparse_len // 8, max_len, 97):
        sparse = method.is_sparse(prompt_len)
        assert layout.blocks_needed(prompt_len, max_len) <= width, (prompt_len, sparse)


def test_ring_segments_cut_where_the_ring_fills():
    method = make_method(MiniKVSettings(residual=32, min_sparse_len=100))
    layout = PageLayout(method)
    assert layout.ring_segments(200, 210, 211) == [(210, 211)]  # plain decoding
    assert layout.ring_segments(200, 100, 290) == [(100, 232), (232, 264), (264, 290)]
    assert layout.ring_segments(200, 240, 296) == [(240, 264), (264, 296)]
    assert layout.ring_segments(50, 0, 300) == [(0, 300)]  # not compressed: no ring


def test_settings_are_checked_with_the_allowed_values():
    with pytest.raises(SettingsError, match="bits must be one of 2, 4, 16"):
        parse_settings(MiniKVSettings, {"bits": 3})
    with pytest.raises(SettingsError, match="layer_policy must be one of 'pyramid', 'uniform'"):
        parse_settings(MiniKVSettings, {"layer_policy": "linear"})
    with pytest.raises(SettingsError, match=r"residual \(100\) must be a multiple of group_size"):
        parse_settings(MiniKVSettings, {"residual": 100})
    with pytest.raises(SettingsError, match=r"heavy_ratio must be in \[0, 1\]"):
        parse_settings(MiniKVSettings, {"heavy_ratio": 1.5})
    with pytest.raises(SettingsError, match="recent_ratio must be a number"):
        parse_settings(MiniKVSettings, {"recent_ratio": "half"})
    with pytest.raises(SettingsError, match="score_window must be >= 0, got -1"):
        parse_settings(MiniKVSettings, {"score_window": -1})
    with pytest.raises(SettingsError, match="pool must be odd .*got 4"):
        parse_settings(MiniKVSettings, {"pool": 4})
    settings = parse_settings(MiniKVSettings, {"group_size": 24, "residual": 48})
    with pytest.raises(SettingsError, match=r"group_size \(24\) must divide the head size "
                                            r"\(64\).*allowed here: \[1, 2, 4, 8, 16, 32, 64\]"):
        settings.check_engine(KVShapes(4, 64, torch.bfloat16, 16, 4, 4096))


# --- the hooks against an independent reference ---------------------------------------------

class World:
    """One layer's permuted pages holding several requests, and their random K/V / queries."""

    def __init__(self, method: MiniKVMethod, requests: dict[str, tuple[int, int]], hq=8,
                 seed=0):
        g = torch.Generator().manual_seed(seed)
        self.method, self.layout, self.requests = method, PageLayout(method), requests
        shapes = method.shapes
        h, d, dtype = shapes.num_kv_heads, shapes.head_size, shapes.dtype
        need = {r: self.layout.blocks_needed(p, p + n) for r, (p, n) in requests.items()}
        free = (torch.randperm(sum(need.values()) + 8, generator=g) + 1).tolist()
        self.cache = torch.zeros(len(free) + 1, 1, shapes.block_size,
                                 method.token_bytes(0) // shapes.elem_bytes, dtype=dtype)
        self.blocks, self.k, self.v, self.q, self.prompt = {}, {}, {}, {}, {}
        for r, (p, n) in requests.items():
            self.blocks[r] = torch.tensor([free.pop() for _ in range(need[r])])
            total = p + n
            k = torch.randn(total, h, d, generator=g)
            k[..., ::7] = k[..., ::7] * 4 + 3  # fixed outlier channels, as in real keys
            self.k[r], self.v[r] = k.to(dtype), torch.randn(total, h, d, generator=g).to(dtype)
            self.q[r] = torch.randn(total, hq, d, generator=g).to(dtype)
            self.prompt[r] = p
        self.stats = {r: RequestStats() for r in requests}
        self.reference_kept: dict[str, torch.Tensor] = {}
        self.ctx = LayerContext(index=0, kv_cache=self.cache, layout=self.layout, rope=None,
                                store=None, store_for=None, scale=d ** -0.5,
                                stats=self.stats.__getitem__, reference_kv={})

    def write(self, r: str, first: int, end: int) -> None:
        positions = torch.arange(first, end)
        blocks, slots = self.layout.exact_token_slots(self.prompt[r], self.blocks[r], positions)
        write_exact(self.cache, self.layout, blocks, slots, self.k[r][first:end],
                    self.v[r][first:end])

    def prefill(self, r: str, chunk: int) -> None:
        p = self.prompt[r]
        for c0 in range(0, p, chunk):
            c1 = min(p, c0 + chunk)
            self.write(r, c0, c1)
            rows = RequestRows(r, p, c1, 0, c1 - c0, self.blocks[r])
            self.method.prefill_chunk(self.ctx, rows, self.q[r][c0:c1], self.k[r][c0:c1],
                                      self.v[r][c0:c1])
        self.method.finalize(self.ctx, RequestRows(r, p, p, 0, 0, self.blocks[r]),
                             self.k[r][:p], self.v[r][:p])

    def step(self, lengths: dict[str, int]) -> dict[str, torch.Tensor]:
        """One decode call for the requests of ``lengths`` (request -> context length after
        the step, one new token each)."""
        rows, query = [], []
        for i, (r, s) in enumerate(lengths.items()):
            self.write(r, s - 1, s)
            rows.append(RequestRows(r, self.prompt[r], s, i, i + 1, self.blocks[r]))
            query.append(self.q[r][s - 1])
        q = torch.stack(query)
        k = torch.stack([self.k[r][s - 1] for r, s in lengths.items()])
        v = torch.stack([self.v[r][s - 1] for r, s in lengths.items()])
        out = torch.zeros_like(q)
        self.method.decode(self.ctx, rows, q, k, v, out)
        return {r: out[i] for i, r in enumerate(lengths)}


def reference_output(world: World, r: str, seq_len: int, fmt: KiviFormat | None):
    """Decode of the last token of ``seq_len`` recomputed from the K/V alone: H2O scores of
    the whole prompt (or its score window) in one pass, pooled, the kept tokens, KIVI round
    trip of whole groups (prompt and each folded ring), exact attention over all of it."""
    keys, values = reference_context(world, r, seq_len, fmt)
    return reference_attention(world, world.q[r][seq_len - 1], keys, values)


def reference_attention(world: World, query, keys, values):
    """One query row ``[hq, d]`` over keys, values ``[h, T, d]``."""
    out, _ = attention_with_lse_reference(query.view(1, 1, *query.shape), keys[None].float(),
                                          values[None].float(), None, world.ctx.scale)
    return out[0, 0]


def reference_context(world: World, r: str, seq_len: int, fmt: KiviFormat | None):
    """What the token at ``seq_len - 1`` attends, as ``reference_output`` builds it: keys and
    values ``[h, T, d]``."""
    m, p = world.method, world.prompt[r]
    s, h = m.settings, m.shapes.num_kv_heads
    k, v, q = world.k[r], world.v[r], world.q[r]
    kept = world.reference_kept.get(r)
    if kept is None:
        heavy, recent = m.pages.kept(0, p)
        if heavy + recent < p:
            first = max(0, p - s.score_window) if s.score_window else 0
            scores = accumulate_column_sums(None, q[first:p], k[:p], world.ctx.scale)
            kept = select_heavy_hitters(scores, p, heavy, recent, s.pool)
        else:
            kept = torch.arange(p).expand(h, -1)
        world.reference_kept[r] = kept
    index = kept.unsqueeze(-1).expand(-1, -1, k.shape[-1])
    parts = [(k[:p].transpose(0, 1).gather(1, index), v[:p].transpose(0, 1).gather(1, index))]
    folded = (seq_len - p - 1) // s.residual * s.residual
    ring = (k[p + folded: seq_len].transpose(0, 1), v[p + folded: seq_len].transpose(0, 1))
    for f0 in range(p, p + folded, s.residual):
        parts.append((k[f0:f0 + s.residual].transpose(0, 1), v[f0:f0 + s.residual]
                      .transpose(0, 1)))
    keys, values = [], []
    for pk, pv in parts:  # [h, n, d]
        n = pk.shape[1] // s.group_size * s.group_size if fmt else 0
        if n:
            dk, dv = dequantize_groups(quantize_groups(pk[:, :n].transpose(0, 1),
                                                       pv[:, :n].transpose(0, 1), fmt), fmt)
            keys.append(dk.transpose(0, 1))
            values.append(dv.transpose(0, 1))
        keys.append(pk[:, n:])
        values.append(pv[:, n:])
    return torch.cat(keys + [ring[0]], 1), torch.cat(values + [ring[1]], 1)


CASES = {
    "2 bits pyramid": MiniKVSettings(min_sparse_len=128, residual=32),
    "4 bits uniform": MiniKVSettings(bits=4, layer_policy="uniform", heavy_ratio=0.3,
                                     recent_ratio=0.1, min_sparse_len=128, residual=16),
    "16 bits": MiniKVSettings(bits=16, min_sparse_len=128, residual=16),
    # The last 100 prompt queries score the keys: a window over two prefill chunks.
    "score window": MiniKVSettings(score_window=100, min_sparse_len=128, residual=32),
    "score window, pooled": MiniKVSettings(score_window=100, pool=7, min_sparse_len=128,
                                           residual=32),
    # No heavy hitters: the recent window alone, and no column sums are computed for it.
    "recent window only": MiniKVSettings(heavy_ratio=0.0, recent_ratio=0.3,
                                         layer_policy="uniform", min_sparse_len=128,
                                         residual=32),
}


@pytest.mark.parametrize("mode", ["auto", "torch"])  # the 16-bit rows read in place by C, or
@pytest.mark.parametrize("case", list(CASES))       # gathered for the torch reference
def test_decode_from_pages_equals_the_reference(case, mode, monkeypatch):
    """Prefill in chunks (column sums accumulated, unless no heavy hitter is kept), finalize
    into permuted pages, then decode with two folds of the ring: each step equals the
    reference recomputed from scratch."""
    settings = CASES[case]
    method = make_method(settings, h=2, d=64, num_layers=3)
    p, gen = 301, 2 * settings.residual + 5
    world = World(method, {"r": (p, gen)})
    summed = []
    monkeypatch.setattr(minikv_method, "accumulate_column_sums",
                        lambda *a: summed.append(1) or accumulate_column_sums(*a))
    world.prefill("r", chunk=128)
    assert bool(summed) == (settings.heavy_ratio > 0)
    assert not method._scores  # the column sums are freed at finalize
    fmt = method.pages.fmt
    for s in range(p + 1, p + gen + 1):
        with ops.kernel_mode(mode):
            out = world.step({"r": s})["r"]
        want = reference_output(world, "r", s, fmt)
        torch.testing.assert_close(out.float(), want, atol=2e-5, rtol=2e-5)
    stats = world.stats["r"]
    heavy, recent = method.pages.kept(0, p)
    assert stats.decode_steps == gen and stats.selected == gen * 2 * (heavy + recent)
    if settings.bits != 16:
        assert heavy + recent < p  # really compressed


@pytest.mark.parametrize("mode", ["auto", "torch"])
@pytest.mark.parametrize("committed, guesses", [(1, 1), (2, 1), (1, 2)])
def test_guess_rows_see_what_the_last_committed_row_sees(committed, guesses, mode):
    """Steps of ``committed`` rows (in the pages) and ``guesses`` guess rows (their K/V the
    step's own, never written) for a ragged batch past folds of the ring, one request joining
    late and one finishing early: each committed row equals the plain step's reference, each
    guess row attends the last committed row's context and the guesses up to itself."""
    settings = MiniKVSettings(min_sparse_len=100, residual=16)
    method = make_method(settings, h=2, d=64, num_layers=1)
    requests = {"a": (150, 40), "b": (333, 36), "c": (212, 14)}
    world = World(method, requests, seed=5)
    for r in requests:
        world.prefill(r, chunk=100)
    g, fmt = torch.Generator().manual_seed(6), method.pages.fmt
    progress = dict.fromkeys(requests, 0)  # generated tokens in each context
    for step in range(20):
        live = {r: world.prompt[r] + n + committed for r, n in progress.items()
                if n + committed <= requests[r][1] and (r != "b" or step >= 4)}
        rows, q, k, v, want = [], [], [], [], {}
        for r, s in live.items():
            world.write(r, s - committed, s)
            gq, gk, gv = (torch.randn(guesses, *t[r].shape[1:], generator=g)
                          for t in (world.q, world.k, world.v))
            start = len(rows) * (committed + guesses)
            rows.append(RequestRows(r, world.prompt[r], s + guesses, start,
                                    start + committed + guesses, world.blocks[r],
                                    guess=guesses))
            q += [world.q[r][s - committed:s], gq]
            k += [world.k[r][s - committed:s], gk]
            v += [world.v[r][s - committed:s], gv]
            keys, values = reference_context(world, r, s, fmt)
            want[r] = [reference_output(world, r, s - committed + i + 1, fmt)
                       for i in range(committed)] + [
                reference_attention(world, gq[j], torch.cat([keys, gk[:j + 1].transpose(0, 1)], 1),
                                    torch.cat([values, gv[:j + 1].transpose(0, 1)], 1))
                for j in range(guesses)]
        q, k, v = torch.cat(q), torch.cat(k), torch.cat(v)
        out = torch.zeros_like(q)
        with ops.kernel_mode(mode):
            method.decode(world.ctx, rows, q, k, v, out)
        for row in rows:
            torch.testing.assert_close(out[row.start:row.end].float(),
                                       torch.stack(want[row.req_id]), atol=2e-5, rtol=2e-5)
        for r in live:
            progress[r] += committed
    assert progress["c"] == requests["c"][1] and 0 < progress["b"] < progress["a"]
    assert progress["a"] > settings.residual  # past a fold


def test_covering_settings_are_dense_attention():
    """Retention 100 %, 16 bits: decode (ring of 4, folded every 4 tokens) is dense attention
    over the whole context."""
    method = make_method(MiniKVSettings(**MiniKVMethod.covering_settings(128, 4096),
                                        min_sparse_len=64), h=2, d=64, num_layers=2)
    assert_decode_is_dense(World(method, {"r": (203, 13)}))


def assert_decode_is_dense(world: World) -> None:
    """Prefill world's one request, then decode all of its generated tokens: each step equals
    dense attention over the exact context."""
    ((r, (p, gen)),) = world.requests.items()
    world.prefill(r, chunk=64)
    for s in range(p + 1, p + gen + 1):
        out = world.step({r: s})[r]
        dense = causal_attention(world.q[r][s - 1:s], world.k[r][:s], world.v[r][:s],
                                 world.ctx.scale)
        torch.testing.assert_close(out, dense[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [2, 16])
def test_one_batched_call_equals_each_request_alone(bits):
    """Three requests of different prompt lengths and progress (one folds in the step, one
    finishes before the others) in one decode call per step, against the same pages decoded
    one request per call: same outputs, same pages after."""
    settings = MiniKVSettings(bits=bits, min_sparse_len=100, residual=16)
    batched, alone = batched_and_alone(lambda: World(make_method(settings, h=2, d=64,
                                                                 num_layers=2), BATCH, seed=3))
    assert batched.method._plans.keys() == alone.method._plans.keys()


BATCH = {"a": (150, 40), "b": (333, 40), "c": (212, 20)}  # request: (prompt, generated)


def batched_and_alone(build_world, steps: int = 20) -> tuple[World, World]:
    """Two identical worlds of the BATCH requests, staggered (a and c started decoding
    earlier), then ``steps`` steps: one decode call for every live request in the first, one
    per request in the second, with equal outputs and, after, bit-identical pages."""
    worlds = []
    for _ in range(2):
        world = build_world()
        for r in BATCH:
            world.prefill(r, chunk=100)
        for r, ahead in (("a", 3), ("c", 7)):
            for s in range(BATCH[r][0] + 1, BATCH[r][0] + ahead + 1):
                world.step({r: s})
        worlds.append(world)
    batched, alone = worlds
    progress = {"a": 150 + 3, "b": 333, "c": 212 + 7}  # tokens in each context
    for _ in range(steps):
        live = {r: n + 1 for r, n in progress.items() if n + 1 <= sum(BATCH[r])}
        got = batched.step(live)
        for r, s in live.items():
            torch.testing.assert_close(got[r], alone.step({r: s})[r], atol=1e-6, rtol=1e-6)
        progress.update(live)
    assert progress["c"] == sum(BATCH["c"]) and progress["a"] < sum(BATCH["a"])
    assert torch.equal(batched.cache.view(torch.int32), alone.cache.view(torch.int32))  # bits
    return batched, alone


def test_release_drops_everything_kept_on_the_side():
    method = make_method(MiniKVSettings(min_sparse_len=100, residual=16), num_layers=1)
    world = World(method, {"a": (200, 4), "b": (180, 4)})
    world.prefill("a", chunk=64)
    for c0 in (0, 64):  # b: two chunks of its prompt, not finalized yet
        world.write("b", c0, c0 + 64)
        method.prefill_chunk(world.ctx, RequestRows("b", 180, c0 + 64, 0, 64, world.blocks["b"]),
                             world.q["b"][c0:c0 + 64], world.k["b"][c0:c0 + 64],
                             world.v["b"][c0:c0 + 64])
    world.step({"a": 201})
    assert method._scores.keys() == {("b", 0)} and method._plans and method._batch_plans
    method.release("b")
    assert not method._scores
    method.release("a")
    assert not method._plans and not method._batch_plans
