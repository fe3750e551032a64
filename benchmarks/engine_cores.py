"""The CPU cores an engine benchmark gives vLLM: every core of this process, the same for each
backend, unless ``--threads`` asks for fewer.

vLLM's automatic binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) keeps one core per rank for its
scheduler process, so on a 2-core machine a worker ran on one core. An explicit list binds the
worker's OpenMP threads to all of them (``utils/ompmultiprocessing.py``); vLLM sets
``OMP_NUM_THREADS`` from the list's length.
"""

import os
import subprocess


def engine_cores_env(threads: int = 0) -> dict[str, str]:
    """Environment for an engine on the first ``threads`` cores of this process (0: all)."""
    cores = sorted(os.sched_getaffinity(0))
    if threads < 0 or threads > len(cores):
        raise SystemExit(f"--threads {threads}: this process may use {len(cores)} cores "
                         f"({cores}); give 1 to {len(cores)}, or 0 for all")
    cores = cores[:threads or None]
    return {"OMP_NUM_THREADS": str(len(cores)),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}


def engine_env(cores_env: dict[str, str]) -> dict[str, str]:
    """Environment of a benchmark's engine process: the engine core in that process (its
    scheduler readable), the KV memory from ``kv_cache_memory_bytes`` alone, the compiled CPU
    path, on ``cores_env``'s cores."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **cores_env}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    env.pop("TRITON_INTERPRET", None)
    return env


def machine() -> str:
    """"<cores>-core <CPU model>", as the results name the machine they ran on."""
    cpu = "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{os.cpu_count()}-core {cpu}"
