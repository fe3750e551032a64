"""SpeCache's guess row through vLLM's speculative decoding (methods/README.md, "SpeCache's
second query row"): the proposer vLLM builds from ``speculative_config`` (method
"custom_class", model ``PROPOSER`` or ``ACCEPTING_PROPOSER``, one speculative token) and the
hand-over of the guesses from the sampling patch (patches/guess_row.py).

Each decode step feeds [output token, guess]; the argmax of the guess row's logits is the next
step's guess. vLLM calls ``propose`` right after sampling, in the same step and worker process,
with the batch rows in the same order, so the guesses pass through one module-level list.
"""

from __future__ import annotations

PROPOSER = "vllm_shadowkv.methods.specache.guess.GuessProposer"
ACCEPTING_PROPOSER = "vllm_shadowkv.methods.specache.guess.AcceptingGuessProposer"

_guesses: list[int] | None = None  # per batch row, from this step's sampling


def keep_guesses(guesses: list[int] | None) -> None:
    global _guesses
    _guesses = guesses


def take_guesses() -> list[int] | None:
    global _guesses
    guesses, _guesses = _guesses, None
    return guesses


class GuessProposer:
    """Proposes, for each request that got a token this step, the guess row's argmax; with no
    guess row in the step (the first decode step), the token just sampled as a placeholder."""

    accept_guess = False  # read by patches/guess_row.py: reject every guess (the paper)

    def __init__(self, vllm_config) -> None:
        assert vllm_config.speculative_config.num_speculative_tokens == 1

    def load_model(self, model) -> None:
        """Nothing to load: the guesses come from the target model's own second row."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        guesses = take_guesses()
        return [[] if not sampled else [guesses[i] if guesses is not None else sampled[-1]]
                for i, sampled in enumerate(sampled_token_ids)]


class AcceptingGuessProposer(GuessProposer):
    """``accept_guess``: vLLM's own verification, two tokens when the guess was right."""

    accept_guess = True
