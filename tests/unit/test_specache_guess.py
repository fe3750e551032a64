"""SpeCache's guess row without an engine: the proposer and the sampling patch's hand-over
(patches/guess_row.py) on a stand-in runner and sampler. Through vLLM:
tests/integration/test_specache_speculative.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID as PLACEHOLDER

from vllm_shadowkv.config import STAMP_KEY, Stamp
from vllm_shadowkv.methods.specache import guess
from vllm_shadowkv.methods.specache.settings import SpeCacheSettings
from vllm_shadowkv.patches.guess_row import sample_with_guesses
from vllm_shadowkv.patches.pre_decode import dropped_steps


def _proposer(cls, **settings):
    stamp = Stamp("specache", SpeCacheSettings(**settings), store_bytes=0)
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=1),
                             additional_config={STAMP_KEY: stamp.to_json()})
    return cls(config)


def _step(proposer, sampled_by_verification, req_ids=("r0", "r1", "r2")):
    """One step of three requests, the second without a draft (its bonus row is its only row):
    logits rows [r0 output, r0 guess, r1 output, r2 output, r2 guess]."""
    logits = torch.zeros(5, 50)
    for row, token in enumerate([11, 21, 31, 41, 12]):
        logits[row, token] = 1.0
    # Drafts fed this step: r0 11 (its output row's token: confirmed), r2 40 (wrong).
    metadata = SimpleNamespace(bonus_logits_indices=torch.tensor([1, 2, 4]),
                               num_draft_tokens=[1, 0, 1], cu_num_draft_tokens=torch.tensor(
                                   [1, 1, 2]), draft_token_ids=torch.tensor([11, 40]))

    def original(runner, logits_in, metadata_in):
        logits_in.zero_()  # the sampler may modify the logits in place
        return SimpleNamespace(sampled_token_ids=sampled_by_verification.clone())

    runner = SimpleNamespace(drafter=proposer, input_batch=SimpleNamespace(req_ids=list(req_ids)))
    return sample_with_guesses(original, runner, logits, metadata)


@pytest.mark.parametrize("cls, kept", [
    (guess.GuessProposer, [[11, PLACEHOLDER], [31, PLACEHOLDER], [41, PLACEHOLDER]]),
    (guess.AcceptingGuessProposer, [[11, 21], [31, PLACEHOLDER], [41, PLACEHOLDER]])])
def test_guess_is_the_guess_rows_argmax_and_rejected_unless_accepted(cls, kept):
    proposer = _proposer(cls)
    # Request 0's guess was right (verification accepted it and added the bonus token).
    verified = torch.tensor([[11, 21], [31, PLACEHOLDER], [41, PLACEHOLDER]])
    out = _step(proposer, verified)
    assert out.sampled_token_ids.tolist() == kept
    emitted = [[t for t in row if t != PLACEHOLDER] for row in kept]
    # Next guesses: the last logits row of each request, taken before the sampler ran.
    assert proposer.propose(emitted, None, None) == [[21], [31], [12]]
    assert guess.missed() == {"r2"}  # fed 40, wrote 41: its next step verifies on "miss"


def test_after_a_wrong_guess_the_context_is_looked_up():
    """r0's guess was confirmed: its guess row's stands. r1 had no guess and r2 a wrong one:
    the token that followed their context's end before (n >= 3), else the guess row's."""
    proposer = _proposer(guess.GuessProposer)
    verified = torch.tensor([[11, 21], [31, PLACEHOLDER], [41, PLACEHOLDER]])
    emitted = [[11], [31], [41]]
    contexts = np.zeros((3, 12), dtype=np.int32)
    contexts[0, :7] = [5, 6, 7, 8, 5, 6, 7]  # would look up 8: not asked, the guess was right
    contexts[1, :5] = [1, 2, 3, 4, 5]  # no earlier occurrence
    contexts[2, :9] = [9, 7, 3, 41, 8, 2, 7, 3, 41]  # "7 3 41" was followed by 8
    lengths = np.array([7, 5, 9])
    _step(proposer, verified)
    assert proposer.propose(emitted, lengths, contexts) == [[21], [31], [8]]
    # A match shorter than guess_lookup is not taken; 0 keeps the paper's guess row.
    contexts[2, :9] = [9, 6, 3, 41, 8, 2, 7, 3, 41]  # "3 41" only
    for proposer in (_proposer(guess.GuessProposer),
                     _proposer(guess.GuessProposer, guess_lookup=0)):
        _step(proposer, verified)
        assert proposer.propose(emitted, lengths, contexts) == [[21], [31], [12]]
    # The first decode step (no guess row at all): looked up too.
    guess.take_guesses()
    contexts[2, :9] = [9, 7, 3, 41, 8, 2, 7, 3, 41]
    assert _proposer(guess.GuessProposer).propose(emitted, lengths, contexts) == [
        [8], [31], [8]]


def test_without_a_guess_the_sampled_token_is_the_placeholder():
    proposer = _proposer(guess.GuessProposer)
    guess.take_guesses()  # nothing left from another test
    # After a prefill step (no guess row): the sampled token; a prefill chunk gets no draft.
    assert proposer.propose([[7], [], [9, 4]], None, None) == [[7], [], [4]]


def test_a_pre_decoded_step_emits_nothing_and_guesses_its_output_rows_argmax():
    """r2 pre-decoded this step (its first decode step): both its tokens are dropped, its
    next guess is its output row's argmax (the prompt lookup is not asked), and vLLM's
    scheduler is told to roll the step back (patches/pre_decode.py); r0 and r1 as before."""
    proposer = _proposer(guess.GuessProposer)
    guess.mark_pre_decoded(["r2", "not-in-this-batch"])
    verified = torch.tensor([[11, 21], [31, PLACEHOLDER], [41, PLACEHOLDER]])
    out = _step(proposer, verified)
    assert out.sampled_token_ids.tolist() == [[11, PLACEHOLDER], [31, PLACEHOLDER],
                                              [PLACEHOLDER, PLACEHOLDER]]
    contexts = np.zeros((3, 12), dtype=np.int32)
    contexts[1, :5] = [1, 2, 3, 4, 5]  # no earlier occurrence
    contexts[2, :9] = [9, 7, 3, 41, 8, 2, 7, 3, 41]  # a lookup would propose 8
    emitted = [[11], [31], []]
    assert proposer.propose(emitted, np.array([7, 5, 9]), contexts) == [[21], [31], [41]]
    assert guess.take_pre_decoded() == set()  # taken by the step that sampled them

    config = SimpleNamespace(speculative_config=SimpleNamespace(method="custom_class",
                                                                model=guess.PROPOSER))
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={"r0": [11], "r2": [40]})
    runner_output = SimpleNamespace(sampled_token_ids=emitted,
                                    req_id_to_index={"r0": 0, "r1": 1, "r2": 2})
    assert dropped_steps(config, scheduled, runner_output) == ["r2"]
    # vLLM's own verification (accept_guess) and other drafters are left alone.
    for model in (guess.ACCEPTING_PROPOSER, "ngram"):
        config.speculative_config.model = model
        assert dropped_steps(config, scheduled, runner_output) == []


def test_other_runners_are_left_alone():
    calls = []

    def original(runner, logits, metadata):
        calls.append(metadata)
        return "sampled"

    assert sample_with_guesses(original, SimpleNamespace(), torch.zeros(2, 5), "m") == "sampled"
    plain = SimpleNamespace(drafter=_proposer(guess.GuessProposer))
    assert sample_with_guesses(original, plain, torch.zeros(2, 5), None) == "sampled"
    assert calls == ["m", None] and guess.take_guesses() is None
    assert guess.missed() == set()  # a step without guesses leaves nothing to verify
