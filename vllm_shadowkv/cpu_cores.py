"""The CPU cores a vLLM engine gets: every core of this process, unless asked for fewer.

vLLM's automatic binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) keeps one core per rank for its
scheduler process, so on a 2-core machine a worker ran on one core. An explicit list binds the
worker's OpenMP threads to all of them (``utils/ompmultiprocessing.py``); vLLM sets
``OMP_NUM_THREADS`` from the list's length.
"""

import os


def engine_cores_env(threads: int = 0) -> dict[str, str]:
    """Environment for an engine on the first ``threads`` cores of this process (0: all)."""
    cores = sorted(os.sched_getaffinity(0))
    if threads < 0 or threads > len(cores):
        raise SystemExit(f"--threads {threads}: this process may use {len(cores)} cores "
                         f"({cores}); give 1 to {len(cores)}, or 0 for all")
    cores = cores[:threads or None]
    return {"OMP_NUM_THREADS": str(len(cores)),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
