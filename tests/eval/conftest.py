"""Shared fixtures of the accuracy-harness tests: the two tokenizers the generators are checked
with (byte-level, and the fixture model's word-level one)."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a vLLM engine (tens of seconds)")


@pytest.fixture(scope="session")
def byte_tokenizer():
    from vllm_shadowkv.models import build_byte_tokenizer

    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def word_tokenizer():
    from transformers import AutoTokenizer

    from vllm_shadowkv.eval.retrieval_model import FIXTURE

    return AutoTokenizer.from_pretrained(FIXTURE)


@pytest.fixture(scope="session", params=["byte", "word"])
def tokenizer(request, byte_tokenizer, word_tokenizer):
    return byte_tokenizer if request.param == "byte" else word_tokenizer
