"""Refuse streaming-input sessions under the plugin's methods.

vLLM's streaming input (``AsyncLLM.generate`` with an input stream, the realtime endpoint) keeps
a request and its KV cache between chunks and extends its prompt in place. Every page layout here
is derived from the prompt length (a compressed prompt's region, store rows and budgets, and
whether it is compressed at all), and no worker hook hears that it changed: a session would be
attended from pages laid out for another prompt. Each chunk of a session passes through
``InputProcessor.process_inputs`` with ``resumable=True`` in the front end, where vLLM itself
refuses what streaming input does not support: so does this patch, before anything reaches the
engine. The client gets the error (a 400 from the server); the engine keeps serving.
"""

from __future__ import annotations

_EXPECTED = ["self", "request_id", "prompt", "params", "supported_tasks", "arrival_time",
             "lora_request", "tokenization_kwargs", "trace_headers", "priority",
             "data_parallel_rank", "resumable", "session_id", "kv_hints"]


def apply() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_shadowkv.patches import check_signature

    original = InputProcessor.process_inputs
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "InputProcessor.process_inputs")

    def process_inputs(self, *args, resumable: bool = False, **kwargs):
        if resumable:
            refuse_streaming_input(self.vllm_config)
        return original(self, *args, resumable=resumable, **kwargs)

    process_inputs._shadowkv_original = original
    InputProcessor.process_inputs = process_inputs


def refuse_streaming_input(vllm_config) -> None:
    from vllm.exceptions import VLLMValidationError

    from vllm_shadowkv.config import stamp_of

    stamp = stamp_of(vllm_config)
    if stamp is not None:
        raise VLLMValidationError(
            f"streaming input is not supported by the {stamp.method} attention backend: a "
            f"session extends its prompt after the KV cache was laid out (and compressed) for "
            f"it; send each turn as its own request")
