"""SpeCache's speculative prefetch in a real vLLM engine (CPU, fresh processes, tiny local
model): the plugin sets up the guess row (vLLM's speculative decoding, no --speculative-config
given), every decode step schedules it and none is accepted, the long request decodes
compressed; with covering settings the tokens are the default backend's."""

import pytest
from engine_utils import PROMPTS, assert_greedy_close, generate_in_fresh_process
from test_engine_sparse import long_prompt

from vllm_shadowkv.methods.specache import SpeCacheMethod

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
TINY_LAYERS = 4
COMMON = {
    "batches": [[PROMPTS[0], long_prompt(500, 0)]],  # short (exact) and ~3.1K (compressed)
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "engine_kwargs": {"max_model_len": 4096, "max_num_batched_tokens": 1024,
                      "enable_prefix_caching": False, "disable_log_stats": False},
}


def run_specache(model, settings, tmp_path):
    return generate_in_fresh_process(
        {**COMMON, "model": model, "attention_backend": "specache",
         "engine_kwargs": {**COMMON["engine_kwargs"],
                           "additional_config": {"specache": settings}}}, tmp_path)


def assert_guess_rows_ran(result, pre_decoded=True):
    """Each decode step of each request (after the prompt's, which emits the first token)
    carried one guess, and none was accepted; the long request decoded compressed, its first
    decode step pre-decoding in every layer (a step vLLM then counts neither as a draft nor
    as a token: every request still got MAX_TOKENS tokens)."""
    spec = result["spec_decode"]
    drafts = len(COMMON["batches"][0]) * (MAX_TOKENS - 1)
    assert spec["vllm:spec_decode_num_drafts"] == drafts, spec
    assert spec["vllm:spec_decode_num_accepted_tokens"] == 0, spec
    assert all(len(o["token_ids"]) == MAX_TOKENS for o in result["batches"][0])
    stats = result["stats"][0]
    requests = {**stats["finished"], **stats["requests"]}  # the last one is released later
    assert sorted(s["mode"] for s in requests.values()) == ["dense", "sparse"]
    (sparse,) = [s for s in requests.values() if s["mode"] == "sparse"]
    assert sparse["decode_steps"] > 0 and sparse["hits"] > 0
    assert sparse["pre_decode_steps"] == (TINY_LAYERS if pre_decoded else 0), sparse


def test_covering_settings_equal_the_default_backend(tiny_model, tmp_path):
    ref = generate_in_fresh_process({**COMMON, "model": tiny_model, "attention_backend": None},
                                    _dir(tmp_path, "ref"))
    settings = SpeCacheMethod.covering_settings(256, 4096) | {"min_sparse_len": 2048,
                                                              "prefetch": "speculative"}
    test = run_specache(tiny_model, settings, _dir(tmp_path, "specache"))
    assert_greedy_close(ref["batches"][0], test["batches"][0], names=("default", "specache"))
    assert_guess_rows_ran(test)


@pytest.mark.parametrize("verify", [False, True, "miss"])
def test_defaults_run_the_guess_row(tiny_model, tmp_path, verify):
    """The defaults (1 bit, group 64, top 64 of a 3K prompt, generated tokens folded every
    64) with the speculative prefetch, its guesses verified at every step (and then, without
    pre-decoding, the first step's output row fetching its own top-k), after wrong guesses
    only, or never; the threshold lowered to the tiny model's prompts."""
    pre_decoded = verify is not True
    result = run_specache(tiny_model, {"min_sparse_len": 2048, "prefetch": "speculative",
                                       "verify_guess": verify, "pre_decode": pre_decoded,
                                       "measure_fidelity": True}, tmp_path)
    assert_guess_rows_ran(result, pre_decoded=pre_decoded)
    # The probe: of the output rows' own top-k, the share their previous guess row fetched.
    (sparse,) = [s for s in {**result["stats"][0]["finished"], **result["stats"][0]["requests"]}
                 .values() if s["mode"] == "sparse"]
    assert sparse["speculated"] > 0 and 0 < sparse["speculation_hits"] <= sparse["speculated"]
    # Verified: every decode step after the first (True), those after a wrong guess ("miss",
    # in every layer of the step), none (False).
    steps = MAX_TOKENS - 1  # the first token is the prompt's
    verified = sparse["verified_steps"]
    assert verified % TINY_LAYERS == 0 and verified <= TINY_LAYERS * steps, sparse
    if verify is True:  # the first decode step picks its own: nothing was picked ahead
        assert verified == TINY_LAYERS * (steps - 1), sparse
    if verify is False:
        assert verified == 0, sparse


def _dir(tmp_path, name):
    path = tmp_path / name
    path.mkdir()
    return path
