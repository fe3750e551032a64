import dataclasses

import pytest
import torch

from vllm_shadowkv.methods.base import KVShapes, SettingsError
from vllm_shadowkv.methods.tailorkv.settings import TailorKVSettings

SHAPES = KVShapes(num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16,
                  num_layers=32, max_model_len=131072)


def test_defaults_are_the_papers_long_context_settings():
    s = TailorKVSettings()
    s.check()
    s.check_engine(SHAPES)
    assert (s.q_layers, s.bits, s.group_size, s.residual) == ("auto", 1, 64, 128)
    assert (s.sink, s.recent, s.top_k, s.critical_channels) == (8, 120, 896, 12)
    assert s.top_k_ratio is None and s.channel_query == "current"


def test_q_layers_from_json_become_a_tuple():
    s = TailorKVSettings(q_layers=[0, 1])
    s.check()
    assert s.q_layers == (0, 1)
    hash(s)


@pytest.mark.parametrize("changes,message", [
    ({"q_layers": "all"}, "tailorkv.q_layers must be a list of layer indices or 'auto'"),
    ({"q_layers": [0, -1]}, "tailorkv.q_layers must be a list of layer indices"),
    ({"q_layers": [0, "1"]}, "tailorkv.q_layers must be a list of layer indices"),
    ({"q_layers": [True]}, "tailorkv.q_layers must be a list of layer indices"),
    ({"q_layers": [0, 1, 1]}, "lists layer(s) [1] more than once"),
    ({"bits": 4}, "tailorkv.bits must be one of 1, 2, got 4"),
    ({"group_size": 0}, "tailorkv.group_size must be one of 32, 64, got 0"),
    ({"residual": 96}, "tailorkv.residual (96) must be a multiple of group_size (64)"),
    ({"residual": 32}, "tailorkv.residual must be >= 64"),
    ({"sink": -1}, "tailorkv.sink must be >= 0"),
    ({"recent": -1}, "tailorkv.recent must be >= 0"),
    ({"top_k": 0}, "tailorkv.top_k must be >= 1"),
    ({"top_k_ratio": 0.0}, "tailorkv.top_k_ratio must be in (0, 1]"),
    ({"top_k_ratio": 1.5}, "tailorkv.top_k_ratio must be in (0, 1]"),
    ({"critical_channels": 0}, "tailorkv.critical_channels must be >= 1"),
    ({"group_size": 48, "residual": 96}, "tailorkv.group_size must be one of 32, 64, got 48"),
    ({"channel_query": "next"}, "tailorkv.channel_query must be one of 'current', 'predicted'"),
    ({"kernels": "cuda"}, "tailorkv.kernels must be one of"),
])
def test_check_names_the_key_and_the_allowed_values(changes, message):
    with pytest.raises(SettingsError) as err:
        TailorKVSettings(**changes).check()
    assert message in str(err.value)


@pytest.mark.parametrize("changes,shapes,message", [
    ({"critical_channels": 129}, {}, "critical_channels (129) exceeds the head size (128)"),
    ({"bits": 1, "group_size": 32, "residual": 32}, {"head_size": 80},
     "bits 1 packs 32 codes per int32"),
    ({"q_layers": [0, 31, 32, 40]}, {}, "q_layers [32, 40] are not layers of this model"),
])
def test_check_engine(changes, shapes, message):
    s = TailorKVSettings(**changes)
    s.check()
    with pytest.raises(SettingsError) as err:
        s.check_engine(dataclasses.replace(SHAPES, **shapes))
    assert message in str(err.value)


def test_top_k_ratio_replaces_top_k():
    assert TailorKVSettings().top_k_for(100_000) == 896
    s = TailorKVSettings(top_k_ratio=0.05)
    assert (s.top_k_for(32768), s.top_k_for(10), s.top_k_for(1)) == (1639, 1, 1)
