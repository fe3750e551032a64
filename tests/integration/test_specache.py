"""SpeCache compressed for real inside vLLM (CPU, fresh processes), on the constructed retrieval
model: at the paper's defaults prompts run compressed (engine counters), every step attends its
top-k tokens exact (slot hits + fetches), and the in-engine fidelity probe shows the fetch doing
its job: closer to dense attention than the same 1-bit pages with nothing fetched (plain KIVI,
``top_k`` 0). The method table's shared engine tests (exactness with covering settings,
lifecycle, capacity) run SpeCache too."""

import pytest
from engine_utils import fixture_model, run_on_fixture

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


def run(tmp_path, name, prompt, settings):
    return run_on_fixture(tmp_path, name, "specache", prompt, settings, MAX_TOKENS)


def test_defaults_fetch_the_top_k_and_beat_plain_kivi(tmp_path):
    from transformers import AutoTokenizer

    from vllm_shadowkv.eval import tasks

    tokenizer = AutoTokenizer.from_pretrained(fixture_model())
    sample = tasks.generate("niah_single", tokenizer, 2048, depth=0.5, seed=1)
    prompt = sample.prompt + sample.answer_prefix
    result, stats = run(tmp_path, "specache", prompt, {})
    _, kivi = run(tmp_path, "kivi", prompt, {"top_k": 0})

    layers, kv_heads, top_k = 3, 2, 64
    steps = stats["decode_steps"] // layers
    assert steps == MAX_TOKENS - 1  # every generated token but the last decoded compressed
    row_bytes = 2 * 128 * 2  # one token of one KV head: key and value, bf16
    fetched = stats["bytes_fetched"] // row_bytes
    assert stats["selected"] == stats["hits"] + fetched == steps * layers * kv_heads * top_k
    assert 0 < fetched < steps * layers * kv_heads * top_k  # the slots carry over steps
    assert kivi["hits"] == 0 and kivi["bytes_fetched"] == 0

    errors = {int(layer): f["relative_error"] for layer, f in stats["fidelity"].items()}
    plain = {int(layer): f["relative_error"] for layer, f in kivi["fidelity"].items()}
    print(f"\nrelative error vs dense per layer: specache {errors}, plain 1-bit KIVI {plain}")
    assert sorted(errors) == sorted(plain) == [0, 1, 2]
    assert all(errors[layer] < plain[layer] for layer in errors)
    answer = tokenizer.decode(result["batches"][0][0]["token_ids"])
    assert tasks.score(sample, answer) == 1.0
