"""SpeCache's guess row (methods/specache/guess.py): keep the guess row's argmax, reject the guess.

Wraps ``GPUModelRunner._sample`` (also the CPU runner's) when the runner's drafter is a
``GuessProposer``; every other runner is left as it was. vLLM hands a custom proposer only the
accepted tokens, and the guess row's own token (the rejection sampler's bonus token) is dropped
with a rejected draft, so the argmax of each request's last logits row is taken first (the
sampler may modify the logits in place) and left for the proposer. Unless the proposer accepts
guesses, only column 0 of the output (the output row's token) is kept: the guess counts as
rejected, vLLM rolls its position back and it is never committed. For the requests the
attention pre-decoded this step (methods/specache/guess.py), the whole row is dropped and the
next guess is the argmax of the output row's logits: the paper's first speculative token.
The requests whose output token was not the guess fed beside it are recorded for the next
step's attention (``verify_guess: "miss"``).
"""

from __future__ import annotations

import torch

_EXPECTED = ["self", "logits", "spec_decode_metadata"]


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_shadowkv.patches import check_signature

    original = GPUModelRunner._sample
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "GPUModelRunner._sample")

    def _sample(self, logits, spec_decode_metadata):
        return sample_with_guesses(original, self, logits, spec_decode_metadata)

    _sample._shadowkv_original = original
    GPUModelRunner._sample = _sample


def sample_with_guesses(original, runner, logits, spec_decode_metadata):
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    from vllm_shadowkv.methods.specache.guess import (GuessProposer, keep_guesses,
                                                      set_missed, take_pre_decoded)

    drafter = getattr(runner, "drafter", None)
    pre_decoded = take_pre_decoded()
    if not isinstance(drafter, GuessProposer) or spec_decode_metadata is None:
        set_missed(())  # no guess fed this step
        return original(runner, logits, spec_decode_metadata)
    last = spec_decode_metadata.bonus_logits_indices
    rows = ([i for i, r in enumerate(runner.input_batch.req_ids[:len(last)]) if r in pre_decoded]
            if pre_decoded else [])
    if rows:  # a pre-decoded request's output row is the one before its guess row
        assert all(spec_decode_metadata.num_draft_tokens[i] == 1 for i in rows)
        last = last.clone()
        last[rows] -= 1
    guesses = logits[last].argmax(dim=-1).tolist()
    output = original(runner, logits, spec_decode_metadata)
    confirmed = _confirmed(spec_decode_metadata, output.sampled_token_ids[:, 0])
    if not drafter.accept_guess:
        output.sampled_token_ids[:, 1:] = PLACEHOLDER_TOKEN_ID
    dropped = [False] * len(guesses)
    for i in rows:  # nothing emitted; patches/pre_decode.py rolls the step back
        output.sampled_token_ids[i] = PLACEHOLDER_TOKEN_ID
        confirmed[i] = dropped[i] = True
    keep_guesses(guesses, confirmed, dropped)
    set_missed(r for r, n, hit in zip(runner.input_batch.req_ids, spec_decode_metadata
                                      .num_draft_tokens, confirmed) if n and not hit)
    return output


def _confirmed(metadata, output_tokens: torch.Tensor) -> list[bool]:
    """Per request: whether it was fed a guess and the output row's token is that guess."""
    drafts = metadata.draft_token_ids
    if not drafts.numel():
        return [False] * len(metadata.num_draft_tokens)
    drafted = torch.tensor(metadata.num_draft_tokens, device=drafts.device) > 0
    last = drafts[(metadata.cu_num_draft_tokens - 1).clamp(min=0).long()]
    return (drafted & (output_tokens.to(drafts.device) == last)).tolist()
