"""Let vLLM's CPU platform honour ``--attention-backend shadowkv``.

``CpuPlatform.get_attn_backend_cls`` returns ``CPU_ATTN`` whatever backend was selected. When the
selection is this plugin's engine backend, validate it the way the CUDA platform validates a selected
backend and return it; every other selection goes to the original method unchanged.
"""

from __future__ import annotations

_EXPECTED = ["selected_backend", "attn_selector_config", "num_heads"]


def apply() -> None:
    from vllm.platforms.cpu import CpuPlatform

    from vllm_shadowkv.patches import check_signature

    original = CpuPlatform.get_attn_backend_cls
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "CpuPlatform.get_attn_backend_cls")
    original_func = original.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        from vllm_shadowkv.plugin import BACKEND_CLASS_PATH, is_engine_backend

        if not is_engine_backend(selected_backend):
            return original_func(cls, selected_backend, attn_selector_config, num_heads)
        from vllm_shadowkv.backend.attention import KVCompressionBackend

        reasons = KVCompressionBackend.validate_configuration(
            device_capability=None, **attn_selector_config._asdict()
        )
        if reasons:
            raise ValueError(
                "The vllm-shadowkv attention backend cannot serve this layer: "
                f"{'; '.join(reasons)} "
                f"({attn_selector_config!r})"
            )
        return BACKEND_CLASS_PATH

    get_attn_backend_cls._shadowkv_original = original_func
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
