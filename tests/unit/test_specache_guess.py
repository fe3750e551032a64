"""SpeCache's guess row without an engine: the proposer and the sampling patch's hand-over
(patches/guess_row.py) on a stand-in runner and sampler. Through vLLM:
tests/integration/test_specache_speculative.py."""

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID as PLACEHOLDER

from vllm_shadowkv.methods.specache import guess
from vllm_shadowkv.patches.guess_row import sample_with_guesses


def _proposer(cls):
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=1))
    return cls(config)


def _step(proposer, sampled_by_verification):
    """One step of three requests, the second without a draft (its bonus row is its only row):
    logits rows [r0 output, r0 guess, r1 output, r2 output, r2 guess]."""
    logits = torch.zeros(5, 50)
    for row, token in enumerate([11, 21, 31, 41, 12]):
        logits[row, token] = 1.0
    metadata = SimpleNamespace(bonus_logits_indices=torch.tensor([1, 2, 4]))

    def original(runner, logits_in, metadata_in):
        logits_in.zero_()  # the sampler may modify the logits in place
        return SimpleNamespace(sampled_token_ids=sampled_by_verification.clone())

    return sample_with_guesses(original, SimpleNamespace(drafter=proposer), logits, metadata)


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


def test_without_a_guess_the_sampled_token_is_the_placeholder():
    proposer = _proposer(guess.GuessProposer)
    guess.take_guesses()  # nothing left from another test
    # After a prefill step (no guess row): the sampled token; a prefill chunk gets no draft.
    assert proposer.propose([[7], [], [9, 4]], None, None) == [[7], [], [4]]


def test_other_runners_are_left_alone():
    calls = []

    def original(runner, logits, metadata):
        calls.append(metadata)
        return "sampled"

    assert sample_with_guesses(original, SimpleNamespace(), torch.zeros(2, 5), "m") == "sampled"
    plain = SimpleNamespace(drafter=_proposer(guess.GuessProposer))
    assert sample_with_guesses(original, plain, torch.zeros(2, 5), None) == "sampled"
    assert calls == ["m", None] and guess.take_guesses() is None
