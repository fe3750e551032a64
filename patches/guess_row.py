"""SpeCache's guess row (methods/specache/guess.py): keep the guess row's argmax, reject the guess.

Wraps ``GPUModelRunner._sample`` (also the CPU runner's) when the runner's drafter is a
``GuessProposer``; every other runner is left as it was. vLLM hands a custom proposer only the
accepted tokens, and the guess row's own token (the rejection sampler's bonus token) is dropped
with a rejected draft, so the argmax of each request's last logits row is taken first (the
sampler may modify the logits in place) and left for the proposer. Unless the proposer accepts
guesses, only column 0 of the output (the output row's token) is kept: the guess counts as
rejected, vLLM rolls its position back and it is never committed.
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
    from vllm_shadowkv.methods.specache.guess import GuessProposer, keep_guesses

    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, GuessProposer) or spec_decode_metadata is None:
        return original(runner, logits, spec_decode_metadata)
    guesses = logits[spec_decode_metadata.bonus_logits_indices].argmax(dim=-1).tolist()
    output = original(runner, logits, spec_decode_metadata)
    confirmed = _confirmed(spec_decode_metadata, output.sampled_token_ids[:, 0])
    if not drafter.accept_guess:
        from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

        output.sampled_token_ids[:, 1:] = PLACEHOLDER_TOKEN_ID
    keep_guesses(guesses, confirmed)
    return output


def _confirmed(metadata, output_tokens: torch.Tensor) -> list[bool]:
    """Per request: whether it was fed a guess and the output row's token is that guess."""
    drafts = metadata.draft_token_ids
    if not drafts.numel():
        return [False] * len(metadata.num_draft_tokens)
    drafted = torch.tensor(metadata.num_draft_tokens, device=drafts.device) > 0
    last = drafts[(metadata.cu_num_draft_tokens - 1).clamp(min=0).long()]
    return (drafted & (output_tokens.to(drafts.device) == last)).tolist()
