"""MiniKV compressed for real inside vLLM (CPU, fresh processes): the paper's defaults on the
constructed retrieval model (prompts really compressed per the engine's own counters, the
in-engine fidelity probe within bounds), and the fused Triton kernel over the quantized pages
called from the model runner against the torch path. The method table's shared engine tests
(exactness with covering settings, lifecycle, capacity) run MiniKV too."""

import pytest
from engine_utils import (assert_greedy_close, assert_one_host_wait_per_layer,
                          generate_in_fresh_process)
from test_engine_sparse import long_prompt

pytestmark = pytest.mark.slow


def test_defaults_compress_and_stay_close_to_dense(tmp_path):
    """2 bits, 25 % pyramid heavy hitters + 25 % recent window: each layer attends about half
    the prompt (counted by the engine), the needle is answered, and the compressed output stays
    close to dense attention over the exact context in every layer (measured: < 0.001 in the
    first two, 0.15 in the last, whose pyramid budget is 3.6 % heavy hitters; 2-bit groups alone
    give 0.002 there)."""
    from transformers import AutoTokenizer

    from vllm_shadowkv.eval import tasks
    from vllm_shadowkv.eval.retrieval_model import FIXTURE

    tokenizer = AutoTokenizer.from_pretrained(str(FIXTURE))
    sample = tasks.generate("niah_single", tokenizer, 2048, depth=0.5, seed=1)
    result = generate_in_fresh_process({
        "model": str(FIXTURE), "attention_backend": "minikv", "max_tokens": 24,
        "ignore_eos": True,  # the model ends its answer; the probe runs on every step
        "batches": [[sample.prompt + sample.answer_prefix]],
        "engine_kwargs": {"max_model_len": 4096, "enable_prefix_caching": False,
                          "max_num_batched_tokens": 1024,  # chunked prefill: column sums add up
                          "additional_config": {"minikv": {"min_sparse_len": 1024,
                                                           "measure_fidelity": True}}},
    }, tmp_path)
    (stats,) = result["stats"][0]["finished"].values()
    assert stats["mode"] == "sparse" and len(result["batches"][0][0]["token_ids"]) == 24
    layers, kv_heads = 3, 2
    steps = stats["decode_steps"] // layers
    assert steps == 23  # every generated token but the last was decoded compressed
    kept = stats["selected"] / (steps * layers * kv_heads)  # prompt tokens kept per KV head
    assert 0.45 * stats["prompt_len"] <= kept <= 0.51 * stats["prompt_len"]
    fidelity = stats["fidelity"]
    assert sorted(map(int, fidelity)) == [0, 1, 2]
    errors = {layer: f["relative_error"] for layer, f in fidelity.items()}
    print(f"\nminikv defaults, relative error vs dense per layer: {errors}; token recall: "
          f"{ {layer: round(f['chunk_recall'], 3) for layer, f in fidelity.items()} }")
    assert max(errors.values()) < 0.25
    answer = tokenizer.decode(result["batches"][0][0]["token_ids"])
    assert tasks.score(sample, answer) == 1.0


def test_triton_kernel_over_quantized_pages_gives_the_torch_tokens(tiny_model, tmp_path):
    """The fused dequantize-attend kernel (under TRITON_INTERPRET=1) on the pages of a 2-bit
    compressed request, with a generated-token fold, and the column-sum kernel behind its
    heavy hitters, against the torch path; along that path each layer's decode waits for the
    device at most once."""
    batch = [long_prompt(55, 5)]  # ~330 tokens
    settings = {"min_sparse_len": 256, "residual": 16}
    runs = {}
    for kernels, env in (("torch", {}), ("triton", {"TRITON_INTERPRET": "1"})):
        engine = {"max_model_len": 1024, "enable_prefix_caching": False,
                  "additional_config": {"minikv": settings | {"kernels": kernels}}}
        path = tmp_path / kernels
        path.mkdir()
        runs[kernels] = generate_in_fresh_process(
            {"model": tiny_model, "batches": [batch], "max_tokens": 20,
             "attention_backend": "minikv", "engine_kwargs": engine,
             "count_host_waits": kernels == "triton"}, path, env=env)
    assert_greedy_close(runs["torch"]["batches"][0], runs["triton"]["batches"][0],
                        names=("torch", "triton"), logprob_tol=0.02)
    assert_one_host_wait_per_layer(runs["triton"]["host_waits"])
    # MiniKV fetches nothing from a store: its decode never waits for the device.
    assert not [c for c in runs["triton"]["host_waits"] if c["reads"] or c["copies"]]
    (stats,) = runs["triton"]["stats"][0]["finished"].values()
    assert stats["mode"] == "sparse" and stats["decode_steps"] > 0
