"""vLLM's own KV capacity figure grows by the compression ratio (the project's design contract:
at least 6x the default backend's for long prompts at Llama-3.1-8B shapes).

Two engines on the llama8b-shape model (Llama-3.1-8B attention shapes) at max_model_len 128K
(and each other length a method claims), same KV memory, each in a fresh process with the engine
core in-process: the maximum concurrency vLLM computes (and logs) for requests of that length
must meet each method's capacity claim (ShadowKV: at least 6x the default backend's with the
paper's settings; MiniKV: 7x at 32K and 128K). No prompt is run; capacity is fixed when the
engine sizes its KV cache.
"""

import json
import subprocess
import sys

import pytest
from engine_utils import engine_env, failure_excerpt

from vllm_shadowkv.methods import METHODS
from vllm_shadowkv.models import build_model

pytestmark = pytest.mark.slow

MAX_LEN = 131072
KV_GIB = 4  # 4 default requests of 128K; a method also needs one 128K prompt's exact staging

ENGINE = """
import json, os, sys
from vllm import LLM
backend, model, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
settings = json.loads(sys.argv[4])
kwargs = {} if backend == "default" else {
    "attention_backend": backend, "additional_config": {backend: settings}}
llm = LLM(model=model, max_model_len=max_len, enable_prefix_caching=False, enforce_eager=True,
          **kwargs)
cache = llm.llm_engine.vllm_config.cache_config
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
(group,) = scheduler.kv_cache_config.kv_cache_groups
print("CAPACITY " + json.dumps({
    "num_blocks": cache.num_gpu_blocks,
    "pool_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
    "block_size": cache.block_size, "page_bytes": group.kv_cache_spec.page_size_bytes,
    # a block's bytes over every layer (a method's layers may have pages of different sizes)
    "block_bytes": sum(t.block_stride * len(t.layers)
                       for t in scheduler.kv_cache_config.kv_cache_tensors),
    "num_layers": len(group.layer_names), "spec": type(group.kv_cache_spec).__name__,
    "max_concurrency": cache.kv_cache_max_concurrency, "size_tokens": cache.kv_cache_size_tokens,
}), flush=True)
os._exit(0)
"""


def engine_capacity(backend: str, model: str, cwd, settings: dict | None = None,
                    max_len: int = MAX_LEN) -> dict:
    env = engine_env() | {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
                          "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # scheduler in this process
                          "OMP_NUM_THREADS": "1"}  # start-up only; spares a shared machine
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, backend, model, str(max_len), json.dumps(settings or {})],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # cwd: not the repository root, whose triton_kernels/ folder `-c` would put on sys.path
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CAPACITY ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{backend} engine failed ({proc.returncode}):\n"
                             f"{failure_excerpt(proc.stderr)}")
    return json.loads(lines[-1].removeprefix("CAPACITY "))


@pytest.fixture(scope="module")
def default_capacity(tmp_path_factory):
    """The default backend's capacity at each length, measured once."""
    measured = {}

    def at(max_len: int) -> dict:
        if max_len not in measured:
            measured[max_len] = engine_capacity("default", str(build_model("llama8b-shape")),
                                                tmp_path_factory.mktemp("default"),
                                                max_len=max_len)
        return measured[max_len]

    return at


@pytest.mark.parametrize("method, max_len", [(name, length) for name, cls in METHODS.items()
                                             for length in cls.capacity_lengths])
def test_max_concurrency_meets_the_methods_claim(method, max_len, default_capacity, tmp_path):
    settings, target = METHODS[method].capacity_claim
    default = default_capacity(max_len)
    compressed = engine_capacity(method, str(build_model("llama8b-shape")), tmp_path, settings,
                                 max_len=max_len)

    assert default["spec"] == "FullAttentionSpec" and compressed["spec"] == "CompressedKVSpec"
    for cap in (default, compressed):
        assert cap["num_blocks"] == cap["pool_blocks"]  # the scheduler's pool is what was sized
    assert default["block_bytes"] == default["page_bytes"] * default["num_layers"]
    # Same KV memory: both pools span the same bytes (within one block of rounding).
    pool = {name: c["num_blocks"] * c["block_bytes"]
            for name, c in (("default", default), (method, compressed))}
    one_block = max(c["block_bytes"] for c in (default, compressed))
    assert abs(pool["default"] - pool[method]) <= one_block, pool
    assert max(pool.values()) <= KV_GIB << 30

    # The default backend holds KV_GIB GiB / (2 layers x max_len tokens x 4 KiB) requests.
    assert default["max_concurrency"] == pytest.approx(KV_GIB * 2**30 / (2 * max_len * 4096))
    ratio = compressed["max_concurrency"] / default["max_concurrency"]
    print(f"\n{method} at {max_len}: max concurrency {compressed['max_concurrency']:.2f} vs "
          f"default {default['max_concurrency']:.2f} ({ratio:.2f}x)")
    assert ratio >= target, (
        f"{method} max concurrency for {max_len}-token requests is "
        f"{compressed['max_concurrency']:.2f}, only {ratio:.2f}x the default's "
        f"{default['max_concurrency']:.2f} (target >= {target}x)")
    # vLLM's logged token capacity follows the same ratio.
    assert compressed["size_tokens"] >= target * default["size_tokens"]
