"""Beyond Llama, through a real vLLM engine: the attention of other architectures the plugin
serves, built locally with random weights (vllm_shadowkv/models.py): Qwen2 (biased Q/K/V, YaRN,
7 query heads on one KV head) with every method, and with ShadowKV (the method that rebuilds
keys with the model's RoPE) Phi-3 (fused Q/K/V, LongRoPE read from its long table, RoPE on 3/4
of each head) and GPT-J (interleaved RoPE on half of each head, no RoPE entry in its config but
``rotary_dim``). With covering settings the greedy tokens equal the default backend's and every
decode step's attention equals dense attention (the in-engine fidelity probe)."""

import pytest
from engine_utils import assert_greedy_close, generate_in_fresh_process
from test_engine_sparse import long_prompt

from vllm_shadowkv.methods import METHODS
from vllm_shadowkv.models import RECIPES, build_model

pytestmark = pytest.mark.slow

COMMON = {
    "batches": [[long_prompt(500, 3)]],  # ~3.1K tokens: past Phi-3's original 2,048
    "max_tokens": 8,
    "engine_kwargs": {"max_model_len": 4096, "max_num_batched_tokens": 1024,
                      "enable_prefix_caching": False},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The default backend's run of a model, once per model."""
    runs = {}

    def run(name: str) -> dict:
        if name not in runs:
            runs[name] = generate_in_fresh_process(
                {**COMMON, "model": str(build_model(name)), "attention_backend": None},
                tmp_path_factory.mktemp(f"{name}-ref"))
        return runs[name]

    return run


@pytest.mark.parametrize("name, method", [("tiny-qwen2", m) for m in METHODS]
                         + [("tiny-phi3", "shadowkv"), ("tiny-gptj", "shadowkv")])
def test_other_architectures_equal_dense(name, method, reference, tmp_path):
    recipe = RECIPES[name]
    ref = reference(name)
    width = recipe.num_kv_heads * recipe.head_dim
    settings = METHODS[method].covering_settings(width, 4096) | {
        "min_sparse_len": 1024, "measure_fidelity": True}
    test = generate_in_fresh_process(
        {**COMMON, "model": str(build_model(name)), "attention_backend": method,
         "engine_kwargs": {**COMMON["engine_kwargs"], "additional_config": {method: settings}}},
        tmp_path)
    assert set(test["backends"].values()) == {method.upper()}
    assert_greedy_close(ref["batches"][0], test["batches"][0], names=("default", method))
    (stats,) = test["stats"][0]["finished"].values()
    assert stats["mode"] == "sparse" and stats["decode_steps"] > 0
    errors = [f["relative_error"] for f in stats["fidelity"].values()]
    assert len(errors) == recipe.num_layers and max(errors) < 0.02, errors
