"""Start-up checks that the model and engine options are ones the shadowkv backend can serve.

Run in the front-end process when the engine config is built, so a model the backend cannot
serve fails before any weight is loaded, with a message naming the layer or option. Never a
silent fallback to another backend.
"""

from __future__ import annotations

from vllm.logger import init_logger

from vllm_shadowkv.config import ShadowKVConfig, ShadowKVConfigError

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers and level

SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
_ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_emb_base", "rotary_pct")


def validate_engine(vllm_config) -> ShadowKVConfig:
    """Parse the settings and check model and options; return the config the engine will use."""
    config = ShadowKVConfig.from_additional_config(vllm_config.additional_config)
    from vllm_shadowkv.metrics import register_collector

    register_collector()  # before the engine processes spawn: they inherit the stats directory
    if vllm_config.cache_config.enable_prefix_caching:
        # Compressed pages are per request (their own low-rank basis): no block is shareable.
        logger.warning("shadowkv: prefix caching is not supported with compressed pages; "
                       "disabling it (pass --no-enable-prefix-caching to silence this)")
        vllm_config.cache_config.enable_prefix_caching = False
    model_config = vllm_config.model_config
    check_model(model_config)
    check_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
    config.check_engine(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model_config.get_head_size(),
    )
    return config


def check_kv_cache_dtype(cache_dtype: str) -> None:
    if cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ShadowKVConfigError(
            f"--kv-cache-dtype {cache_dtype} is not supported by the shadowkv backend; "
            f"allowed: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )


def check_model(model_config) -> None:
    name = model_config.model
    text = model_config.hf_text_config
    if model_config.use_mla:
        raise ShadowKVConfigError(
            f"model {name} uses multi-head latent attention (MLA); the shadowkv backend serves "
            "decoder models with standard multi-head / grouped-query attention only"
        )
    if model_config.is_encoder_decoder:
        raise ShadowKVConfigError(
            f"model {name} is an encoder-decoder model (cross-attention layers); the shadowkv "
            "backend serves decoder-only models"
        )
    layer_types = list(getattr(text, "layer_types", None) or [])
    for kind, label in (("sliding_attention", "sliding-window"), ("chunked_attention", "chunked-local")):
        layers = [i for i, t in enumerate(layer_types) if t == kind]
        if layers:
            raise ShadowKVConfigError(
                f"model {name} has {label} attention layers {_ranges(layers)}; the shadowkv "
                "backend needs full causal attention in every layer"
            )
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        raise ShadowKVConfigError(
            f"model {name} uses sliding-window attention (sliding_window={text.sliding_window}) "
            "in all layers; the shadowkv backend needs full causal attention"
        )
    if getattr(text, "attention_chunk_size", None):
        raise ShadowKVConfigError(
            f"model {name} uses chunked-local attention (attention_chunk_size="
            f"{text.attention_chunk_size}); the shadowkv backend needs full causal attention"
        )
    no_rope = [i for i, use in enumerate(getattr(text, "no_rope_layers", None) or []) if not use]
    if no_rope:
        raise ShadowKVConfigError(
            f"model {name} has layers without rotary embedding (NoPE layers {_ranges(no_rope)}); "
            "the shadowkv backend rebuilds keys with RoPE and needs it in every layer"
        )
    if not any(getattr(text, key, None) is not None for key in _ROPE_KEYS):
        raise ShadowKVConfigError(
            f"model {name} has no rotary position embedding (none of {', '.join(_ROPE_KEYS)} in "
            "its config); the shadowkv backend needs RoPE models"
        )


def _ranges(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return shown + (f", ... ({len(indices)} layers)" if len(indices) > 8 else "")
