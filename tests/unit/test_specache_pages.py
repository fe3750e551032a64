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
from vllm_shadowkv.backend.worker_state import RequestStats
from vllm_shadowkv.core import transfer
from vllm_shadowkv.core.attention import attention_with_lse_reference
from vllm_shadowkv.core.kivi import dequantize_groups, quantize_groups
from vllm_shadowkv.core.store import InMemoryValueStore
from vllm_shadowkv.methods.base import KVShapes, LayerContext, RequestRows
from vllm_shadowkv.methods.slots import plan_fetch
from vllm_shadowkv.methods.specache import SpeCacheMethod, SpeCacheSettings
from vllm_shadowkv.methods.specache.guess import set_missed
from vllm_shadowkv.store import CpuValueStore


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
    # With top_k 0 nothing is fetched back: the store holds nothing, and admits without it.
    plain = make_method(SpeCacheSettings(top_k=0), LLAMA8B["kv_heads"], LLAMA8B["head"],
                        block_size, num_layers=32, dtype=LLAMA8B["dtype"], max_len=context)
    assert plain.store_bytes(0, context) == 0 and PageLayout(plain).store_bytes(context) == 0


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


@pytest.mark.parametrize("bits, verify, pre_decode", [
    (1, False, False), (2, False, False), (1, True, False), (1, False, True), (2, True, True),
    (1, "miss", False), (2, "miss", True)])
def test_speculative_decode_attends_the_previous_guess_rows_top_k(bits, verify, pre_decode):
    """Rows [output, guess] past two folds of the ring: the output row attends the top-k the
    previous step's guess row picked (its own in the first step, nothing picked before it;
    with verify_guess, its own in every step; with "miss", at the steps after a wrong guess,
    here every third), the guess row the same plus the output row and itself, and picks the
    next step's. Pre-decoding first: both rows attend the low-bit cache alone and the output
    row picks; vLLM then decodes the same token again."""
    settings = SpeCacheSettings(bits=bits, group_size=32, residual=32, top_k=24,
                                prefetch="speculative", verify_guess=verify,
                                pre_decode=pre_decode, min_sparse_len=128)
    method = make_method(settings, h=2, d=64, num_layers=2)
    p, gen = 301, 2 * settings.residual + 5
    world = make_world(method, {"r": (p, gen)})
    world.prefill("r", chunk=128)
    g, picked = torch.Generator().manual_seed(1), None
    steps = [p + 1] * pre_decode + list(range(p + 1, p + gen + 1))
    verified = 0
    for i, s in enumerate(steps):
        gq, gk, gv = guess = random_guess(world, g)
        wrong = verify == "miss" and i % 3 == 2
        set_missed(["r"] if wrong else [])
        out = guess_step(world, {"r": s}, {"r": guess})["r"]
        keys, values = low_bit_context(world, "r", s)
        row = world.q["r"][s - 1]
        pre = pre_decode and i == 0
        if pre:
            top = torch.empty(2, 0, dtype=torch.long)  # nothing fetched: low-bit alone
        else:
            own = picked is None or verify is True or wrong
            verified += picked is not None and own
            top = top_k(world, "r", keys, row) if own else picked
        own_top = top_k(world, "r", keys, row)
        keys, values = torch.cat([keys, gk[:, None]], 1), torch.cat([values, gv[:, None]], 1)
        want = [attend(world, "r", keys[:, :-1], values[:, :-1], top, row),
                attend(world, "r", keys, values, top, gq)]
        torch.testing.assert_close(out.float(), torch.stack(want), atol=2e-5, rtol=2e-5)
        picked = own_top if pre else top_k(world, "r", keys, gq)
    set_missed([])
    stats = world.stats["r"]
    assert stats.pre_decode_steps == pre_decode  # one step of the layer the world runs
    assert stats.verified_steps == verified and (verified > 0) == bool(verify)
    fetched = stats.bytes_fetched // (2 * 64 * 4)
    # Each step fetches the guess row's top-k (the pre-decoding step its output row's), written
    # at the next step (the last step's is still on its way); without pre-decoding the first
    # step (with verify_guess the verified steps) the output row's before it too.
    asked = (gen + verified) * 2 * settings.top_k
    assert stats.hits + fetched == asked and 0 < fetched
    assert method._pending[0]
    method.release("r")
    assert not method._pending


def test_a_step_without_a_guess_after_one_with_it():
    """vLLM drafts nothing past max_model_len: the last step has one row where the step
    before had two, with the same seq_len. It decodes as "current" mode does."""
    settings = SpeCacheSettings(group_size=32, residual=32, top_k=16, prefetch="speculative",
                                min_sparse_len=100)
    method = make_method(settings, h=2, d=64)
    world = make_world(method, {"r": (300, 4)})
    world.prefill("r", chunk=128)
    guess_step(world, {"r": 301}, {"r": random_guess(world, torch.Generator().manual_seed(5))})
    out = world.step({"r": 302})["r"]  # seq_len 302, as the guess step's
    torch.testing.assert_close(out.float(), reference_output(world, "r", 302), atol=2e-5,
                               rtol=2e-5)


def test_a_prefetch_never_writes_the_pages_of_a_released_request():
    """Two requests prefetch for their next step; one finishes and its pages go to another
    request before the next step: that step fills the live request's slots and leaves the
    released request's pages as their new owner wrote them."""
    settings = SpeCacheSettings(group_size=32, residual=32, top_k=8, prefetch="speculative",
                                min_sparse_len=100)
    method = make_method(settings, h=2, d=64)
    world = make_world(method, {"a": (200, 4), "b": (260, 4)})
    for r in ("a", "b"):
        world.prefill(r, chunk=128)
    g = torch.Generator().manual_seed(2)
    lengths = {"a": 201, "b": 261}
    guess_step(world, lengths, {r: random_guess(world, g) for r in lengths})
    method.release("a")
    pages = world.layout.region_ids(200, world.blocks["a"])
    world.cache[pages] = 7.0  # the new owner's data
    before = world.stats["a"].selected
    guess_step(world, {"b": 262}, {"b": random_guess(world, g)})
    assert torch.all(world.cache[pages] == 7.0)
    assert world.stats["a"].selected == before
    # The pre-decoding step's prefetch, completed by this step (its own is still on its way).
    assert world.stats["b"].selected == 2 * settings.top_k


def test_speculation_hit_rate_counts_the_output_rows_own_top_k_among_the_prefetched():
    """measure_fidelity: a guess equal to the next output row predicts its whole top-k; a
    random guess predicts less."""
    settings = SpeCacheSettings(group_size=32, residual=32, top_k=16, prefetch="speculative",
                                min_sparse_len=100, measure_fidelity=True, pre_decode=False)
    rates = []
    for exact_guess in (True, False):
        method = make_method(settings, h=2, d=64)
        world = make_world(method, {"r": (300, 6)})
        world.prefill("r", chunk=128)
        g = torch.Generator().manual_seed(3)
        for s in range(301, 306):
            guess = random_guess(world, g)
            if exact_guess:  # the next step's output row: same query, key and value
                guess = (world.q["r"][s], world.k["r"][s], world.v["r"][s])
            guess_step(world, {"r": s}, {"r": guess})
        stats = world.stats["r"]
        assert stats.speculated == 4 * 2 * settings.top_k  # every step after the first
        rates.append(stats.speculation_hit_rate)
    assert rates[0] == 1.0 and rates[1] < 1.0


def test_a_pre_decoding_step_is_not_measured():
    """measure_fidelity: the pre-decoding step's output is dropped by vLLM, so its error
    against dense attention is not recorded, nor its token added to the exact reference
    context (vLLM decodes the token again); the steps that emit tokens are."""
    settings = SpeCacheSettings(group_size=32, residual=32, top_k=16, prefetch="speculative",
                                min_sparse_len=100, measure_fidelity=True)
    method = make_method(settings, h=2, d=64)
    world = make_world(method, {"r": (300, 4)})
    world.prefill("r", chunk=128)
    world.ctx.reference_kv[("r", 0)] = (world.k["r"][:300], world.v["r"][:300])  # as finalize
    g = torch.Generator().manual_seed(4)
    for s in (301, 301, 302, 303):  # the pre-decoding step, then the first token again
        guess_step(world, {"r": s}, {"r": random_guess(world, g)})
    stats = world.stats["r"]
    assert stats.pre_decode_steps == 1 and stats.decode_steps == 4
    assert stats.fidelity_means()[0]["steps"] == 3
    reference_k, _ = world.ctx.reference_kv[("r", 0)]
    torch.testing.assert_close(reference_k, world.k["r"][:303])


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



@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (pinned store, copy streams)"))])
def test_a_slot_fetch_completed_later_brings_the_wanted_rows(device):
    """plan_fetch decides on the device without waiting (on CUDA its decision reaches the host
    behind an event), complete() gathers from the (pinned) store and writes through the copy
    stream: each wanted token is then in a slot, with its exact key and value when fetched."""
    n, h, k, p, d = 3, 2, 8, 100, 64
    method = make_method(SpeCacheSettings(top_k=k, min_sparse_len=64), h=h, d=d,
                         dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(n, h, p, 2, d, generator=g).to(torch.bfloat16)
    store = CpuValueStore(1 << 24, torch.bfloat16, (2, d), pin_memory=device == "cuda")
    for i in range(n):
        store.put((f"r{i}", 0), rows[i])
    cache = torch.zeros(4 * n * h * k, d, dtype=torch.bfloat16, device=device)
    key_rows, value_rows = torch.randperm(len(cache), generator=g)[:2 * n * h * k].view(
        2, n, h, k).to(device)
    held = torch.stack([torch.randperm(p, generator=g)[:k] for _ in range(n * h)])
    held[0, :3] = -1  # empty slots
    new = torch.randperm(p, generator=g)[:k // 2].expand(n * h, -1)  # some held already
    wanted = torch.cat([held[:, :k // 2], new], dim=1)
    wanted[1, -2:] = -1
    held, wanted = (t.view(n, h, k).to(torch.int32) for t in (held, wanted))
    stats = {f"r{i}": RequestStats() for i in range(n)}
    layer = LayerContext(0, cache, None, None, store, None, d ** -0.5, stats.__getitem__, {})
    reqs = [RequestRows(f"r{i}", p, p + 1, i, i + 1, torch.zeros(1)) for i in range(n)]

    slots, fetch = plan_fetch(reqs, held.to(device), wanted.to(device), key_rows, value_rows)
    fetch.complete(layer, method.pages)
    if device == "cuda":
        assert torch.device("cuda", torch.cuda.current_device()) in transfer._copy_streams
    slots, pool, key_rows, value_rows = slots.cpu(), cache.cpu(), key_rows.cpu(), value_rows.cpu()
    fetched = 0
    for (i, j, s), token in zip(torch.cartesian_prod(*map(torch.arange, (n, h, k))).tolist(),
                                slots.flatten().tolist()):
        if token >= 0 and token not in held[i, j].tolist():
            fetched += 1
            assert torch.equal(pool[key_rows[i, j, s]], rows[i, j, token, 0])
            assert torch.equal(pool[value_rows[i, j, s]], rows[i, j, token, 1])
    for i, j in torch.cartesian_prod(torch.arange(n), torch.arange(h)).tolist():
        assert set(wanted[i, j].tolist()) - {-1} <= set(slots[i, j].tolist())
    assert sum(s.bytes_fetched for s in stats.values()) == fetched * 2 * d * 2
    assert sum(s.selected for s in stats.values()) == int((wanted >= 0).sum())
