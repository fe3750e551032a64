"""Resolve the selected method and validate it in the front-end process, at engine config time.

vLLM has no plugin hook that sees the finished engine config before workers start; the platform's
``check_and_update_config`` runs in ``VllmConfig.__post_init__``, in the process that parses the
user's options. Wrapping it makes a bad setting or an unsupported model fail there, with our
message, before any worker or weight is loaded; it is also where a method's name is turned into
vLLM's ``CUSTOM`` slot plus the stamp that carries the method to the engine processes
(``vllm_shadowkv/plugin.py`` says why).
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
        from vllm_shadowkv.backend.engine_check import select_method, validate_engine

        method = select_method(vllm_config)  # before vLLM's checks: they see CUSTOM
        original_func(cls, vllm_config)  # then: it settles block size and cache dtype
        if method is not None:
            validate_engine(vllm_config, method)

    check_and_update_config._shadowkv_original = original_func
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
