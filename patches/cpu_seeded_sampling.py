"""Keep a CPU engine alive when a request with a ``seed`` has its prompt prefilled in chunks.

After sampling, vLLM's runner rewinds the generator of each row whose token it discards (a
prompt chunk that is not the last) by ``gen.set_offset(gen.get_offset() - 4)``: an offset only
CUDA's Philox generators have. A CPU generator raises "CPU Generator does not use offset" and
the engine core dies with every request in it. On the CPU any seeded request whose prompt is
longer than a step's token budget hits it (the OpenAI API's `seed`, which evaluation harnesses
set).

Instead, those rows sample without their generator (the global one draws their discarded
token), so the request's generator is not advanced at all: what the rewind achieves on CUDA,
and the seeded tokens do not depend on how the prompt was chunked. Only the CPU runner, only
for the plugin's methods.
"""

from __future__ import annotations

_EXPECTED = ["self", "grammar_output"]


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from vllm_shadowkv.patches import check_signature

    original = CPUModelRunner.sample_tokens
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "CPUModelRunner.sample_tokens")

    def sample_tokens(self, grammar_output):
        held = hold_discarded_generators(self)
        try:
            return original(self, grammar_output)
        finally:
            self.input_batch.generators.update(held)

    sample_tokens._shadowkv_original = original
    CPUModelRunner.sample_tokens = sample_tokens


def hold_discarded_generators(runner) -> dict:
    """Take the generators of the rows whose sampled token this step discards out of the batch
    (and so out of the sampler's metadata, which shares the dict); returns them by row."""
    from vllm_shadowkv.plugin import selects_plugin

    generators = runner.input_batch.generators
    if not generators or not selects_plugin(runner.vllm_config.attention_config.backend):
        return {}
    discard = runner.discard_request_mask.np[:runner.input_batch.num_reqs]
    return {row: generators.pop(row) for row in list(generators) if discard[row]}
