"""The committed fixture model: rebuilt bit for bit by its builder, and it solves every needle
family with full attention (transformers at 1K, fast; vLLM's default backend at 4K, slow)."""

import pytest
import torch
from safetensors.torch import load_file

from vllm_shadowkv.eval import retrieval_model, tasks
from vllm_shadowkv.eval.filler import KEYS, VALUES

FIXTURE = retrieval_model.FIXTURE
# (task, depth, seed): a small fixed sample, every family, needles early, middle and late.
SAMPLE = [(t, d, i) for i, t in enumerate(tasks.NIAH_TASKS) for d in (0.1, 0.5, 0.9)]


def test_builder_reproduces_committed_weights(tmp_path):
    retrieval_model.build(tmp_path)
    built, committed = load_file(tmp_path / "model.safetensors"), load_file(FIXTURE / "model.safetensors")
    assert built.keys() == committed.keys()
    for name in built:
        assert torch.equal(built[name], committed[name]), name


def test_keys_and_values_are_single_tokens(word_tokenizer):
    for word in (*KEYS, *VALUES):
        assert len(word_tokenizer(word, add_special_tokens=False)["input_ids"]) == 1, word


def test_solves_needle_families_with_transformers(word_tokenizer):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16).eval()
    for task, depth, seed in SAMPLE:
        s = tasks.generate(task, word_tokenizer, 1024, depth, seed)
        ids = word_tokenizer(s.prompt + s.answer_prefix, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        text = word_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert tasks.score(s, text) == 1.0, (task, depth, s.answers, text)


@pytest.mark.slow
def test_solves_needle_families_at_4k_with_vllm_default_backend(word_tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    samples = [tasks.generate(t, word_tokenizer, 4096, d, i) for t, d, i in SAMPLE]
    prompts = [TokensPrompt(prompt_token_ids=word_tokenizer(s.prompt + s.answer_prefix)["input_ids"])
               for s in samples]
    llm = LLM(model=str(FIXTURE), enforce_eager=True, max_model_len=4200, seed=0)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for s, out in zip(samples, outs):
        assert tasks.score(s, out.outputs[0].text) == 1.0, (s.task, s.depth, s.answers, out.outputs[0].text)
