"""Tell the shadowkv backend which requests a worker runs and which ones it releases.

Wraps ``GPUModelRunner._update_states`` (also the CPU runner's): before the runner updates its
batch, register the runner (request ids and prompt lengths of the batch rows) and the step's
guess rows (SpeCache), and release the value-store space of finished, aborted, preempted and resumed requests (a resumed request is
recomputed from scratch, so its old values are stale).
"""

from __future__ import annotations

_EXPECTED = ["self", "scheduler_output"]


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_shadowkv.patches import check_signature

    original = GPUModelRunner._update_states
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "GPUModelRunner._update_states")

    def _update_states(self, scheduler_output):
        from vllm_shadowkv.backend.worker_state import STATE
        from vllm_shadowkv.plugin import logger

        STATE.attach(self)
        STATE.release(*released_requests(scheduler_output))
        STATE.guesses = guess_rows(self, scheduler_output)
        STATE.report(logger)
        return original(self, scheduler_output)

    _update_states._shadowkv_original = original
    GPUModelRunner._update_states = _update_states


def released_requests(scheduler_output) -> tuple[set[str], set[str]]:
    """(ended: finished or aborted, suspended: preempted or resumed) request ids."""
    suspended = set(scheduler_output.preempted_req_ids or ())
    suspended |= scheduler_output.scheduled_cached_reqs.resumed_req_ids
    return set(scheduler_output.finished_req_ids), suspended


def guess_rows(runner, scheduler_output) -> dict[str, int]:
    """Rows per request that vLLM will roll back for sure: the drafts of the guess proposer
    that rejects every guess (patches/guess_row.py)."""
    from vllm_shadowkv.methods.specache.guess import GuessProposer

    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, GuessProposer) or drafter.accept_guess:
        return {}
    return {req_id: len(tokens)
            for req_id, tokens in scheduler_output.scheduled_spec_decode_tokens.items()}
