"""Test-only vLLM plugin: vLLM's CPU platform runs the Ray executor (tests/integration/test_ray.py).
Installed into the test environment by scripts/setup.sh; never part of vllm-shadowkv."""

from setuptools import setup

setup(
    name="ray-cpu-for-tests",
    version="0.1.0",
    py_modules=["ray_cpu_for_tests"],
    entry_points={"vllm.platform_plugins": ["ray_cpu_for_tests = ray_cpu_for_tests:register"]},
)
