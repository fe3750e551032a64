"""Backend specs of the runner turn into vllm.LLM keyword arguments with the backend's real
settings keys; a budget ratio resolves per context length."""

import pytest

from vllm_shadowkv.config import parse_settings
from vllm_shadowkv.methods.shadowkv import ShadowKVSettings
from vllm_shadowkv.eval.backends import budget_tokens, outlier_chunks, parse
from vllm_shadowkv.eval.run import engines


def test_default_leaves_vllm_choice():
    assert parse("default").llm_kwargs() == {}


def test_shadowkv_with_and_without_settings():
    assert parse("shadowkv").llm_kwargs() == {"attention_backend": "shadowkv"}
    spec = parse('shadowkv:{"sparse_budget": 64}')
    assert spec.label == 'shadowkv:{"sparse_budget": 64}' and not spec.per_length
    assert spec.llm_kwargs() == {"attention_backend": "shadowkv",
                                 "additional_config": {"shadowkv": {"sparse_budget": 64}}}


def test_budget_ratio_resolves_per_length():
    spec = parse("shadowkv@1.56%")
    assert spec.per_length and spec.budget_ratio == pytest.approx(0.0156)
    with pytest.raises(ValueError, match="resolve"):
        spec.llm_kwargs()
    # 1.56 % of 4096 = 63.9 -> 56 (whole chunks, rounded down); outliers 48 x 4096/128K = 1.5 -> 2
    assert spec.resolve(4096).llm_kwargs() == {
        "attention_backend": "shadowkv",
        "additional_config": {"shadowkv": {"sparse_budget": 56, "outlier_chunks": 2}}}
    assert spec.resolve(8192).settings == {"sparse_budget": 120, "outlier_chunks": 3}
    assert spec.resolve(131072).settings == {"sparse_budget": 2040, "outlier_chunks": 48}
    assert parse("shadowkv@1.5625%").resolve(131072).settings["sparse_budget"] == 2048
    assert parse("shadowkv@6%").resolve(16384).settings == {"sparse_budget": 976, "outlier_chunks": 6}


def test_budget_ratio_floors_at_one_chunk_and_follows_chunk_size():
    assert budget_tokens(0.0156, 256, 8) == 8
    assert outlier_chunks(256, 8) == 1
    spec = parse('shadowkv@3%:{"chunk_size": 16, "rank": 160}')
    assert spec.resolve(4096).settings == {"chunk_size": 16, "rank": 160,
                                           "sparse_budget": 112, "outlier_chunks": 1}


def test_resolved_settings_are_valid_backend_settings():
    for ratio in ("1.56%", "3%", "6%"):
        for n in (1024, 2048, 4096, 8192, 16384):
            settings = parse(f"shadowkv@{ratio}").resolve(n).settings
            parse_settings(ShadowKVSettings, {**settings, "rank": 160, "min_sparse_len": 1024})


def test_common_shadowkv_settings_go_under_the_specs_own():
    common = {"rank": 160, "min_sparse_len": 1024, "sparse_budget": 512}
    assert parse("default").with_shadowkv_settings(common).llm_kwargs() == {}
    fixed = parse('shadowkv:{"rank": 256}').with_shadowkv_settings(common)
    assert fixed.settings == {"rank": 256, "min_sparse_len": 1024, "sparse_budget": 512}
    ratio = parse("shadowkv@3%").with_shadowkv_settings(common)
    assert ratio.label == "shadowkv@3%"
    assert ratio.resolve(4096).settings == {"rank": 160, "min_sparse_len": 1024,
                                            "sparse_budget": 120, "outlier_chunks": 2}


def test_one_engine_per_length_for_ratio_specs():
    class S:
        def __init__(self, length):
            self.length = length

    samples = [S(4096), S(8192), S(4096)]
    got = [(spec.label, eng.settings.get("sparse_budget"), idx)
           for spec, eng, idx in engines([parse("default"), parse("shadowkv@3%")], samples)]
    assert got == [("default", None, [0, 1, 2]), ("shadowkv@3%", 120, [0, 2]),
                   ("shadowkv@3%", 240, [1])]


@pytest.mark.parametrize("bad", ['default:{"a": 1}', "default@3%", "shadowkv:[1]", ":{}",
                                 "shadowkv:{bad", "shadowkv@3", "shadowkv@0%", "shadowkv@x%",
                                 'shadowkv@3%:{"sparse_budget": 64}', "flash@3%"])
def test_bad_specs_are_refused(bad):
    with pytest.raises(ValueError):
        parse(bad)


def test_sink_recent_baseline_attends_as_many_tokens_without_choosing_them():
    spec = parse("sink_recent@1.56%")
    assert spec.is_shadowkv and spec.label == "sink_recent@1.56%"
    # shadowkv@1.56% at 8192: 120 selected + 3 outlier chunks of 8 -> 144 recent tokens, no outliers
    assert spec.resolve(8192).settings == {"selection": "sink_recent", "sparse_budget": 144,
                                           "outlier_chunks": 0}
    parse_settings(ShadowKVSettings, spec.resolve(4096).settings)
    with pytest.raises(ValueError, match="for shadowkv and sink_recent only"):
        parse("flash@3%")


def test_a_label_names_a_spec_and_any_plugin_method_takes_settings():
    spec = parse('recent@50%=minikv:{"heavy_ratio": 0, "recent_ratio": 0.5}')
    assert spec.label == "recent@50%" and spec.method == "minikv" and not spec.is_shadowkv
    assert spec.llm_kwargs() == {"attention_backend": "minikv", "additional_config": {
        "minikv": {"heavy_ratio": 0, "recent_ratio": 0.5}}}
    assert parse("default").method is None
    assert parse('x=shadowkv:{"rank": 8}').settings == {"rank": 8}
