"""Bad settings and unsupported models fail when the engine config is built, with clear messages.

``EngineArgs.create_engine_config`` is the front-end step both ``LLM(...)`` and the server run
before any engine process starts; the checks live there, so no engine is needed to test them.
"""

import json
import shutil

import pytest
from vllm.engine.arg_utils import EngineArgs


from vllm_shadowkv.config import STAMP_KEY


def engine_config(model, backend="shadowkv", **kwargs):
    args = EngineArgs(model=model, attention_backend=backend, enforce_eager=True, **kwargs)
    return args.create_engine_config()


def host_memory(monkeypatch, gib):
    """Pretend the host has ``gib`` GiB available."""
    from types import SimpleNamespace

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=gib << 30))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # (sizes the CPU KV cache)


def test_defaults_are_accepted_and_stamped(tiny_model, monkeypatch):
    host_memory(monkeypatch, 64)
    config = engine_config(tiny_model)
    assert config.attention_config.backend.name == "CUSTOM"  # the method travels in the stamp
    stamp = config.additional_config[STAMP_KEY]
    assert stamp["method"] == "shadowkv"
    assert stamp["settings"]["rank"] == 40  # 160 of 1024 key channels, at this model's 256
    assert stamp["store_bytes"] == 16 << 30



def test_the_host_store_fits_the_hosts_memory(tiny_model, monkeypatch):
    """The default shrinks to half of what each worker has; an explicit size the host cannot
    back fails before anything loads (under load it would fill until the server is killed)."""
    host_memory(monkeypatch, 8)
    stamp = engine_config(tiny_model, tensor_parallel_size=2).additional_config[STAMP_KEY]
    assert stamp["store_bytes"] == 2 << 30  # 8 GiB over 2 workers, half of it
    stamp = engine_config(tiny_model, data_parallel_size=2).additional_config[STAMP_KEY]
    assert stamp["store_bytes"] == 2 << 30  # two engines of one worker each on this node
    # A CPU worker's KV cache comes out of the same memory first
    stamp = engine_config(tiny_model, tensor_parallel_size=2,
                          kv_cache_memory_bytes=2 << 30).additional_config[STAMP_KEY]
    assert stamp["store_bytes"] == 1 << 30
    with pytest.raises(ValueError) as err:
        engine_config(tiny_model, additional_config={"shadowkv": {"value_store_gib": 12}})
    message = str(err.value)
    assert "host store (12.00 GiB per worker, from shadowkv.value_store_gib)" in message
    assert "8.00 GiB is available per worker now" in message and "at most 90%" in message
    with pytest.raises(ValueError, match=r"8.00 GiB per worker, from --kv-offloading-size"):
        engine_config(tiny_model, kv_offloading_size=16, tensor_parallel_size=2)


def test_minikv_settings_are_checked_with_the_allowed_values(tiny_model):
    stamp = engine_config(tiny_model, backend="MiniKV").additional_config[STAMP_KEY]
    assert stamp["method"] == "minikv" and stamp["settings"]["bits"] == 2
    with pytest.raises(ValueError, match="minikv.bits must be one of 2, 4, 16"):
        engine_config(tiny_model, backend="minikv", additional_config={"minikv": {"bits": 8}})
    with pytest.raises(ValueError, match=r"minikv.group_size \(24\) must divide the head size"):
        engine_config(tiny_model, backend="minikv",
                      additional_config={"minikv": {"group_size": 24, "residual": 48}})


def test_settings_for_another_method_are_refused(tiny_model):
    with pytest.raises(ValueError, match="settings for 'minikv', but the attention backend is "
                                         "'shadowkv'"):
        engine_config(tiny_model, additional_config={"minikv": {"bits": 2}})


def test_custom_without_a_method_is_refused(tiny_model):
    with pytest.raises(ValueError, match="select one of its methods by name"):
        engine_config(tiny_model, backend="CUSTOM")


def test_a_store_too_small_for_one_prompt_fails_before_loading_in_mib(tiny_model):
    # 4 layers x 4 KV heads x 64 dims x bf16 values of a 4096-token prompt: about 8 MiB.
    with pytest.raises(ValueError) as err:
        engine_config(tiny_model, max_model_len=4096,
                      additional_config={"shadowkv": {"value_store_gib": 0.0073}})
    message = str(err.value)
    assert "host store (7.5 MiB per worker, from shadowkv.value_store_gib)" in message
    assert "cannot hold one 4096-token prompt (8.0 MiB per worker)" in message
    assert "raise shadowkv.value_store_gib to at least 0.0078" in message


def test_model_runner_v1_is_chosen_for_the_plugin_only(tiny_model, monkeypatch):
    config = engine_config(tiny_model)
    default = EngineArgs(model=tiny_model, enforce_eager=True).create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # as vLLM decides where Triton works
    assert default.use_v2_model_runner is True
    assert config.use_v2_model_runner is False


def test_an_explicit_v2_runner_or_graph_partition_is_refused(tiny_model, monkeypatch):
    with pytest.raises(ValueError, match="cannot run with use_inductor_graph_partition"):
        engine_config(tiny_model, compilation_config={"use_inductor_graph_partition": True})
    with pytest.raises(ValueError, match="--watermark-config needs Model Runner V2 .*; remove "
                                         "it"):
        engine_config(tiny_model, watermark_config={"key": 7})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="runs on vLLM's Model Runner V1 .* unset "
                                         "VLLM_USE_V2_MODEL_RUNNER=1"):
        engine_config(tiny_model)


def test_pipeline_parallelism_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"does not support pipeline parallelism "
                                         r"\(--pipeline-parallel-size 2\); split the model with "
                                         r"--tensor-parallel-size"):
        engine_config(tiny_model, pipeline_parallel_size=2)


def test_the_triton_kernel_path_on_the_cpu_needs_the_interpreter(tiny_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kernels 'triton' on cpu needs TRITON_INTERPRET=1"):
        engine_config(tiny_model, additional_config={"shadowkv": {"kernels": "triton"}})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine_config(tiny_model, additional_config={"shadowkv": {"kernels": "triton"}})


def test_kv_offloading_size_is_the_host_store(tiny_model):
    config = engine_config(tiny_model, kv_offloading_size=2.0)
    assert config.additional_config[STAMP_KEY]["store_bytes"] == 2 << 30
    assert config.kv_transfer_config is None  # vLLM's own offloading connector is not started
    explicit = engine_config(tiny_model, kv_offloading_size=2.0,
                             additional_config={"shadowkv": {"value_store_gib": 0.5}})
    assert explicit.additional_config[STAMP_KEY]["store_bytes"] == 1 << 29
    assert explicit.kv_transfer_config is None  # value_store_gib won; no connector either


def test_a_kv_connector_beside_the_host_store_is_refused(tiny_model):
    from vllm.config import KVTransferConfig

    with pytest.raises(ValueError, match="cannot run with a KV connector"):
        engine_config(tiny_model, kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both"))
    with pytest.raises(ValueError, match="--kv-offloading-backend lmcache cannot share"):
        engine_config(tiny_model, kv_offloading_size=2.0, kv_offloading_backend="lmcache")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rnak": 64}, "unknown shadowkv setting(s) 'rnak'; allowed: min_sparse_len, value_store_gib"),
        ({"rank": "64"}, "shadowkv.rank must be an integer or null (unset), got '64'"),
        ({"rank": 64.5}, "shadowkv.rank must be an integer"),
        ({"local_window": True}, "shadowkv.local_window must be an integer, got True"),
        ({"sparse_budget": -8}, "shadowkv.sparse_budget must be >= 8, got -8"),
        ({"sparse_budget": 100}, "sparse_budget (100) must be a multiple of chunk_size (8)"),
        ({"sparse_budget_ratio": 1.5}, "shadowkv.sparse_budget_ratio must be in (0, 1] (a share "
                                       "of each prompt, the paper's 1.56 % is 0.0156) or unset, "
                                       "got 1.5"),
        ({"outlier_ratio": 0}, "shadowkv.outlier_ratio must be in (0, 1] (a share of each "
                               "prompt, the paper's 48 chunks of 8 tokens at 128K are 0.0029) "
                               "or unset, got 0"),
        ({"chunk_size": 24, "sparse_budget": 240}, "chunk_size (24) must divide the KV block size (128)"),
        ({"rank": 512}, "rank (512) exceeds the key width of this model: num_kv_heads (4) x "
                        "head_dim (64) = 256; allowed: 1..256"),
        ({"rank": None, "chunk_size": 0}, "shadowkv.chunk_size must be >= 1, got 0"),
        ({"min_sparse_len": 0}, "shadowkv.min_sparse_len must be >= 1"),
        ({"value_store_gib": 0}, "shadowkv.value_store_gib must be a finite number > 0"),
        ([1, 2], "additional_config.shadowkv must be a JSON object"),
    ],
)
def test_bad_setting_fails_at_startup(tiny_model, settings, message):
    with pytest.raises(ValueError) as err:
        engine_config(tiny_model, additional_config={"shadowkv": settings})
    assert message in str(err.value)


def test_settings_json_string_from_cli(tiny_model):
    config = engine_config(tiny_model, additional_config={"shadowkv": json.dumps({"rank": 96})})
    assert config.additional_config[STAMP_KEY]["settings"]["rank"] == 96


def test_unsupported_kv_cache_dtype(tiny_model):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 is not supported by the shadowkv"):
        engine_config(tiny_model, kv_cache_dtype="fp8")


def test_backend_name_any_case(tiny_model):
    lower = EngineArgs(model=tiny_model, attention_backend="shadowkv").create_engine_config()
    upper = EngineArgs(model=tiny_model, attention_backend="ShadowKV").create_engine_config()
    assert lower.attention_config.backend is upper.attention_config.backend
    assert lower.additional_config == upper.additional_config


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
    "attention-free": (
        {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 256,
         "state_size": 16, "num_hidden_layers": 2, "vocab_size": 320, "expand": 2,
         "conv_kernel": 4},
        "has state-space or linear-attention layers (an attention-free or hybrid model)",
    ),
    "hybrid": (
        {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "attn_layer_period": 2,
         "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
         "num_experts": 2, "num_experts_per_tok": 1, "mamba_d_state": 16, "mamba_d_conv": 4,
         "mamba_expand": 2, "mamba_dt_rank": 16, **LLAMA},
        "has state-space or linear-attention layers (an attention-free or hybrid model)",
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
    "dual-chunk": (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 10000.0,
         "dual_chunk_attention_config": {"chunk_size": 1024, "local_size": 128}, **LLAMA},
        "uses dual-chunk attention (dual_chunk_attention_config)",
    ),
    "multimodal rotary embedding": (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
         "rope_scaling": {"rope_type": "default", "rope_theta": 10000.0,
                          "mrope_section": [8, 12, 12]}, **LLAMA},
        "uses multimodal rotary embedding (M-RoPE, mrope_section in its config)",
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


def test_tailorkvs_predicted_query_needs_a_llama_family_model(tiny_model, tmp_path):
    """Refused in the front end, before any weights load (the load checks the layers again)."""
    predicted = {"tailorkv": {"channel_query": "predicted", "q_layers": [0]}}
    config = engine_config(tiny_model, "tailorkv", additional_config=predicted)
    assert config.additional_config[STAMP_KEY]["settings"]["channel_query"] == "predicted"
    model = tmp_path / "qwen2"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 10000.0,
         **LLAMA}))
    with pytest.raises(ValueError, match=r"channel_query 'predicted' needs a Llama-family model "
                                         r".*Qwen2ForCausalLM is Qwen2ForCausalLM"):
        engine_config(str(model), "tailorkv", additional_config=predicted)


def test_a_spec_flag_of_zero_is_the_users_not_the_plugins(tiny_model):
    """vLLM takes --spec-tokens 0 as given (it tests for None): the plugin must not add its
    guess-row config beside it, which made vLLM report a --speculative-config the user never
    passed; vLLM's own check of the user's value answers."""
    with pytest.raises(ValueError) as err:
        engine_config(tiny_model, backend="specache", spec_tokens=0,
                      additional_config={"specache": {"prefetch": "speculative"}})
    assert "mutually exclusive" not in str(err.value)
    assert "num_speculative_tokens" in str(err.value)


def test_streaming_input_sessions_are_refused_per_request(tiny_model):
    """A session extends its prompt after the pages were laid out for it: each chunk passes
    through the front end's input processor (resumable), which refuses it as a client error;
    other requests, and other backends' sessions, are untouched."""
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_shadowkv.patches.streaming_input import refuse_streaming_input

    processor = SimpleNamespace(vllm_config=engine_config(tiny_model, backend="minikv"))
    with pytest.raises(VLLMValidationError, match="streaming input is not supported by the "
                                                  "minikv attention backend"):
        InputProcessor.process_inputs(processor, "r", {"prompt_token_ids": [1]}, None, (),
                                      resumable=True)
    refuse_streaming_input(engine_config(tiny_model, backend=None))  # another backend: nothing
