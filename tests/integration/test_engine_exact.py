"""The shadowkv backend inside a real vLLM engine (CPU, default process layout, fresh processes)."""

import pytest
from engine_utils import PROMPTS, assert_greedy_close, generate_in_fresh_process

pytestmark = pytest.mark.slow


def test_offline_shadowkv_is_used_and_matches_default_backend(tiny_model, tmp_path):
    # Two batches in one engine; the 1.5K-token prompt is prefilled in 512-token chunks.
    common = {
        "model": tiny_model,
        "batches": [PROMPTS, [PROMPTS[2], PROMPTS[0], PROMPTS[1]]],
        "max_tokens": 24,
        "engine_kwargs": {"max_model_len": 4096, "max_num_batched_tokens": 512},
    }
    # Both engines in vLLM's own processes, as an offline job runs them.
    ref = generate_in_fresh_process({**common, "attention_backend": None}, _dir(tmp_path, "ref"),
                                    vllm_processes=True)
    # --kv-offloading-size (GiB, split over the workers) sizes the host store in the engine.
    test = generate_in_fresh_process(
        {**common, "attention_backend": "shadowkv",
         "engine_kwargs": {**common["engine_kwargs"], "kv_offloading_size": 0.5}},
        _dir(tmp_path, "shadowkv"), vllm_processes=True)
    assert set(ref["backends"].values()) == {"CPU_ATTN"}
    assert len(test["backends"]) == 4 and set(test["backends"].values()) == {"SHADOWKV"}
    assert test["runner"]["v1"] and test["runner"]["use_v2_model_runner"] is False
    assert test["stats"][0]["store"]["capacity_bytes"] == 1 << 29
    for ref_batch, test_batch in zip(ref["batches"], test["batches"]):
        assert_greedy_close(ref_batch, test_batch, names=("default", "shadowkv"))
    # Same prompt, same engine, another batch: the cache pages of batch 1 did not leak in.
    assert test["batches"][1][1]["token_ids"] == test["batches"][0][0]["token_ids"]


def _dir(tmp_path, name):
    path = tmp_path / name
    path.mkdir()
    return path
