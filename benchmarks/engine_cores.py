"""An engine benchmark's process environment (on the cores ``vllm_shadowkv.cpu_cores`` gives
it, the same for each backend) and the machine's name."""

import os
import subprocess


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
