"""The start-up warm-up (backend/warm_up.py) on each method's real hooks, without vLLM: after it,
decoding other requests (other prompt lengths, batch sizes and compositions) compiles nothing
more, and it leaves nothing behind in the method. The patch that runs it in vLLM's worker is
exercised by every engine test (tests/integration)."""

import pytest
import torch
from torch._dynamo.utils import counters

from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.backend.warm_up import ScratchLayer, compressed_len
from vllm_shadowkv.methods import method_class
from vllm_shadowkv.core import cpu_kernels
from vllm_shadowkv.core.rope import RopeCache
from vllm_shadowkv.methods.base import KVShapes

H_Q, H_KV, HEAD, BLOCK, LAYERS, MAX_LEN = 8, 2, 64, 16, 3, 4200

METHODS = [
    ("shadowkv", {"min_sparse_len": 512}),
    ("minikv", {"min_sparse_len": 512}),
    ("tailorkv", {"min_sparse_len": 512, "q_layers": [1]}),
    ("specache", {"min_sparse_len": 512}),
    ("specache", {"min_sparse_len": 512, "prefetch": "speculative"}),
]


def make_layout(name: str, settings: dict) -> PageLayout:
    shapes = KVShapes(H_KV, HEAD, torch.bfloat16, BLOCK, num_layers=LAYERS,
                      max_model_len=MAX_LEN)
    cls = method_class(name)
    resolved = cls.settings_cls(**settings).resolved(shapes)
    return PageLayout(cls(resolved, shapes))


def rope() -> RopeCache:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD, 2).float() / HEAD)
    freqs = torch.outer(torch.arange(MAX_LEN).float(), inv_freq)
    return RopeCache(torch.cat((freqs.cos(), freqs.sin()), dim=-1), HEAD, True)


def scratch(layout: PageLayout, index: int, **kwargs) -> ScratchLayer:
    like = torch.zeros(1, 1, BLOCK, layout.method.token_bytes(index) // 2, dtype=torch.bfloat16)
    return ScratchLayer(layout, index, H_Q, rope(), HEAD ** -0.5, like, **kwargs)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C++ compiler (torch.compile)")
@pytest.mark.parametrize("name,settings", METHODS, ids=lambda v: str(v))
def test_after_warm_up_decoding_compiles_nothing(name, settings):
    torch._dynamo.reset()  # graphs of other tests would hide the warm-up's own compilations
    counters.clear()  # (reset keeps the counters)
    layout = make_layout(name, settings)
    first = {}  # the first layer of each kind, as the warm-up takes them
    for index in range(LAYERS):
        first.setdefault(layout.method.layer_kind(index), index)
    layers = list(first.values())
    assert layers == ([0, 1] if name == "tailorkv" else [0])  # S-layer 0, Q-layer 1
    with torch.inference_mode():
        for index in layers:
            warm = scratch(layout, index)
            assert warm.prompt_lens == [512, 512 + 24]
            warm.run()
        compiled = counters["stats"]["unique_graphs"]
        if name in ("shadowkv", "minikv"):  # the warm-up compiled the method's kernels
            assert compiled > 0  # (TailorKV's and SpeCache's CPU steps are C: none to compile)
        for index in layers:  # three other requests, other batch sizes and compositions
            scratch(layout, index, prompt_lens=[700, 1031, 4000],
                    batches=((0, 1, 2), (2,), (0, 2), (1,), (0, 1, 2))).run()
    assert counters["stats"]["unique_graphs"] == compiled
    method = layout.method
    for state in ("_plans", "_batch_plans", "_scores", "_kept", "_absmax", "_slot_tokens"):
        assert not getattr(method, state, None), f"{name} kept {state} after release"


def test_compressed_len_is_the_shortest_compressed_prompt_or_none():
    layout = make_layout("specache", {"min_sparse_len": 512})
    assert compressed_len(layout, 6) == 512
    short = make_layout("specache", {"min_sparse_len": MAX_LEN})
    assert compressed_len(short, 6) is None  # no room for a compressed prompt and its decode


def test_the_warm_up_leaves_the_global_random_state_alone():
    """vLLM seeds the global generator (--seed) after profiling; the warm-up runs after that
    and must not move it, or sampling without a per-request seed would start elsewhere."""
    layout = make_layout("shadowkv", {"min_sparse_len": 512, "kernels": "torch"})
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    with torch.inference_mode():
        scratch(layout, 0, prompt_lens=[512], batches=((0,),)).run()
    assert torch.equal(torch.rand(4), expected)
