"""TailorKV's layer set: the dense-preference score, the profiling command on the tiny model, and
``q_layers: "auto"`` (the family table, else the command's result)."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from vllm_shadowkv.methods.base import SettingsError
from vllm_shadowkv.methods.tailorkv import layers, profile


def test_uniform_attention_loses_all_but_the_top_share():
    """A zero query attends uniformly to its causal prefix: a row at position p keeps k/(p+1)."""
    n, rows, share = 40, 8, 0.1
    query = torch.zeros(2, n, 16)
    key = torch.randn(1, n, 16)
    k = math.ceil(share * n)
    want = 1.0 - sum(k / (p + 1) for p in range(n - rows, n)) / rows
    got = profile.sparse_error(query, key, 1.0, rows, share)
    torch.testing.assert_close(got, torch.full((2,), want))


def test_peaked_attention_has_no_sparse_error_and_future_keys_are_masked():
    n, d = 32, 8
    key = torch.zeros(2, n, d)
    key[:, 5, 0] = 1.0  # a sink every row sees
    key[:, n - 1, 1] = 1.0  # the last token: only the last row sees it
    query = torch.zeros(4, n, d)
    query[:2, :, 0] = 100.0  # heads of KV head 0 attend to the sink
    query[2:, :, 1] = 100.0  # heads of KV head 1 attend to the last token where they can
    got = profile.sparse_error(query, key, 1.0, 4, 1 / n)
    assert got[:2].max() < 1e-6
    # Rows n-4..n-2 cannot see the last token: uniform over their prefix (top-1 mass 1/(p+1)).
    want = 1.0 - (sum(1.0 / (p + 1) for p in range(n - 4, n - 1)) + 1.0) / 4
    torch.testing.assert_close(got[2:], torch.full((2,), want), atol=1e-5, rtol=1e-5)


def test_command_on_the_tiny_model(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SHADOWKV_CACHE_DIR", str(tmp_path))
    result = profile.main(["--model", tiny_model, "--prompts", "2", "--length", "96"])
    written = json.loads(layers.profile_path(tiny_model).read_text())
    assert written == result
    assert len(result["scores"]) == 4 and all(0.0 <= p <= 1.0 for p in result["scores"])
    assert [len(h) for h in result["head_scores"]] == [16] * 4
    assert result["q_layers"] == [i for i, p in enumerate(result["scores"]) if p > 0.2]
    # The tiny model's family is not in the table: "auto" takes the command's result.
    config = SimpleNamespace(model_type="llama", vocab_size=320)
    assert layers.auto_q_layers(config, tiny_model) == tuple(result["q_layers"])


def test_auto_prefers_the_papers_set_for_known_families(tmp_path, monkeypatch):
    monkeypatch.setenv("SHADOWKV_CACHE_DIR", str(tmp_path))
    llama3 = SimpleNamespace(model_type="llama", vocab_size=128256)
    yi = SimpleNamespace(model_type="llama", vocab_size=64000)
    assert layers.auto_q_layers(llama3, tmp_path / "m") == (0,)
    assert layers.auto_q_layers(yi, tmp_path / "m") == (0, 1)
    unknown = SimpleNamespace(model_type="qwen2", vocab_size=151936)
    with pytest.raises(SettingsError, match="vllm_shadowkv.methods.tailorkv.profile --model"):
        layers.auto_q_layers(unknown, tmp_path / "m")
