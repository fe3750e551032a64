"""TailorKV on the engine's pages, through the method's hooks, without vLLM (the world of
test_minikv_pages with a host store): page sizes and capacity at Llama-3.1-8B shapes, an S-layer's
decode against a reference built independently (critical channels, partial scores, top-k, exact
attention over sink + recent + selected + generated), a Q-layer's against the low-bit cache, the
slot cache's hits, the covering settings against dense attention, and one batched call against
each request alone."""

import math

import pytest
import torch
from test_minikv_pages import BATCH, LLAMA8B, World, assert_decode_is_dense, batched_and_alone
from test_specache_pages import low_bit_context

from vllm_shadowkv.backend.exact_attention import causal_attention
from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.core import ops
from vllm_shadowkv.methods.base import KVShapes
from vllm_shadowkv.methods.tailorkv import TailorKVMethod, TailorKVSettings
from vllm_shadowkv.methods.tailorkv.pages import STAGING_FACTOR
from vllm_shadowkv.store import CpuValueStore


def make_method(settings: TailorKVSettings, h=2, d=64, block_size=16, num_layers=2,
                dtype=torch.float32, max_len=4096) -> TailorKVMethod:
    shapes = KVShapes(h, d, dtype, block_size, num_layers=num_layers, max_model_len=max_len)
    settings.check()
    settings.check_engine(shapes)
    return TailorKVMethod(settings.resolved(shapes), shapes)


def make_world(method, requests, seed=0) -> World:
    world = World(method, requests, seed=seed)
    stores = {}

    def store_for(shape):  # the engine's store: the CPU kernels read its pages in place
        if tuple(shape) not in stores:
            stores[tuple(shape)] = CpuValueStore(1 << 26, method.shapes.dtype, shape,
                                                 pin_memory=False)
        return stores[tuple(shape)]

    world.ctx.store, world.ctx.store_for = store_for((2, method.shapes.head_size)), store_for
    return world


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("context,ratio", [(32768, 30), (131072, 95)])
def test_llama8b_shapes_hold_many_times_the_default_backends_requests(block_size, context,
                                                                      ratio):
    """The paper's defaults on Llama-3.1-8B (layer 0 quantized at 1 bit, 31 S-layers of
    8 + 120 + 896 tokens): vLLM's blocks per request against 4 KiB per token and layer exact;
    the staging of one prompt at most twice its dense bytes; the store holds every S-layer's
    K, V and the channel-major K."""
    method = make_method(TailorKVSettings(q_layers=(0,)), LLAMA8B["kv_heads"], LLAMA8B["head"],
                         block_size, num_layers=32, dtype=LLAMA8B["dtype"], max_len=context)
    layout = PageLayout(method)
    block_bytes = block_size * sum(method.token_bytes(layer) for layer in range(32))
    assert context * 4096 * 32 / (layout.steady_blocks(context) * block_bytes) >= ratio
    assert block_bytes <= STAGING_FACTOR * block_size * 4096 * 32
    # S-layer pages are exact pages; the S region holds the 1024 kept tokens exactly.
    assert method.token_bytes(1) == 4096
    assert layout.steady_blocks(context) == 1024 // block_size
    assert method.store_bytes(0, context) == 0
    assert method.store_bytes(1, context) == context * 8 * 128 * 2 * 3


def test_every_layer_fits_its_region_at_any_prompt_length():
    method = make_method(TailorKVSettings(q_layers=(1,), sink=4, recent=20, top_k=48,
                                          group_size=32, residual=32), max_len=3000)
    pages = method.pages
    for prompt_len in (1, 31, 64, 72, 700, 2999, 3000):
        blocks = pages.region_blocks(prompt_len)
        for layer in (0, 1):
            unit_pages, row_pages = pages._blocks(pages.shape(layer, prompt_len))
            assert unit_pages + row_pages <= blocks
        assert pages.shape(0, prompt_len).tail == min(prompt_len, 24) + min(
            48, max(prompt_len - 24, 0))


# --- the hooks against an independent reference ---------------------------------------------

S_SETTINGS = dict(sink=4, recent=20, top_k=40, critical_channels=6, group_size=32, residual=32,
                  min_sparse_len=64)


def s_layer_reference(world: World, r: str, seq_len: int) -> torch.Tensor:
    """Layer 0 (an S-layer) for the last token of ``seq_len``: the critical channels of the
    group-summed query by |q| x max|K| over the prompt, its partial scores of the middle
    tokens on them, the top-k, exact attention over sink + recent + top-k + generated."""
    s, p = world.method.settings, world.prompt[r]
    k, v, q = world.k[r].float(), world.v[r].float(), world.q[r][seq_len - 1].float()
    h, d = k.shape[1], k.shape[2]
    qg = q.view(h, -1, d).sum(1)  # [h, d]
    absmax = k[:p].abs().amax(0)  # [h, d]
    kept = []
    for head in range(h):
        channels = (qg[head].abs() * absmax[head]).topk(s.critical_channels).indices
        scores = k[s.sink:p - s.recent, head][:, channels] @ qg[head, channels]
        top = scores.topk(min(s.top_k, len(scores))).indices + s.sink
        middle = torch.zeros(seq_len, dtype=torch.bool)
        middle[top] = True
        middle[:s.sink] = True
        middle[p - s.recent:] = True
        kept.append(middle)
    mask = torch.stack(kept).view(h, 1, 1, seq_len).repeat_interleave(q.shape[0] // h, 0)
    logits = torch.einsum("hd,thd->ht", q, k[:seq_len].repeat_interleave(q.shape[0] // h, 1))
    logits = logits * world.ctx.scale
    probs = torch.softmax(logits.masked_fill(~mask.view(q.shape[0], seq_len), float("-inf")), -1)
    values = v[:seq_len].repeat_interleave(q.shape[0] // h, 1)
    return torch.einsum("ht,thd->hd", probs, values)


@pytest.mark.parametrize("mode", ["auto", "torch"])  # the store's pages read in place by the
def test_s_layer_decode_equals_the_reference(mode):  # C top-k; gathered for the reference
    method = make_method(TailorKVSettings(q_layers=(1,), **S_SETTINGS))
    world = make_world(method, {"r": (301, 45)})
    world.prefill("r", chunk=100)
    for s in range(302, 301 + 45 + 1):  # past a fold of the generated tokens (residual 32)
        with ops.kernel_mode(mode):
            out = world.step({"r": s})["r"]
        torch.testing.assert_close(out, s_layer_reference(world, "r", s), atol=1e-5, rtol=1e-5)
    stats = world.stats["r"]
    assert stats.hits > 0 and stats.decode_steps == 45
    assert stats.selected == 45 * 2 * 40  # per step h x 40 slots attended: hits + fetched
    channel_bytes = 2 * 6 * math.ceil(301 / 128) * 128 * 4
    row_bytes = 2 * 64 * 4
    assert stats.bytes_fetched == 45 * channel_bytes + (stats.selected - stats.hits) * row_bytes


def test_q_layer_decode_is_attention_over_the_low_bit_cache():
    method = make_method(TailorKVSettings(q_layers=(0,), bits=2, **S_SETTINGS))
    world = make_world(method, {"r": (301, 40)})
    world.prefill("r", chunk=100)
    for s in range(302, 301 + 40 + 1):
        out = world.step({"r": s})["r"]
        keys, values = low_bit_context(world, "r", s)  # [h, s, d]
        q = world.q["r"][s - 1:s].float()
        expected = causal_attention(q, keys.transpose(0, 1), values.transpose(0, 1),
                                    world.ctx.scale)
        torch.testing.assert_close(out.float(), expected[0], atol=1e-4, rtol=1e-4)
    assert world.stats["r"].bytes_fetched == 0


def test_covering_settings_are_dense_attention():
    """Every layer an S-layer with a top-k over the whole middle: dense attention, generated
    tokens folded as 16-bit rows every 32 tokens included."""
    method = make_method(TailorKVSettings(**TailorKVMethod.covering_settings(128, 4096),
                                          min_sparse_len=64))
    assert_decode_is_dense(make_world(method, {"r": (203, 40)}))


def test_one_batched_call_equals_each_request_alone():
    settings = TailorKVSettings(q_layers=(1,), **S_SETTINGS | {"min_sparse_len": 100})
    batched, alone = batched_and_alone(lambda: make_world(make_method(settings), BATCH, seed=3))
    assert batched.method._slot_tokens.keys() == alone.method._slot_tokens.keys()


def test_release_drops_everything_kept_on_the_side():
    method = make_method(TailorKVSettings(q_layers=(1,), **S_SETTINGS))
    world = make_world(method, {"r": (301, 3)})
    world.prefill("r", chunk=100)
    world.step({"r": 302})
    assert method._absmax and method._slot_tokens and method._plans
    method.release("r")
    assert not (method._absmax or method._slot_tokens or method._plans)
