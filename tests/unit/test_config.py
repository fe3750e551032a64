import pytest

from vllm_shadowkv.config import ShadowKVConfig, ShadowKVConfigError


def test_paper_defaults():
    c = ShadowKVConfig.from_additional_config({})
    assert (c.rank, c.chunk_size, c.sparse_budget, c.outlier_chunks, c.local_window) == (
        160, 8, 2048, 48, 32)
    assert c.selected_chunks == 256 and c.min_sparse_len == 4096


def test_overrides_and_other_plugins_keys_ignored():
    c = ShadowKVConfig.from_additional_config(
        {"shadowkv": {"rank": 96, "value_store_gib": 2}, "other_plugin": {"x": 1}})
    assert c.rank == 96 and c.value_store_gib == 2.0 and isinstance(c.value_store_gib, float)


def test_json_string_value():
    assert ShadowKVConfig.from_additional_config({"shadowkv": '{"chunk_size": 16}'}).chunk_size == 16


@pytest.mark.parametrize("engine, message", [
    (dict(block_size=16, num_kv_heads=8, head_size=128), None),
    (dict(block_size=12, num_kv_heads=8, head_size=128), "must divide the KV block size (12)"),
    (dict(block_size=16, num_kv_heads=1, head_size=128), "rank (160) exceeds the key width"),
])
def test_engine_checks(engine, message):
    config = ShadowKVConfig()
    if message is None:
        config.check_engine(**engine)
    else:
        with pytest.raises(ShadowKVConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            config.check_engine(**engine)


def test_selection_names_the_allowed_modes():
    assert ShadowKVConfig.from_dict({"selection": "sink_recent"}).selection == "sink_recent"
    with pytest.raises(ShadowKVConfigError, match="selection must be one of 'landmarks', 'sink_recent'"):
        ShadowKVConfig.from_dict({"selection": "recent"})
    with pytest.raises(ShadowKVConfigError, match="selection must be a string"):
        ShadowKVConfig.from_dict({"selection": 1})
