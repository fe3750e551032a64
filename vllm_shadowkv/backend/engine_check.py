"""Start-up: which method runs, with which settings, on a model and options it can serve.

Run in the front-end process when the engine config is built, so a bad setting or a model the
engine cannot serve fails before any weight is loaded, with a message naming the setting, the
layer or the option and what to change. Never a silent fallback to another backend.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from vllm_shadowkv.backend.layout import PageLayout
from vllm_shadowkv.config import (HOST_LIMIT, STAMP_KEY, Stamp, human_bytes, parse_settings,
                                  settings_block, stamp_of, store_capacity)
from vllm_shadowkv.methods import method_class
from vllm_shadowkv.methods.base import KVShapes, SettingsError

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers and level

SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
_ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_emb_base", "rotary_pct",
              "rotary_dim", "partial_rotary_factor")


def select_method(vllm_config) -> str | None:
    """The method the user selected, or None. A method's name becomes vLLM's ``CUSTOM`` slot
    here (the config then pickles into the engine processes); ``CUSTOM`` itself is accepted only
    with the stamp an earlier check wrote (a config rebuilt from a checked one)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_shadowkv.plugin import is_engine_backend, named_method

    attention = vllm_config.attention_config
    method = named_method(attention.backend)
    if method is not None:
        attention.backend = AttentionBackendEnum.CUSTOM
        return method
    if is_engine_backend(attention.backend):
        stamp = stamp_of(vllm_config)
        if stamp is None:
            from vllm_shadowkv.methods import METHODS

            raise SettingsError(
                "the CUSTOM attention backend is vllm-shadowkv's: select one of its methods by "
                f"name instead, --attention-backend {' | '.join(METHODS)}")
        return stamp.method
    return None


def validate_engine(vllm_config, method: str) -> Stamp:
    """Parse and check everything, resolve the settings against the model, and write the stamp
    the engine processes read. A config that already carries a stamp (vLLM checks its config
    again in the engine core) keeps it: the front end consumed --kv-offloading-size."""
    stamp = stamp_of(vllm_config)
    if stamp is not None:
        return stamp
    cls = method_class(method)
    settings = parse_settings(cls.settings_cls,
                              settings_block(vllm_config.additional_config, method))
    from vllm_shadowkv.metrics import register_collector

    register_collector()  # before the engine processes spawn: they inherit the stats directory
    cache_config, model_config = vllm_config.cache_config, vllm_config.model_config
    if cache_config.enable_prefix_caching and cls.prefix_caching_off is not None:
        logger.warning("%s: prefix caching is not supported (%s); disabling it (pass "
                       "--no-enable-prefix-caching to silence this)", method,
                       cls.prefix_caching_off)
        cache_config.enable_prefix_caching = False
    check_model(model_config, method, needs_rope=cls.needs_rope)
    check_cpu_matmul(model_config.dtype, method)
    check_kv_cache_dtype(cache_config.cache_dtype, method)
    parallel = vllm_config.parallel_config
    shapes = KVShapes(
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_size=model_config.get_head_size(), dtype=model_config.dtype,
        block_size=cache_config.block_size,
        num_layers=model_config.get_num_layers(parallel),
        max_model_len=model_config.max_model_len)
    settings = settings.for_model(model_config)
    settings.check_engine(shapes)
    check_kernels(settings, method)
    check_runner(vllm_config, method)
    check_parallel(vllm_config.parallel_config, method)
    check_speculative(vllm_config, settings, method)
    settings = settings.resolved(shapes)
    check_kv_offloading(vllm_config, method)
    host_per_worker = host_memory_per_worker(vllm_config)
    store, source = store_capacity(settings, cache_config, parallel.tensor_parallel_size,
                                   host_per_worker)
    check_host_memory(store, source, host_per_worker, method)
    logger.info("%s: host store of up to %s per worker (%s)", method, human_bytes(store), source)
    stamp = Stamp(method, settings, store)
    check_store_fits(PageLayout(stamp.build(shapes)), store, source, method)
    if cache_config.kv_offloading_size is not None:
        logger.info("%s: the host store is sized by %s (%s per worker), not vLLM's own KV "
                    "offloading of --kv-offloading-size %g GiB, which is not started", method,
                    source, human_bytes(store), cache_config.kv_offloading_size)
        # Cleared whichever sized the store: vLLM turns it into its offloading connector after
        # this check, which would move the compressed pages behind the method's back.
        cache_config.kv_offloading_size = None
    vllm_config.additional_config[STAMP_KEY] = stamp.to_json()
    return stamp


def check_runner(vllm_config, method: str) -> None:
    """Model Runner V1 (``patches/model_runner_v1.py`` says why), and no CUDA-graph capture
    that would record the KV write without the engine's metadata."""
    from vllm import envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise SettingsError(
            f"the {method} attention backend runs on vLLM's Model Runner V1 (its runner hook "
            "reads V1's batch state); unset VLLM_USE_V2_MODEL_RUNNER=1")
    # Features vLLM implements in Model Runner V2 only: on V1 they would silently not happen.
    v2_only = {"--watermark-config": getattr(vllm_config, "watermark_config", None),
               "HiSparse (attention_config.hisparse_config)":
                   getattr(vllm_config.attention_config, "hisparse_config", None)}
    for name, value in v2_only.items():
        if value is not None:
            raise SettingsError(
                f"the {method} attention backend runs on vLLM's Model Runner V1, and {name} "
                "needs Model Runner V2 (on V1 it would not happen); remove it")
    if vllm_config.compilation_config.use_inductor_graph_partition:
        raise SettingsError(
            f"the {method} attention backend cannot run with use_inductor_graph_partition: the "
            "captured graphs would write the KV cache without the engine's per-step metadata; "
            "remove it from --compilation-config")
    logger.info("%s: running on vLLM's Model Runner V1", method)


def check_parallel(parallel, method: str) -> None:
    """Tensor and data parallelism, no pipeline parallelism: the per-layer policies (MiniKV's
    budgets, TailorKV's q_layers) index a worker's layers as the model's, and no
    pipeline-parallel run was ever tested (vLLM 0.32's CPU runner fails one even with its own
    backend)."""
    if parallel.pipeline_parallel_size > 1:
        raise SettingsError(
            f"the {method} attention backend does not support pipeline parallelism "
            f"(--pipeline-parallel-size {parallel.pipeline_parallel_size}); split the model "
            "with --tensor-parallel-size instead")


def check_speculative(vllm_config, settings, method: str) -> None:
    """The speculative decoding the settings need (SpeCache's guess row), which the front end
    fills in when none was given (``patches/guess_config.py``); none of the guess proposers
    without it (their guess rows are attended by SpeCache's decode only)."""
    import json

    from vllm_shadowkv.methods.specache.guess import ACCEPTING_PROPOSER, PROPOSER

    wanted, spec = settings.speculative_config(), vllm_config.speculative_config
    have = None if spec is None else {"method": spec.method, "model": spec.model,
                                      "num_speculative_tokens": spec.num_speculative_tokens}
    if wanted is not None and have != wanted:
        raise SettingsError(
            f"{method}.prefetch 'speculative' runs its guess row through vLLM's speculative "
            f"decoding: pass --speculative-config '{json.dumps(wanted)}' or none (it is then "
            f"set for you), or set {method}.prefetch 'current'; got {have}")
    if wanted is None and have is not None and have["model"] in (PROPOSER, ACCEPTING_PROPOSER):
        raise SettingsError(
            f"--speculative-config {have['model']} proposes SpeCache's guess rows, which only "
            f"--attention-backend specache with prefetch 'speculative' attends; remove it")


def check_kernels(settings, method: str) -> None:
    import os

    from vllm.platforms import current_platform

    if (settings.kernels == "triton" and not current_platform.is_cuda_alike()
            and os.environ.get("TRITON_INTERPRET") != "1"):
        raise SettingsError(
            f"{method}.kernels 'triton' on {current_platform.device_name} needs "
            "TRITON_INTERPRET=1 (Triton compiles for GPUs only; the interpreter is for testing "
            "the kernel path); use 'auto' or 'torch'")


def check_kv_offloading(vllm_config, method: str) -> None:
    """vLLM's own KV connectors would move the compressed pages behind the method's back."""
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_connector:
        raise SettingsError(
            f"the {method} attention backend keeps its own host store and cannot run with a KV "
            f"connector ({transfer.kv_connector}); remove --kv-transfer-config (to size the "
            "host store, use --kv-offloading-size or the method's value_store_gib)")
    cache_config = vllm_config.cache_config
    backend = cache_config.kv_offloading_backend
    if cache_config.kv_offloading_size is not None and backend != "native":
        raise SettingsError(
            f"--kv-offloading-backend {backend} cannot share the "
            f"{method} host store; use the default 'native' (--kv-offloading-size then sizes "
            "the host store) or another attention backend")


def check_store_fits(layout: PageLayout, store: int, source: str, method: str) -> None:
    """One max-length prompt must fit in the host store, or it would wait forever."""
    max_len = layout.shapes.max_model_len
    need = layout.store_bytes(max_len)
    if need > store:
        raise SettingsError(
            f"the {method} host store ({human_bytes(store)} per worker, from {source}) cannot "
            f"hold one {max_len}-token prompt ({human_bytes(need)} per worker); raise "
            f"{method}.value_store_gib to at least {need / (1 << 30):.4f} or "
            "--kv-offloading-size accordingly (it is split over the workers), or lower "
            "--max-model-len")


def host_memory_per_worker(vllm_config) -> int | None:
    """Host memory available now to each worker this node runs (every rank of each local
    data-parallel engine), less the KV cache a CPU worker will allocate in it; None under Ray,
    whose workers may live on other nodes."""
    import psutil
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.distributed_executor_backend == "ray":
        return None
    local_engines = parallel.data_parallel_size_local or 1
    share = psutil.virtual_memory().available // (parallel.tensor_parallel_size * local_engines)
    kv_cache = vllm_config.cache_config.kv_cache_memory_bytes
    if current_platform.is_cpu() and kv_cache:
        share -= kv_cache
    return max(share, 0)


def check_host_memory(store: int, source: str, host_per_worker: int | None, method: str) -> None:
    """A store the host cannot back would fill up under load until the OS kills the server."""
    if host_per_worker is not None and store > HOST_LIMIT * host_per_worker:
        raise SettingsError(
            f"the {method} host store ({human_bytes(store)} per worker, from {source}) does not "
            f"fit in this host's memory: {human_bytes(host_per_worker)} is available per worker "
            f"now, and the store may use at most {HOST_LIMIT:.0%} of it; lower it (or leave "
            "it unset: the default fits the host)")


def check_cpu_matmul(dtype: torch.dtype, method: str) -> None:
    """A warning, not an error: a 16-bit model on a CPU where oneDNN has no matmul of its dtype
    (AVX2 CPUs) runs vLLM's linear layers on torch's fallback, at a fifth to a sixth of their
    fp32 speed (benchmarks/RESULTS.md, "fp16 models' prefill in C on AVX2"). An fp32 model then
    serves faster, and the method's kernels take it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or dtype not in (torch.bfloat16, torch.float16):
        return
    if not _onednn_matmul(dtype):
        name = str(dtype).removeprefix("torch.")
        logger.warning("%s: this CPU has no %s matrix multiply in oneDNN, so vLLM's "
                       "linear layers run several times slower than in float32; serve with "
                       "--dtype float32 (the plugin's kernels take it)", method, name)


def _onednn_matmul(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN multiplies dtype on this CPU (as vLLM's CPU linear layers need);
    True where torch cannot say (a build without oneDNN): no warning on a guess."""
    try:
        supported = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
                     else torch.ops.mkldnn._is_mkldnn_fp16_supported)
        return bool(supported())
    except (AttributeError, RuntimeError):
        return True


def check_kv_cache_dtype(cache_dtype: str, method: str) -> None:
    if cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise SettingsError(
            f"--kv-cache-dtype {cache_dtype} is not supported by the {method} backend; "
            f"allowed: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )


def check_model(model_config, method: str, needs_rope: bool) -> None:
    name = model_config.model
    text = model_config.hf_text_config
    if model_config.use_mla:
        raise SettingsError(
            f"model {name} uses multi-head latent attention (MLA); the {method} backend serves "
            "decoder models with standard multi-head / grouped-query attention only"
        )
    if model_config.is_attention_free or model_config.is_hybrid:
        raise SettingsError(
            f"model {name} has state-space or linear-attention layers (an attention-free or "
            f"hybrid model); the {method} backend serves models whose every layer is full "
            "causal attention"
        )
    if model_config.is_encoder_decoder:
        raise SettingsError(
            f"model {name} is an encoder-decoder model (cross-attention layers); the {method} "
            "backend serves decoder-only models"
        )
    layer_types = list(getattr(text, "layer_types", None) or [])
    for kind, label in (("sliding_attention", "sliding-window"),
                        ("chunked_attention", "chunked-local")):
        layers = [i for i, t in enumerate(layer_types) if t == kind]
        if layers:
            raise SettingsError(
                f"model {name} has {label} attention layers {_ranges(layers)}; the {method} "
                "backend needs full causal attention in every layer"
            )
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        raise SettingsError(
            f"model {name} uses sliding-window attention (sliding_window={text.sliding_window}) "
            f"in all layers; the {method} backend needs full causal attention"
        )
    if getattr(text, "dual_chunk_attention_config", None):
        raise SettingsError(
            f"model {name} uses dual-chunk attention (dual_chunk_attention_config); the {method} "
            "backend needs full causal attention"
        )
    if getattr(text, "attention_chunk_size", None):
        raise SettingsError(
            f"model {name} uses chunked-local attention (attention_chunk_size="
            f"{text.attention_chunk_size}); the {method} backend needs full causal attention"
        )
    if not needs_rope:
        return
    no_rope = [i for i, use in enumerate(getattr(text, "no_rope_layers", None) or []) if not use]
    if no_rope:
        raise SettingsError(
            f"model {name} has layers without rotary embedding (NoPE layers {_ranges(no_rope)}); "
            f"the {method} backend rebuilds keys with RoPE and needs it in every layer"
        )
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if "mrope_section" in rope:
        raise SettingsError(
            f"model {name} uses multimodal rotary embedding (M-RoPE, mrope_section in its config),"
            f" which rotates by three position streams; the {method} backend rebuilds keys from "
            "the token's position"
        )
    if not any(getattr(text, key, None) is not None for key in _ROPE_KEYS):
        raise SettingsError(
            f"model {name} has no rotary position embedding (none of {', '.join(_ROPE_KEYS)} in "
            f"its config); the {method} backend needs RoPE models"
        )


def _ranges(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return shown + (f", ... ({len(indices)} layers)" if len(indices) > 8 else "")
