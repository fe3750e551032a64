"""Backend specs of the runner turn into vllm.LLM keyword arguments."""

import pytest

from vllm_shadowkv.eval.backends import parse


def test_default_leaves_vllm_choice():
    assert parse("default").llm_kwargs() == {}


def test_shadowkv_with_and_without_settings():
    assert parse("shadowkv").llm_kwargs() == {"attention_backend": "shadowkv"}
    spec = parse('shadowkv:{"sparse_budget": 64}')
    assert spec.label == 'shadowkv:{"sparse_budget": 64}'
    assert spec.llm_kwargs() == {"attention_backend": "shadowkv",
                                 "additional_config": {"shadowkv": {"sparse_budget": 64}}}


def test_naive_variant_is_a_setting_of_the_same_backend():
    spec = parse('shadowkv-naive:{"sparse_budget": 64}')
    assert spec.llm_kwargs()["additional_config"] == {
        "shadowkv": {"selection": "naive", "sparse_budget": 64}}


@pytest.mark.parametrize("bad", ['default:{"a": 1}', "shadowkv:[1]", ":{}", "shadowkv:{bad"])
def test_bad_specs_are_refused(bad):
    with pytest.raises(ValueError):
        parse(bad)
