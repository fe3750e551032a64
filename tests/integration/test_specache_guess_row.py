"""SpeCache's guess row through vLLM's speculative decoding on the CPU (methods/README.md,
"SpeCache's second query row"): with the guess proposer every decode step of every request runs
two tokens, no guess is ever accepted (its position is rolled back), and the emitted tokens are
the default engine's. The default attention backend: only the scheduling path is under test."""

import pytest
from engine_utils import PROMPTS, assert_greedy_close, generate_in_fresh_process

from vllm_shadowkv.methods.specache.guess import PROPOSER

pytestmark = pytest.mark.slow

MAX_TOKENS = 16


def test_every_decode_step_carries_a_rejected_guess(tiny_model, tmp_path):
    common = {"model": tiny_model, "attention_backend": None, "batches": [PROMPTS],
              "max_tokens": MAX_TOKENS, "ignore_eos": True,
              "engine_kwargs": {"max_model_len": 4096, "max_num_batched_tokens": 512}}
    ref = generate_in_fresh_process(common, _dir(tmp_path, "ref"))
    spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 1}
    test = generate_in_fresh_process(
        {**common, "engine_kwargs": {**common["engine_kwargs"], "speculative_config": spec,
                                     "disable_log_stats": False}}, _dir(tmp_path, "guess"))
    # Each decode step after the prompt's (which emits the first token) carries one guess.
    assert test["spec_decode"]["vllm:spec_decode_num_drafts"] == len(PROMPTS) * (MAX_TOKENS - 1)
    assert test["spec_decode"]["vllm:spec_decode_num_draft_tokens"] == len(PROMPTS) * (
        MAX_TOKENS - 1)
    assert test["spec_decode"]["vllm:spec_decode_num_accepted_tokens"] == 0
    assert_greedy_close(ref["batches"][0], test["batches"][0], names=("default", "guess row"))


def _dir(tmp_path, name):
    path = tmp_path / name
    path.mkdir()
    return path
