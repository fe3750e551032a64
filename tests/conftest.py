import os
from collections import Counter

import pytest

# pytest.ini runs the suite on pytest-xdist workers, one per core (as memory allows). Each
# worker's engines bind their OpenMP threads to that worker's core: vLLM's automatic binding
# would put every engine on the same one. The workers' own torch work runs on one thread.
CORES = sorted(os.sched_getaffinity(0))
GIB_PER_WORKER = 8  # an engine test's peak (test_capacity: a 4 GiB KV cache) with room to spare
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
if _WORKER is not None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(CORES[int(_WORKER[2:]) % len(CORES)]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


from vllm_shadowkv.models import build_model

# The engines the tests start compile the decode kernels when a test first decodes, as before the
# start-up warm-up: it would add seconds to each of about a hundred engine starts. The tests of
# the warm-up itself (test_engine_defaults, tests/unit/test_warm_up.py) turn it on.
os.environ.setdefault("SHADOWKV_WARM_UP", "0")  # backend/warm_up.py: WARM_UP_ENV


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny local Llama (built once, cached on disk)."""
    return str(build_model("tiny"))


def pytest_collection_modifyitems(items) -> None:
    """Files with more engine tests (slow) first, each file's own order kept: under
    ``--dist loadfile`` a file is one worker's unit of work (pytest.ini), and a long file handed
    out last would run alone at the end while the other workers sit idle."""
    engine_tests = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -engine_tests[item.path])  # stable


def pytest_xdist_auto_num_workers(config) -> int:
    memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return max(1, min(len(CORES), int(memory_gib // GIB_PER_WORKER)))
