"""Run the plugin's backends on vLLM's Model Runner V1, in every process.

Where Triton works (GPUs), vLLM 0.32 picks Model Runner V2 (``vllm/v1/worker/gpu/``). The engine
needs what only V1 has: ``GPUModelRunner._update_states`` (where ``patches/runner_requests.py``
learns the batch's request ids and the released requests) and its ``input_batch`` (the prompt
length of each metadata row); V2 has neither, so the runner hook would never register and the
metadata builder would fail during memory profiling. ``VllmConfig.use_v2_model_runner`` is a
property of the config, so answering False whenever one of the plugin's methods is selected
holds in the front end, the engine core, every TP rank and Ray worker alike. An explicit
``VLLM_USE_V2_MODEL_RUNNER=1`` is refused at start-up (``backend/engine_check.py``).
"""

from __future__ import annotations


def apply() -> None:
    from vllm.config import VllmConfig

    from vllm_shadowkv.patches import PatchTargetChanged, own_attribute

    original = own_attribute(VllmConfig, "use_v2_model_runner")
    if not isinstance(original, property):
        raise PatchTargetChanged("vllm-shadowkv cannot patch VllmConfig.use_v2_model_runner: it "
                                 "is no longer a property. The installed vLLM is not supported.")
    if getattr(original.fget, "_shadowkv_original", None) is not None:
        return

    def use_v2_model_runner(self) -> bool:
        from vllm_shadowkv.plugin import selects_plugin

        if selects_plugin(self.attention_config.backend):
            return False
        return original.fget(self)

    use_v2_model_runner._shadowkv_original = original
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)
