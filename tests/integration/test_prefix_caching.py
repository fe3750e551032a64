"""vLLM's prefix caching through every method (CPU, fresh processes, tiny local model): a
request whose prompt starts like an earlier one adopts that prompt's exact pages, prefills the
rest and is compressed as if it had prefilled it all."""

import pytest
from engine_utils import (PROMPTS, assert_greedy_close, default_settings,
                          generate_in_fresh_process)
from lifecycle import page_layout
from test_engine_sparse import long_prompt

from vllm_shadowkv.methods import METHODS

pytestmark = pytest.mark.slow

SHARED = long_prompt(500, 0)  # about 3.1K tokens: compressed from 2048
# Batch 2 repeats batch 1's prompts and extends them: hits on a compressed prompt's staging and
# on a short prompt's pages, within one step and across batches.
BATCHES = [[SHARED + " first", PROMPTS[2]],
           [SHARED + " second", PROMPTS[2] + " again", SHARED + " first"]]
COMMON = {"batches": BATCHES, "max_tokens": 12, "kv_events": True,
          "engine_kwargs": {"max_model_len": 4096, "max_num_batched_tokens": 1024,
                            "enable_prefix_caching": True, "disable_log_stats": False}}


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    return generate_in_fresh_process({**COMMON, "model": tiny_model, "attention_backend": None},
                                     tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("method", list(METHODS))
def test_prefix_cache_hits_equal_the_default_backend(method, tiny_model, reference, tmp_path):
    settings = METHODS[method].covering_settings(256, 4096) | {"min_sparse_len": 2048}
    test = generate_in_fresh_process(
        {**COMMON, "model": tiny_model, "attention_backend": method,
         "engine_kwargs": {**COMMON["engine_kwargs"], "additional_config": {method: settings}}},
        tmp_path)
    for ref_batch, test_batch in zip(reference["batches"], test["batches"]):
        assert_greedy_close(ref_batch, test_batch, names=("default", method))
    hits = test["prefix_cache"]["hits"]
    if METHODS[method].prefix_caching_off:
        assert hits == 0 and not test["kv_events"]
        return
    # Both long prompts of batch 2 adopt the shared pages, whole multiples of a page and a block.
    assert hits >= 2 * 1024 + len(PROMPTS[2]) // 2, test["prefix_cache"]
    finished = test["stats"][1]["finished"].values()  # both batches'
    assert sorted(s["mode"] for s in finished) == ["dense"] * 2 + ["sparse"] * 3
    assert all(s["decode_steps"] > 0 for s in finished if s["mode"] == "sparse")
    assert_router_learns_the_default_backends_blocks(test["kv_events"], reference["kv_events"])


def stored_blocks(events) -> dict:
    """{block hash: its tokens} of the ``BlockStored`` events."""
    blocks = {}
    for event in (e for e in events if e["type"] == "stored"):
        size = len(event["tokens"]) // len(event["block_hashes"])
        for i, name in enumerate(event["block_hashes"]):
            blocks[name] = event["tokens"][i * size:(i + 1) * size]
    return blocks


def assert_router_learns_the_default_backends_blocks(events, reference_events):
    """A KV-aware router (vLLM's ZMQ events) learns blocks by the hashes that vLLM's default
    backend announces for the same prompts: the shared prompt's blocks, each with its tokens,
    and no key of the method's own pages (patches/kv_cache_events)."""
    stored, reference = stored_blocks(events), stored_blocks(reference_events)
    assert stored and all(reference.get(h) == tokens for h, tokens in stored.items())
    assert sum(map(len, stored.values())) >= 2048  # the long prompt's blocks, shared
    removed = {h for e in events if e["type"] == "removed" for h in e["block_hashes"]}
    assert removed <= set(stored)


@pytest.mark.parametrize("method", [m for m, cls in METHODS.items() if not cls.prefix_caching_off])
def test_a_hit_compresses_the_prompt_as_its_cold_prefill_did(method, tiny_model, tmp_path):
    """At the method's defaults (lossy): the same prompt again, its prefix adopted, is compressed
    from the same keys and values and generates the same tokens (SpeCache: its guess rows too)."""
    settings = default_settings(method, min_sparse_len=2048)
    prompt = SHARED + " first"
    test = generate_in_fresh_process(
        {**COMMON, "batches": [[prompt], [prompt]], "model": tiny_model,
         "attention_backend": method,
         "engine_kwargs": {**COMMON["engine_kwargs"], "additional_config": {method: settings}}},
        tmp_path)
    assert test["prefix_cache"]["hits"] >= 2048
    cold, hit = test["batches"]
    assert_greedy_close(cold, hit, names=("cold", "hit"), logprob_tol=0.02)
    assert [s["mode"] for s in test["stats"][1]["finished"].values()] == ["sparse", "sparse"]


def test_the_next_turn_of_a_chat_adopts_the_answer_as_the_default_backend_does(tiny_model,
                                                                              tmp_path):
    """Short (exact) requests share their generated tokens' pages too, as vLLM shares blocks:
    a chat's next turn (prompt, answer, question) adopts the answer and generates the default
    backend's tokens."""
    job = {**COMMON, "batches": [[PROMPTS[1], PROMPTS[2]]], "follow_up": True, "max_tokens": 160,
           "ignore_eos": True, "kv_events": False}
    runs = {}
    for method in (None, "shadowkv"):
        (tmp_path / str(method)).mkdir()
        config = {"additional_config": {method: default_settings(method)}} if method else {}
        runs[method] = generate_in_fresh_process(
            {**job, "model": tiny_model, "attention_backend": method,
             "engine_kwargs": {**COMMON["engine_kwargs"], **config}}, tmp_path / str(method))
    for ref_batch, test_batch in zip(runs[None]["batches"], runs["shadowkv"]["batches"]):
        assert_greedy_close(ref_batch, test_batch, names=("default", "shadowkv"))
    assert {s["mode"] for s in runs["shadowkv"]["stats"][-1]["finished"].values()} == {"dense"}
    hits = {method: run["prefix_cache"]["hits"] for method, run in runs.items()}
    # Each turn adopts its prompt and its answer up to vLLM's last full block: whole blocks for
    # the default backend, whole pages within them for shadowkv (less than a page short).
    per_page = page_layout("shadowkv", default_settings("shadowkv"), 4096).exact_per_page
    assert hits[None] > 2 * 160 and hits["shadowkv"] > hits[None] - 2 * per_page, hits
