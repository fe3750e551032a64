"""SpeCache's pre-decoding (methods/specache/guess.py): a step whose tokens the sampling patch
dropped is rolled back whole, so that the request decodes the same position again.

Wraps ``Scheduler.update_from_output``. vLLM rolls back only the rejected drafts of a step that
emitted a token; a decode step that emitted none (its output row and guess both dropped)
would keep both positions counted as computed. Only with the guess proposer that rejects every
guess (the one that can pre-decode), and only for requests that were scheduled a draft and got
no token: vLLM itself empties a request's tokens only for prefill chunks, which get no drafts.
The patch sees the scheduler's side only: the runner's ``sampled_token_ids`` is how the worker
says it, so it works across the executor's processes.
"""

from __future__ import annotations

_EXPECTED = ["self", "scheduler_output", "model_runner_output"]


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_shadowkv.patches import check_signature

    original = Scheduler.update_from_output
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "Scheduler.update_from_output")

    def update_from_output(self, scheduler_output, model_runner_output):
        dropped = dropped_steps(self.vllm_config, scheduler_output, model_runner_output)
        outputs = original(self, scheduler_output, model_runner_output)
        for req_id in dropped:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                request.num_computed_tokens -= scheduler_output.num_scheduled_tokens[req_id]
        return outputs

    update_from_output._shadowkv_original = original
    Scheduler.update_from_output = update_from_output


def dropped_steps(vllm_config, scheduler_output, model_runner_output) -> list[str]:
    """Requests scheduled a guess whose step emitted no token: the pre-decoded ones."""
    from vllm_shadowkv.methods.specache.guess import PROPOSER

    spec = vllm_config.speculative_config
    sampled = model_runner_output.sampled_token_ids
    if spec is None or spec.model != PROPOSER or not sampled:
        return []
    index = model_runner_output.req_id_to_index
    return [req_id for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items()
            if drafts and req_id in index and not sampled[index[req_id]]]
