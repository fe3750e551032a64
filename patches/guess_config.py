"""SpeCache's guess row runs through vLLM's speculative decoding (methods/README.md, "SpeCache's
second query row"): with ``--attention-backend specache`` and prefetch "speculative", fill in the
``speculative_config`` its settings need (``EngineSettings.speculative_config``) when the user
gave none.

Wraps ``EngineArgs.create_speculative_config``, where vLLM turns the options into that config,
rather than setting it in the start-up check (``startup_validation.py``): that check runs at
the end of ``VllmConfig.__post_init__``, after vLLM has derived the scheduler's token budget,
async scheduling and the CUDA-graph sizes from the speculative config, which would then stay as
without it. A user config that differs is left as given, for the start-up check to refuse
(``engine_check.check_speculative`` names the one to pass); so is a ``VllmConfig`` built
without ``EngineArgs``.
"""

from __future__ import annotations

_EXPECTED = ["self", "target_model_config", "target_parallel_config"]


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_shadowkv.patches import check_signature

    original = EngineArgs.create_speculative_config
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "EngineArgs.create_speculative_config")

    def create_speculative_config(self, target_model_config, target_parallel_config):
        flags = (self.spec_method, self.spec_model, self.spec_tokens)  # as vLLM: set if not None
        if self.speculative_config is None and all(flag is None for flag in flags):
            self.speculative_config = needed_speculative_config(self)
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config._shadowkv_original = original
    EngineArgs.create_speculative_config = create_speculative_config


def needed_speculative_config(args) -> dict | None:
    """What the selected method's settings need (a copy), None for other backends."""
    from vllm.config import AttentionConfig

    from vllm_shadowkv.config import parse_settings, settings_block
    from vllm_shadowkv.methods import method_class
    from vllm_shadowkv.plugin import named_method

    backend = args.attention_backend
    if backend is None and isinstance(args.attention_config, AttentionConfig):
        backend = args.attention_config.backend
    method = named_method(AttentionConfig.validate_backend_before(backend))
    if method is None:
        return None
    settings = parse_settings(method_class(method).settings_cls,
                              settings_block(args.additional_config, method))
    wanted = settings.speculative_config()
    return None if wanted is None else dict(wanted)
