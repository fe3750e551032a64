"""Settings: parsing, types, ranges, the per-method key, defaults scaled to the model."""

import pytest

from vllm_shadowkv.config import Stamp, parse_settings, settings_block, store_capacity
from vllm_shadowkv.methods import METHODS, NAMES, method_class
from vllm_shadowkv.methods.base import KVShapes, SettingsError
from vllm_shadowkv.methods.shadowkv import ShadowKVSettings


def shapes(kv_heads=8, head=128, block=16):
    import torch

    return KVShapes(kv_heads, head, torch.bfloat16, block, num_layers=2, max_model_len=8192)


def test_paper_defaults_with_the_rank_scaled_to_the_key_width():
    s = parse_settings(ShadowKVSettings, {})
    assert (s.rank, s.chunk_size, s.sparse_budget, s.outlier_chunks, s.local_window) == (
        None, 8, 2048, 48, 32)
    assert s.resolved(shapes(8, 128)).rank == 160  # the paper's 160 of 1024 channels
    assert s.resolved(shapes(4, 64)).rank == 40
    assert s.resolved(shapes(4, 32)).rank == 20
    assert s.resolved(shapes(3, 64)).rank == 30
    explicit = parse_settings(ShadowKVSettings, {"rank": 96})
    assert explicit.resolved(shapes(4, 32)) is explicit  # explicit settings stay exact...
    with pytest.raises(SettingsError, match=r"rank \(96\) exceeds the key width"):
        explicit.check_engine(shapes(4, 16))  # ...and are refused when they cannot apply


def test_other_plugins_keys_are_ignored_and_json_strings_parse():
    raw = settings_block({"shadowkv": '{"chunk_size": 16}', "other_plugin": {"x": 1}}, "shadowkv")
    assert parse_settings(ShadowKVSettings, raw).chunk_size == 16
    s = parse_settings(ShadowKVSettings, {"value_store_gib": 2})
    assert s.value_store_gib == 2.0 and isinstance(s.value_store_gib, float)


def test_a_block_for_another_method_is_an_error():
    with pytest.raises(SettingsError, match="settings for 'minikv', but the attention backend "
                                            "is 'shadowkv'"):
        settings_block({"minikv": {}}, "shadowkv")


def test_a_block_under_a_differently_cased_key_is_not_ignored():
    with pytest.raises(SettingsError, match="key\\(s\\) 'ShadowKV' would be ignored: the methods' "
                                            "keys are lower case"):
        settings_block({"ShadowKV": {"rank": 32}}, "shadowkv")


@pytest.mark.parametrize("engine, message", [
    (dict(block=16), None),
    (dict(block=12), "must divide the KV block size (12)"),
])
def test_engine_checks(engine, message):
    settings = ShadowKVSettings()
    if message is None:
        settings.check_engine(shapes(**engine))
    else:
        with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
            settings.check_engine(shapes(**engine))


def test_selection_names_the_allowed_modes():
    assert parse_settings(ShadowKVSettings, {"selection": "sink_recent"}).selection == "sink_recent"
    with pytest.raises(SettingsError, match="selection must be one of 'landmarks', 'sink_recent'"):
        parse_settings(ShadowKVSettings, {"selection": "recent"})
    with pytest.raises(SettingsError, match="selection must be one of 'landmarks', 'sink_recent', "
                                            "got 1"):
        parse_settings(ShadowKVSettings, {"selection": 1})


@pytest.mark.parametrize("method, raw, allowed", [
    ("shadowkv", {"kernels": 0}, "one of 'auto', 'triton', 'torch', got 0"),
    ("minikv", {"layer_policy": 2}, "one of 'pyramid', 'uniform', got 2"),
    ("specache", {"prefetch": True}, "one of 'current', 'speculative', got True"),
    ("tailorkv", {"channel_query": 1}, "one of 'current', 'predicted', got 1"),
    ("tailorkv", {"q_layers": 3}, "a list or one of 'auto', got 3"),
    ("tailorkv", {"top_k_ratio": "x"}, "a number or null \\(unset\\), got 'x'"),
])
def test_a_wrong_type_names_what_is_allowed(method, raw, allowed):
    """A value of the wrong type is told the words a setting takes, not only its type."""
    [(name, _)] = raw.items()
    with pytest.raises(SettingsError, match=f"{method}.{name} must be {allowed}"):
        parse_settings(METHODS[method].settings_cls, raw)


@pytest.mark.parametrize("raw", [
    {"selection": "sink_recent"}, {"kernels": "torch"}, {"value_store_gib": 2}])
def test_words_and_numbers_pass(raw):
    [(name, value)] = raw.items()
    assert getattr(parse_settings(ShadowKVSettings, raw), name) == value


@pytest.mark.parametrize("size", [float("inf"), 1e308, float("nan"), 0])
def test_value_store_size_must_be_finite_and_positive(size):
    """json.loads takes Infinity: it must be refused with the key named, not overflow later."""
    with pytest.raises(SettingsError, match="shadowkv.value_store_gib must be a finite number > 0"):
        parse_settings(ShadowKVSettings, {"value_store_gib": size})


def test_method_table():
    assert set(NAMES) == {"shadowkv", "minikv", "tailorkv", "specache"}
    assert method_class("ShadowKV") is METHODS["shadowkv"]
    with pytest.raises(SettingsError, match="quest is not a method of this plugin; available: "
                                            "shadowkv, minikv, specache, tailorkv"):
        method_class("quest")


@pytest.mark.parametrize("dtype, onednn, warned", [
    ("bfloat16", False, True), ("float16", False, True), ("bfloat16", True, False),
    ("float32", False, False)])
def test_a_16_bit_model_on_a_cpu_without_its_matmul_is_told_to_serve_fp32(
        dtype, onednn, warned, monkeypatch, caplog):
    import torch

    from vllm_shadowkv.backend import engine_check

    monkeypatch.setattr(engine_check, "_onednn_matmul", lambda _: onednn)
    engine_check.check_cpu_matmul(getattr(torch, dtype), "minikv")
    assert (f"minikv: this CPU has no {dtype} matrix multiply in oneDNN" in caplog.text) == warned
    assert ("--dtype float32" in caplog.text) == warned


def test_whether_onednn_multiplies_16_bit_is_asked_of_torch(monkeypatch):
    import torch

    from vllm_shadowkv.backend import engine_check

    assert isinstance(engine_check._onednn_matmul(torch.bfloat16), bool)

    def unknown():
        raise RuntimeError("no such operator mkldnn::_is_mkldnn_fp16_supported")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", unknown)
    assert engine_check._onednn_matmul(torch.float16)  # torch cannot say: no warning


def test_store_size_comes_from_kv_offloading_size_split_per_worker():
    from types import SimpleNamespace

    cache = SimpleNamespace(kv_offloading_size=8.0)
    assert store_capacity(ShadowKVSettings(), cache, 4) == (2 << 30, "--kv-offloading-size")
    override = ShadowKVSettings(value_store_gib=1.0)
    assert store_capacity(override, cache, 4) == (1 << 30, "shadowkv.value_store_gib")
    unset = SimpleNamespace(kv_offloading_size=None)
    assert store_capacity(ShadowKVSettings(), unset, 1)[0] == 16 << 30
    assert store_capacity(ShadowKVSettings(), unset, 1, host_per_worker=64 << 30)[0] == 16 << 30


def test_the_default_store_takes_at_most_half_the_host_memory_per_worker():
    from types import SimpleNamespace

    unset = SimpleNamespace(kv_offloading_size=None)
    size, source = store_capacity(ShadowKVSettings(), unset, 2, host_per_worker=10 << 30)
    assert size == 5 << 30 and "50% of the host memory available per worker" in source
    explicit = ShadowKVSettings(value_store_gib=12.0)  # explicit sizes are checked, not bounded
    assert store_capacity(explicit, unset, 2, host_per_worker=10 << 30)[0] == 12 << 30


def test_stamp_round_trips_through_json():
    import json

    stamp = Stamp("shadowkv", ShadowKVSettings(rank=40), 123)
    assert Stamp.from_json(json.loads(json.dumps(stamp.to_json()))) == stamp
