"""SpeCache on the engine's pages, through the method's hooks, without vLLM (the world of
test_minikv_pages with a host store): page sizes against the default's, decode against a
reference built independently (low-bit cache with the top-k of the output row's attention
swapped for exact copies), the slot cache's hits, and one batched call against each request
alone."""

import pytest
import torch
from test_minikv_pages import (BATCH, LLAMA8B, World, assert_decode_is_dense,
                               batched_and_alone)

from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.core.attention import attention_with_lse_reference
from vllm_shadowkv.core.kivi import dequantize_groups, quantize_groups
from vllm_shadowkv.core.store import InMemoryValueStore
from vllm_shadowkv.methods.base import KVShapes, RequestRows
from vllm_shadowkv.methods.specache import SpeCacheMethod, SpeCacheSettings


def make_method(settings: SpeCacheSettings, h=2, d=64, block_size=16, num_layers=1,
                dtype=torch.float32, max_len=4096) -> SpeCacheMethod:
    shapes = KVShapes(h, d, dtype, block_size, num_layers=num_layers, max_model_len=max_len)
    settings.check()
    settings.check_engine(shapes)
    return SpeCacheMethod(settings.resolved(shapes), shapes)


def make_world(method, requests, seed=0) -> World:
    world = World(method, requests, seed=seed)
    world.ctx.store = InMemoryValueStore()
    return world


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("context", [32768, 131072])
def test_llama8b_shapes_hold_9x_the_default_backends_requests(block_size, context):
    """1 bit, group 64 (the paper's headline): a prompt's pages at Llama-3.1-8B shapes, slots
    included, against 4 KiB per token and layer exact."""
    method = make_method(SpeCacheSettings(), LLAMA8B["kv_heads"], LLAMA8B["head"], block_size,
                         num_layers=32, dtype=LLAMA8B["dtype"], max_len=context)
    layout = PageLayout(method)
    block_bytes = block_size * sum(method.token_bytes(layer) for layer in range(32))
    assert context * 4096 * 32 / (layout.steady_blocks(context) * block_bytes) >= 9.0
    # The store holds every quantized prompt token's exact key and value, per layer.
    assert method.store_bytes(0, context) == 8 * context * 2 * 128 * 2


def low_bit_context(world: World, r: str, seq_len: int):
    """The K/V ``[h, seq_len, d]`` (fp32) the pages hold for the first ``seq_len`` tokens: the
    prompt's whole groups and each folded ring KIVI round-tripped, the rest exact."""
    m, p = world.method, world.prompt[r]
    s, fmt = m.settings, m.pages.fmt
    k, v = world.k[r].float(), world.v[r].float()
    quantized = p // s.group_size * s.group_size
    folded = (seq_len - p - 1) // s.residual * s.residual

    def round_trip(first, end):
        dk, dv = dequantize_groups(quantize_groups(k[first:end], v[first:end], fmt), fmt)
        return dk.float(), dv.float()

    parts = [round_trip(0, quantized), (k[quantized:p], v[quantized:p])]
    parts += [round_trip(f, f + s.residual) for f in range(p, p + folded, s.residual)]
    parts.append((k[p + folded:seq_len], v[p + folded:seq_len]))
    return (torch.cat([pk for pk, _ in parts]).transpose(0, 1),
            torch.cat([pv for _, pv in parts]).transpose(0, 1))


def top_k(world: World, r: str, keys: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Per KV head, the top-k quantized prompt tokens of ``row``'s probabilities over
    ``keys`` (summed over the head's query heads) -> ``[h, k]``."""
    m, p = world.method, world.prompt[r]
    quantized = p // m.settings.group_size * m.settings.group_size
    h = m.shapes.num_kv_heads
    row = row.float().view(h, -1, row.shape[-1])  # [h, G, d]
    probs = torch.softmax(row @ keys.transpose(1, 2) * world.ctx.scale, dim=-1).sum(1)
    return probs[:, :quantized].topk(min(m.settings.top_k, quantized), dim=-1).indices


def attend(world: World, r: str, keys, values, top: torch.Tensor, row: torch.Tensor):
    """``row``'s attention over ``keys``/``values`` with the ``top`` tokens exact."""
    p = world.prompt[r]
    k, v = world.k[r][:p].float().transpose(0, 1), world.v[r][:p].float().transpose(0, 1)
    index = top.unsqueeze(-1).expand(-1, -1, k.shape[-1])
    keys, values = keys.scatter(1, index, k.gather(1, index)), values.scatter(
        1, index, v.gather(1, index))
    out, _ = attention_with_lse_reference(row.float().view(1, 1, *row.shape), keys[None],
                                          values[None], None, world.ctx.scale)
    return out[0, 0]


def reference_output(world: World, r: str, seq_len: int) -> torch.Tensor:
    """The last token of ``seq_len`` from the K/V alone: the output row's probabilities over
    the low-bit context pick, per KV head, the top-k quantized prompt tokens, which are
    attended exact ("current")."""
    keys, values = low_bit_context(world, r, seq_len)
    row = world.q[r][seq_len - 1]
    return attend(world, r, keys, values, top_k(world, r, keys, row), row)


@pytest.mark.parametrize("bits", [1, 2])
def test_decode_from_pages_equals_the_reference(bits):
    """Finalize into permuted pages, then decode past two folds of the ring: each step equals
    the reference; slots that stay wanted are not fetched again."""
    settings = SpeCacheSettings(bits=bits, group_size=32, residual=32, top_k=24,
                                min_sparse_len=128)
    method = make_method(settings, h=2, d=64, num_layers=2)
    p, gen = 301, 2 * settings.residual + 5
    world = make_world(method, {"r": (p, gen)})
    world.prefill("r", chunk=128)
    for s in range(p + 1, p + gen + 1):
        out = world.step({"r": s})["r"]
        torch.testing.assert_close(out.float(), reference_output(world, "r", s), atol=2e-5,
                                   rtol=2e-5)
    stats = world.stats["r"]
    wanted = gen * 2 * settings.top_k
    fetched = stats.bytes_fetched // (2 * 64 * 4)
    assert stats.selected == stats.hits + fetched == wanted and 0 < fetched < wanted


def guess_step(world: World, lengths: dict[str, int],
               guesses: dict[str, tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    """One decode call with rows [output, guess] per request (request -> context length
    after the step): the output token is written to the pages first, as the engine does; the
    guess (query, key, value from ``guesses``, at the next position) is not. -> the two
    output rows ``[2, hq, d]`` per request."""
    rows, q, k, v = [], [], [], []
    for i, (r, s) in enumerate(lengths.items()):
        world.write(r, s - 1, s)
        rows.append(RequestRows(r, world.prompt[r], s + 1, 2 * i, 2 * i + 2, world.blocks[r],
                                guess=1))
        gq, gk, gv = guesses[r]
        q += [world.q[r][s - 1], gq]
        k += [world.k[r][s - 1], gk]
        v += [world.v[r][s - 1], gv]
    out = torch.zeros(len(q), *q[0].shape)
    world.method.decode(world.ctx, rows, torch.stack(q), torch.stack(k), torch.stack(v), out)
    return {r: out[2 * i:2 * i + 2] for i, r in enumerate(lengths)}


def random_guess(world: World, g: torch.Generator, scale: float = 1.0):
    h, d = world.method.shapes.num_kv_heads, world.method.shapes.head_size
    return (torch.randn(8, d, generator=g), scale * torch.randn(h, d, generator=g),
            scale * torch.randn(h, d, generator=g))


@pytest.mark.parametrize("bits", [1, 2])
def test_speculative_decode_attends_the_previous_guess_rows_top_k(bits):
    """Rows [output, guess] past two folds of the ring: the output row attends the top-k the
    previous step's guess row picked (its own in the first step, nothing picked before it),
    the guess row the same plus the output row and itself, and picks the next step's."""
    settings = SpeCacheSettings(bits=bits, group_size=32, residual=32, top_k=24,
                                prefetch="speculative", min_sparse_len=128)
    method = make_method(settings, h=2, d=64, num_layers=2)
    p, gen = 301, 2 * settings.residual + 5
    world = make_world(method, {"r": (p, gen)})
    world.prefill("r", chunk=128)
    g, picked = torch.Generator().manual_seed(1), None
    for s in range(p + 1, p + gen + 1):
        gq, gk, gv = guess = random_guess(world, g)
        out = guess_step(world, {"r": s}, {"r": guess})["r"]
        keys, values = low_bit_context(world, "r", s)
        row = world.q["r"][s - 1]
        top = top_k(world, "r", keys, row) if picked is None else picked
        keys, values = torch.cat([keys, gk[:, None]], 1), torch.cat([values, gv[:, None]], 1)
        want = [attend(world, "r", keys[:, :-1], values[:, :-1], top, row),
                attend(world, "r", keys, values, top, gq)]
        torch.testing.assert_close(out.float(), torch.stack(want), atol=2e-5, rtol=2e-5)
        picked = top_k(world, "r", keys, gq)
    stats = world.stats["r"]
    fetched = stats.bytes_fetched // (2 * 64 * 4)
    # Each step fetches the guess row's top-k; the first one the output row's before it too.
    assert stats.hits + fetched == (gen + 1) * 2 * settings.top_k and 0 < fetched


def test_the_guess_rows_kv_never_reaches_the_pages():
    """The same committed tokens decoded with and without guess rows (large K/V, so that a
    copy anywhere would show), past two folds of the ring (a fold in a step with a guess):
    the pages are equal byte for byte, but for the slots (they hold different picks)."""
    settings = SpeCacheSettings(group_size=32, residual=32, top_k=8, prefetch="speculative",
                                min_sparse_len=100)
    p, gen = 150, 2 * settings.residual + 3
    worlds = []
    for guessing in (False, True):
        world = make_world(make_method(settings), {"r": (p, gen)}, seed=2)
        world.prefill("r", chunk=64)
        g = torch.Generator().manual_seed(3)
        for s in range(p + 1, p + gen + 1):
            if guessing:
                guess_step(world, {"r": s}, {"r": random_guess(world, g, scale=1000.0)})
            else:
                world.step({"r": s})
        worlds.append(world)
    for world in worlds:
        rows = world.method.pages.row_pool(world.cache)
        for plan in world.method._plans.values():
            rows[plan.slot_key_rows.flatten()] = 0
            rows[plan.slot_value_rows.flatten()] = 0
    plain, guessing = worlds
    assert torch.equal(plain.cache.view(torch.int32), guessing.cache.view(torch.int32))


def test_covering_settings_are_dense_attention():
    """Every prompt token fetched exact, no generated token folded: dense attention over the
    whole context, though the pages are 1-bit."""
    method = make_method(SpeCacheSettings(**SpeCacheMethod.covering_settings(128, 4096),
                                          min_sparse_len=64), h=2, d=64, num_layers=2)
    assert method.pages.fmt.bits == 1
    assert_decode_is_dense(make_world(method, {"r": (203, 13)}))


def test_one_batched_call_equals_each_request_alone():
    settings = SpeCacheSettings(group_size=32, residual=32, top_k=16, min_sparse_len=100)
    batched, alone = batched_and_alone(lambda: make_world(make_method(settings, h=2, d=64,
                                                                      num_layers=2), BATCH,
                                                          seed=3))
    for r in BATCH:
        assert torch.equal(batched.method._slot_tokens[(r, 0)], alone.method._slot_tokens[(r, 0)])


def test_release_drops_the_slots():
    method = make_method(SpeCacheSettings(group_size=32, residual=32, top_k=8,
                                          min_sparse_len=100))
    world = make_world(method, {"a": (200, 4), "b": (180, 4)})
    for r in ("a", "b"):
        world.prefill(r, chunk=64)
    world.step({"a": 201, "b": 181})
    assert method._slot_tokens.keys() == {("a", 0), ("b", 0)}
    method.release("a")
    assert method._slot_tokens.keys() == {("b", 0)}
