"""TailorKV compressed for real inside vLLM (CPU, fresh processes), on the constructed retrieval
model: layer 0 quantized at 1 bit, layers 1 and 2 offloaded with a top-k of about 6 % of the
prompt picked on the critical channels each step. The engine's counters show every S-layer step
attending its top-k tokens from the slots, and the channel rows and missed top-k rows moved
from the store; the in-engine fidelity probe shows the selection doing its job in the S-layers
(closer to dense attention than the sink and recent tokens with a single selected token), and
the needle is found. The method table's shared engine tests (exactness with covering settings,
lifecycle, capacity, the server) run TailorKV too."""

import math

import pytest
from engine_utils import fixture_model, run_on_fixture

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
SETTINGS = {"q_layers": [0], "top_k": 128}


def run(tmp_path, name, prompt, settings):
    return run_on_fixture(tmp_path, name, "tailorkv", prompt, settings, MAX_TOKENS)


def test_critical_channel_top_k_finds_the_needle_and_beats_sink_and_recent(tmp_path):
    from transformers import AutoTokenizer

    from vllm_shadowkv.eval import tasks

    tokenizer = AutoTokenizer.from_pretrained(fixture_model())
    sample = tasks.generate("niah_single", tokenizer, 2048, depth=0.5, seed=1)
    prompt = sample.prompt + sample.answer_prefix
    result, stats = run(tmp_path, "tailorkv", prompt, SETTINGS)
    _, local = run(tmp_path, "local", prompt, SETTINGS | {"top_k": 1})

    layers, s_layers, kv_heads = 3, 2, 2
    steps = stats["decode_steps"] // layers
    assert steps == MAX_TOKENS - 1  # every generated token but the last decoded compressed
    prompt_len = stats["prompt_len"]
    assert stats["selected"] == steps * s_layers * kv_heads * 128  # the slots' rows
    assert stats["predicted_steps"] == 0  # channel_query "current"
    channel_bytes = kv_heads * 12 * math.ceil(prompt_len / 128) * 128 * 2
    row_bytes = 2 * 128 * 2  # one token of one KV head: key and value, bf16
    fetched_rows = (stats["bytes_fetched"] - steps * s_layers * channel_bytes) // row_bytes
    assert fetched_rows + stats["hits"] == steps * s_layers * kv_heads * 128
    assert 0 < fetched_rows < steps * s_layers * kv_heads * 128  # the slots carry over steps

    errors = {int(layer): f["relative_error"] for layer, f in stats["fidelity"].items()}
    control = {int(layer): f["relative_error"] for layer, f in local["fidelity"].items()}
    print(f"\nrelative error vs dense per layer: top-128 {errors}, sink + recent + 1 {control}")
    assert sorted(errors) == sorted(control) == [0, 1, 2]
    assert errors[1] < control[1] and errors[2] < control[2]
    answer = tokenizer.decode(result["batches"][0][0]["token_ids"])
    assert tasks.score(sample, answer) == 1.0


def test_predicted_channel_query_finds_the_needle(tmp_path):
    """The paper's channel choice: layer l's critical channels from its query projection of
    layer l-1's hidden state (patches/predicted_query.py), the partial scores still with the
    layer's own query."""
    from transformers import AutoTokenizer

    from vllm_shadowkv.eval import tasks

    tokenizer = AutoTokenizer.from_pretrained(fixture_model())
    sample = tasks.generate("niah_single", tokenizer, 2048, depth=0.5, seed=1)
    result, stats = run(tmp_path, "predicted", sample.prompt + sample.answer_prefix,
                        SETTINGS | {"channel_query": "predicted"})
    errors = {int(layer): f["relative_error"] for layer, f in stats["fidelity"].items()}
    print(f"\nrelative error vs dense per layer, predicted channels: {errors}")
    assert stats["selected"] == (MAX_TOKENS - 1) * 2 * 2 * 128
    assert stats["predicted_steps"] == (MAX_TOKENS - 1) * 2  # both S-layers, every step
    assert errors[1] < 0.05 and errors[2] < 0.5
    assert tasks.score(sample, tokenizer.decode(result["batches"][0][0]["token_ids"])) == 1.0
