"""Every method starts with its default settings on models of different key widths and runs
compressed; under vLLM's default backend the plugin says nothing."""

import pytest
import torch
from engine_utils import default_settings, generate_in_fresh_process

from vllm_shadowkv.backend.warm_up import WARM_UP_ENV
from vllm_shadowkv.methods import METHODS
from vllm_shadowkv.models import build_model

pytestmark = pytest.mark.slow

# A 4.2K-token prompt: above the default min_sparse_len (4096); byte tokenizer, one token a byte.
LONG = "The quick brown fox jumps over the lazy dog. " * 94


# Every method on the narrow and the small key width; ShadowKV, whose rank scales with the key
# width, also at Llama-3.1-8B's (the others start there in test_capacity.py; CI time). TailorKV
# on the small width only: its S-layers' rows do not depend on it (CI time).
@pytest.mark.parametrize("method, model, key_width", [
    (method, model, width) for method in METHODS
    for model, width in [("tiny-narrow", 128), ("tiny", 256), ("llama8b-shape", 1024)]
    if (model != "llama8b-shape" or method == "shadowkv")
    and (model != "tiny-narrow" or method != "tailorkv")])
def test_defaults_start_and_run_compressed(method, model, key_width, tmp_path):
    result = generate_in_fresh_process({
        "model": str(build_model(model)), "attention_backend": method, "batches": [[LONG]],
        "max_tokens": 4, "engine_kwargs": {
            "max_model_len": 8192, "additional_config": {method: default_settings(method)}},
    }, tmp_path, env={WARM_UP_ENV: "1"}, vllm_processes=True)  # as `vllm serve` runs it
    assert set(result["backends"].values()) == {method.upper()}
    stats = result["stats"][0]
    requests = list((stats["finished"] | stats["requests"]).values())
    assert [r["mode"] for r in requests] == ["sparse"]
    assert stats["method"] == method
    # the decode kernels were compiled at start-up (patches/kernel_warm_up.py)
    assert "decode kernels compiled in" in result["log"]
    # a bf16 model on a CPU whose oneDNN has no bf16 matmul (AVX2) is told to serve fp32
    slow_linears = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert ("no bfloat16 matrix multiply in oneDNN" in result["log"]) == slow_linears
    if method == "tailorkv":  # layer 0 quantized, the others fetch their top-k from the store
        assert stats["settings"]["q_layers"] == [0]
        assert requests[0]["bytes_fetched"] > 0 and requests[0]["hits"] > 0


def test_plugin_is_silent_under_the_default_backend(tiny_model, tmp_path):
    result = generate_in_fresh_process({
        "model": tiny_model, "attention_backend": None, "batches": [["Hello"]], "max_tokens": 2},
        tmp_path)
    assert set(result["backends"].values()) == {"CPU_ATTN"}
    # vLLM's log names the file of each line; none of the plugin's may speak, nor vLLM's
    # registry about the plugin's names. (The model's path contains "vllm_shadowkv".)
    ours = ("[plugin.py", "[engine_check.py", "[worker_state.py", "[runner_requests.py",
            "[kv_spec.py", "[kernel_warm_up.py", "Registered new attention backend", "host store")
    for line in result["log"].splitlines():
        assert not any(mark in line for mark in ours), f"the plugin logged: {line}"
    assert "Resolved architecture" in result["log"]  # the log was captured


@pytest.mark.parametrize("method", ["minikv", "specache"])
def test_float16_model_computes_what_bfloat16_does(method, tiny_model, tmp_path):
    """A float16 model (GPUs without bf16 serve them) at the method's defaults: the low-bit
    pages' scales, the dequantization and the merges in fp16 give each layer's in-engine
    relative error of the bf16 model's, not an overflow's (fp16 measured within 0.014 of bf16,
    layer by layer: 0.06-0.70 with these random weights)."""
    errors = {}
    for dtype in ("float16", "bfloat16"):
        (tmp_path / dtype).mkdir()
        result = generate_in_fresh_process({
            "model": tiny_model, "attention_backend": method, "batches": [[LONG]],
            "max_tokens": 8, "engine_kwargs": {
                "max_model_len": 8192, "dtype": dtype, "additional_config": {
                    method: default_settings(method, measure_fidelity=True)}},
        }, tmp_path / dtype)
        (request,) = (result["stats"][0]["finished"] | result["stats"][0]["requests"]).values()
        assert request["mode"] == "sparse"
        errors[dtype] = {layer: f["relative_error"] for layer, f in request["fidelity"].items()}
    assert errors["float16"].keys() == errors["bfloat16"].keys()
    for layer, error in errors["float16"].items():
        assert abs(error - errors["bfloat16"][layer]) < 0.05, (layer, errors)
