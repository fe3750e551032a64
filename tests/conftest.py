import os

import pytest

from vllm_shadowkv.models import build_model

# The engines the tests start compile the decode kernels when a test first decodes, as before the
# start-up warm-up: it would add seconds to each of about a hundred engine starts. The tests of
# the warm-up itself (test_engine_defaults, tests/unit/test_warm_up.py) turn it on.
os.environ.setdefault("SHADOWKV_WARM_UP", "0")  # backend/warm_up.py: WARM_UP_ENV


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny local Llama (built once, cached on disk)."""
    return str(build_model("tiny"))
