"""Validate shadowkv settings and the model in the front-end process, at engine config time.

vLLM has no plugin hook that sees the finished engine config before workers start; the platform's
``check_and_update_config`` is the last step of ``VllmConfig.__post_init__`` and runs in the
process that parses the user's options. Wrapping it makes a bad setting or an unsupported model
fail there, with our message, before any worker or weight is loaded.
"""

from __future__ import annotations

_EXPECTED = ["vllm_config"]


def apply() -> None:
    from vllm.platforms import current_platform

    from vllm_shadowkv.patches import check_signature

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, f"{platform_cls.__name__}.check_and_update_config")
    original_func = original.__func__

    def check_and_update_config(cls, vllm_config):
        original_func(cls, vllm_config)  # first: it settles block size and cache dtype
        from vllm_shadowkv.plugin import is_shadowkv_selected

        if is_shadowkv_selected(vllm_config):
            from vllm_shadowkv.backend.model_check import validate_engine

            validate_engine(vllm_config)

    check_and_update_config._shadowkv_original = original_func
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
