"""Bad settings and unsupported models fail when the engine config is built, with clear messages.

``EngineArgs.create_engine_config`` is the front-end step both ``LLM(...)`` and the server run
before any engine process starts; the checks live there, so no engine is needed to test them.
"""

import json
import shutil

import pytest
from vllm.engine.arg_utils import EngineArgs


def engine_config(model, **kwargs):
    args = EngineArgs(model=model, attention_backend="shadowkv", enforce_eager=True, **kwargs)
    return args.create_engine_config()


def test_defaults_are_accepted(tiny_model):
    config = engine_config(tiny_model)
    assert config.attention_config.backend.name == "CUSTOM"  # SHADOWKV is an alias of CUSTOM


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rnak": 64}, "unknown shadowkv setting(s) 'rnak'; allowed: rank, chunk_size"),
        ({"rank": "64"}, "shadowkv.rank must be an integer, got '64'"),
        ({"rank": 64.5}, "shadowkv.rank must be an integer"),
        ({"local_window": True}, "shadowkv.local_window must be an integer, got True"),
        ({"sparse_budget": -8}, "shadowkv.sparse_budget must be >= 8, got -8"),
        ({"sparse_budget": 100}, "sparse_budget (100) must be a multiple of chunk_size (8)"),
        ({"chunk_size": 24, "sparse_budget": 240}, "chunk_size (24) must divide the KV block size (128)"),
        ({"rank": 512}, "rank (512) exceeds the key width of this model: num_kv_heads (4) x "
                        "head_dim (64) = 256; allowed: 1..256"),
        ({"min_sparse_len": 0}, "shadowkv.min_sparse_len must be >= 1"),
        ({"value_store_gib": 0}, "shadowkv.value_store_gib must be > 0"),
        ([1, 2], "additional_config.shadowkv must be a JSON object"),
    ],
)
def test_bad_setting_fails_at_startup(tiny_model, settings, message):
    with pytest.raises(ValueError) as err:
        engine_config(tiny_model, additional_config={"shadowkv": settings})
    assert message in str(err.value)


def test_settings_json_string_from_cli(tiny_model):
    config = engine_config(tiny_model, additional_config={"shadowkv": json.dumps({"rank": 96})})
    assert config.additional_config["shadowkv"]


def test_unsupported_kv_cache_dtype(tiny_model):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 is not supported by the shadowkv"):
        engine_config(tiny_model, kv_cache_dtype="fp8")


def test_backend_name_any_case(tiny_model):
    lower = EngineArgs(model=tiny_model, attention_backend="shadowkv").create_engine_config()
    upper = EngineArgs(model=tiny_model, attention_backend="SHADOWKV").create_engine_config()
    assert lower.attention_config.backend is upper.attention_config.backend


LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 320,
         "max_position_embeddings": 4096}
UNSUPPORTED = {
    "sliding-window": (
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 512,
         "rope_theta": 10000.0, **LLAMA},
        "uses sliding-window attention (sliding_window=512)",
    ),
    "interleaved sliding-window": (
        {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 64,
         "sliding_window": 512, "query_pre_attn_scalar": 64, **LLAMA},
        "has sliding-window attention layers 0, 2",
    ),
    "MLA": (
        {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
         "kv_lora_rank": 64, "q_lora_rank": None, "qk_rope_head_dim": 16,
         "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 4,
         "first_k_dense_replace": 4, **LLAMA},
        "uses multi-head latent attention (MLA)",
    ),
    "encoder-decoder": (
        {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
         "d_model": 256, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "vocab_size": 320, "num_mel_bins": 80,
         "encoder_ffn_dim": 512, "decoder_ffn_dim": 512},
        "is an encoder-decoder model (cross-attention layers)",
    ),
    "chunked-local": (
        {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "head_dim": 64,
         "intermediate_size_mlp": 512, "attention_chunk_size": 1024, "rope_theta": 500000.0,
         "num_local_experts": 2, "interleave_moe_layer_step": 1, **LLAMA},
        "has chunked-local attention layers 0, 1, 2",
    ),
    "no rotary embedding": (
        {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "n_head": 4,
         "n_layer": 2, "hidden_size": 256, "vocab_size": 320},
        "has no rotary position embedding",
    ),
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
def test_unsupported_model_fails_at_startup(tiny_model, tmp_path, kind):
    config, message = UNSUPPORTED[kind]
    model = tmp_path / kind.replace(" ", "-")
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        engine_config(str(model))
    assert message in str(err.value)
