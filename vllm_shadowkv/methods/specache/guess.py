"""SpeCache's guess row through vLLM's speculative decoding (methods/README.md, "SpeCache's
second query row"): the proposer vLLM builds from ``speculative_config`` (method
"custom_class", model ``PROPOSER`` or ``ACCEPTING_PROPOSER``, one speculative token) and the
hand-over of the guesses from the sampling patch (patches/guess_row.py).

Each decode step feeds [output token, guess]; the argmax of the guess row's logits is the next
step's guess. vLLM calls ``propose`` right after sampling, in the same step and worker process,
with the batch rows in the same order, so the guesses pass through one module-level list.

Pre-decoding (the paper's Alg. 2, setting ``pre_decode``): a compressed request's first decode
step attends the low-bit cache only, its output row picks the next step's top-k, and the
output row's argmax is the first guess. The attention marks the requests it pre-decoded
(``mark_pre_decoded``); the sampling patch then drops the step's tokens and
patches/pre_decode.py rolls the step back, so the first token is decoded again, with the
prefetched rows and that guess.

Verifying on a miss (``verify_guess: "miss"``): the sampling patch also records the requests
whose output token differed from the guess fed beside it (``set_missed``). The slots their
guess row picked were picked for another token, so at their next step the attention lets the
output row pick its own top-k and fetches what the slots lack (``missed``).
"""

from __future__ import annotations

import functools

import numpy as np

PROPOSER = "vllm_shadowkv.methods.specache.guess.GuessProposer"
ACCEPTING_PROPOSER = "vllm_shadowkv.methods.specache.guess.AcceptingGuessProposer"
LOOKUP_MAX = 16  # the longest context suffix the lookup matches

# Per batch row, from this step's sampling: the next guess, whether it stands (the guess fed
# this step was the output row's token, or the step pre-decoded), and whether the step
# pre-decoded (its tokens dropped).
_guesses: tuple[list[int], list[bool], list[bool]] | None = None
# This step's pre-decoded request ids, from the attention to the sampling patch.
_pre_decoded: set[str] = set()
# The requests whose last guess was wrong, from the sampling patch to the next step's attention.
_missed: frozenset[str] = frozenset()


def keep_guesses(guesses: list[int], confirmed: list[bool], pre_decoded: list[bool]) -> None:
    global _guesses
    _guesses = (guesses, confirmed, pre_decoded)


def take_guesses() -> tuple[list[int], list[bool], list[bool]] | None:
    global _guesses
    guesses, _guesses = _guesses, None
    return guesses


def mark_pre_decoded(req_ids) -> None:
    _pre_decoded.update(req_ids)


def take_pre_decoded() -> set[str]:
    global _pre_decoded
    taken, _pre_decoded = _pre_decoded, set()
    return taken


def set_missed(req_ids) -> None:
    global _missed
    _missed = frozenset(req_ids)


def missed() -> frozenset[str]:
    """The requests whose output token at the last step was not the guess fed beside it."""
    return _missed


@functools.cache
def _matcher():
    # Imported on first use: numba and the n-gram module are not loaded with the plugin.
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens)

    return _find_longest_matched_ngram_and_propose_tokens


def lookup(tokens: np.ndarray, min_n: int) -> int | None:
    """The token after the longest earlier occurrence (min_n to LOOKUP_MAX tokens) of the
    context's end (vLLM's n-gram proposer's matcher), None without one."""
    found = _matcher()(tokens, min_n, LOOKUP_MAX, len(tokens) + 1, 1)
    return int(found[0]) if len(found) else None


class GuessProposer:
    """Proposes, for each request that got a token this step, the guess row's argmax; with no
    guess row in the step (the prompt's step), the token just sampled as a placeholder; for a
    request that pre-decoded (no token this step), its output row's argmax.

    A guess row that followed a wrong guess predicts what comes after the wrong token, and a
    chain of guesses started wrong stays wrong. With ``guess_lookup`` n > 0, the guess after
    a wrong one (or none) is instead the token that followed the context's end where it
    occurred before, matched on at least n tokens (prompt lookup), when there is such a match:
    a copy from the prompt (a needle's digits) is guessed right from the first step."""

    accept_guess = False  # read by patches/guess_row.py: reject every guess (the paper)

    def __init__(self, vllm_config) -> None:
        from vllm_shadowkv.config import stamp_of

        assert vllm_config.speculative_config.num_speculative_tokens == 1
        self.lookup_min = stamp_of(vllm_config).settings.guess_lookup  # the front end's
        if self.lookup_min:
            lookup(np.zeros(4, dtype=np.int32), 1)  # compile the matcher now, not mid-step

    def load_model(self, model) -> None:
        """Nothing to load: the guesses come from the target model's own second row."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        taken = take_guesses()
        out = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled and not (taken and taken[2][i]):
                out.append([])
                continue
            guess, confirmed = (taken[0][i], taken[1][i]) if taken else (sampled[-1], False)
            if self.lookup_min and not confirmed and token_ids_cpu is not None:
                found = lookup(token_ids_cpu[i, :num_tokens_no_spec[i]], self.lookup_min)
                guess = guess if found is None else found
            out.append([guess])
        return out


class AcceptingGuessProposer(GuessProposer):
    """``accept_guess``: vLLM's own verification, two tokens when the guess was right."""

    accept_guess = True
