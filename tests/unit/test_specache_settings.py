"""SpeCache's settings: the paper's defaults, parsing through the engine's typed parser, and
the range and engine checks naming the key and the allowed values."""

import pytest
import torch

from vllm_shadowkv.config import parse_settings
from vllm_shadowkv.core.kivi import KiviFormat
from vllm_shadowkv.methods.base import KVShapes, SettingsError
from vllm_shadowkv.methods.specache import SpeCacheSettings


def shapes(head=128):
    return KVShapes(8, head, torch.bfloat16, 16, num_layers=2, max_model_len=32768)


def test_paper_defaults():
    s = parse_settings(SpeCacheSettings, {})
    assert (s.bits, s.group_size, s.residual, s.top_k, s.prefetch, s.accept_guess) == (
        1, 64, 64, 64, "current", False)
    assert s.key == "specache"
    s.check_engine(shapes())
    assert s.kivi_format(128) == KiviFormat(1, 64, 128, 64, midpoint_one_bit=True)


def test_explicit_settings_parse():
    s = parse_settings(SpeCacheSettings, {"bits": 2, "group_size": 32, "residual": 96,
                                          "top_k": 0, "prefetch": "current"})
    assert (s.bits, s.group_size, s.residual, s.top_k, s.prefetch) == (2, 32, 96, 0, "current")
    assert s.kivi_format(64) == KiviFormat(2, 32, 64, 32)
    s = parse_settings(SpeCacheSettings, {"prefetch": "speculative", "accept_guess": True})
    assert (s.prefetch, s.accept_guess) == ("speculative", True)
    for verify in (True, "miss"):
        s = parse_settings(SpeCacheSettings, {"prefetch": "speculative", "verify_guess": verify})
        assert s.verify_guess == verify


@pytest.mark.parametrize("raw, message", [
    ({"bits": 4}, r"specache.bits must be one of 1, 2, got 4"),
    ({"group_size": 16}, r"specache.group_size must be one of 32, 64, got 16"),
    ({"residual": 32}, r"specache.residual must be >= 64, got 32"),
    ({"group_size": 32, "residual": 80},
     r"specache.residual \(80\) must be a multiple of group_size \(32\)"),
    ({"top_k": -1}, r"specache.top_k must be >= 0, got -1"),
    ({"prefetch": "next"}, r"specache.prefetch must be one of 'current', 'speculative', "
                           r"got 'next'"),
    ({"prefetch": "current", "accept_guess": True},
     r"specache.accept_guess needs prefetch 'speculative'"),
    ({"accept_guess": 1}, r"specache.accept_guess must be true or false"),
    ({"verify_guess": True}, r"specache.verify_guess needs prefetch 'speculative'"),
    ({"verify_guess": "always"}, r"specache.verify_guess must be true or false or one of "
                                 r"'miss', got 'always'"),
    ({"verify_guess": 1}, r"specache.verify_guess must be true or false or one of 'miss', got 1"),
    ({"guess_lookup": -1}, r"specache.guess_lookup must be >= 0, got -1"),
    ({"window": 3}, r"unknown specache setting\(s\) 'window'; allowed: .*top_k, prefetch"),
])
def test_invalid_settings_name_the_key_and_the_allowed_values(raw, message):
    with pytest.raises(SettingsError, match=message):
        parse_settings(SpeCacheSettings, raw)


def test_engine_checks_against_the_head_size():
    """Codes pack along the channels; a head narrower than the group (or not a multiple of it)
    groups values by the largest common divisor."""
    with pytest.raises(SettingsError, match=r"specache.bits 1 packs 32 codes per int32 along "
                                            r"the channels, which must divide the head size "
                                            r"\(48\); allowed here: 2"):
        SpeCacheSettings().check_engine(shapes(48))
    SpeCacheSettings(bits=2).check_engine(shapes(48))
    for head, value_group in ((32, 32), (96, 32), (128, 64)):
        SpeCacheSettings().check_engine(shapes(head))
        assert SpeCacheSettings().kivi_format(head).value_group == value_group


def test_speculative_prefetch_needs_the_guess_proposer():
    """The speculative_config the front end fills in (patches/guess_config.py), and the
    start-up check that refuses another, naming the one to pass."""
    from types import SimpleNamespace

    from vllm_shadowkv.backend.engine_check import check_speculative
    from vllm_shadowkv.methods.specache.guess import ACCEPTING_PROPOSER, PROPOSER

    speculative = parse_settings(SpeCacheSettings, {"prefetch": "speculative"})
    wanted = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 1}
    assert speculative.speculative_config() == wanted
    accepting = parse_settings(SpeCacheSettings, {"prefetch": "speculative",
                                                  "accept_guess": True})
    assert accepting.speculative_config()["model"] == ACCEPTING_PROPOSER
    current = parse_settings(SpeCacheSettings, {"prefetch": "current"})
    assert current.speculative_config() is None
    plain_kivi = parse_settings(SpeCacheSettings, {"top_k": 0, "prefetch": "speculative"})
    assert plain_kivi.speculative_config() is None

    def config(method="custom_class", model=PROPOSER, tokens=1):
        return SimpleNamespace(speculative_config=SimpleNamespace(
            method=method, model=model, num_speculative_tokens=tokens))

    check_speculative(config(), speculative, "specache")
    check_speculative(SimpleNamespace(speculative_config=None), current, "specache")
    for bad in (SimpleNamespace(speculative_config=None), config(tokens=2),
                config(method="ngram", model=None)):
        with pytest.raises(SettingsError, match=r"specache.prefetch 'speculative' runs its guess "
                                                r"row through vLLM's speculative decoding: pass "
                                                r"--speculative-config '\{\"method\": "
                                                r"\"custom_class\", \"model\": \"vllm_shadowkv"):
            check_speculative(bad, speculative, "specache")
    with pytest.raises(SettingsError, match=r"proposes SpeCache's guess rows, which only "):
        check_speculative(config(), current, "specache")
