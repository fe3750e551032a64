import pytest

from vllm_shadowkv.models import build_model


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny local Llama (built once, cached on disk)."""
    return str(build_model("tiny"))
