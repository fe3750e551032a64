"""vllm-shadowkv: KV-cache compression and offloading attention backends for vLLM."""

from setuptools import setup

# `triton_kernels/` and `patches/` are top-level folders in the repository but install under
# the package: a top-level module named `triton_kernels` would be taken by vLLM for OpenAI's MoE
# kernel library (`vllm.utils.import_utils.has_triton_kernels`).
PACKAGES = {
    "vllm_shadowkv": "vllm_shadowkv",
    "vllm_shadowkv.backend": "vllm_shadowkv/backend",
    "vllm_shadowkv.core": "vllm_shadowkv/core",
    "vllm_shadowkv.eval": "vllm_shadowkv/eval",
    "vllm_shadowkv.methods": "vllm_shadowkv/methods",
    "vllm_shadowkv.methods.minikv": "vllm_shadowkv/methods/minikv",
    "vllm_shadowkv.methods.shadowkv": "vllm_shadowkv/methods/shadowkv",
    "vllm_shadowkv.store": "vllm_shadowkv/store",
    "vllm_shadowkv.triton_kernels": "triton_kernels",
    "vllm_shadowkv.patches": "patches",
}

setup(
    name="vllm-shadowkv",
    version="0.1.0",
    description="ShadowKV sparse attention with a CPU value store, as a vLLM attention backend",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    package_data={"vllm_shadowkv.eval": ["fixtures/**/*"],
                  "vllm_shadowkv.core": ["csrc/*.c", "csrc/*.h"]},  # built on first use
    install_requires=["torch", "tqdm", "filelock", "psutil"],
    extras_require={
        # gguf and accelerate: transformers' GGUF loader, to convert the smollm2 model; ray: the
        # Ray executor tests (tests/integration/test_ray.py); pytest-xdist: the suite runs on the
        # machine's cores (pytest.ini).
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "requests", "openai", "gguf",
                 "accelerate", "ray==2.60.*"],
        "bench": ["matplotlib", "gguf", "accelerate"],
    },
    entry_points={
        "vllm.general_plugins": ["shadowkv = vllm_shadowkv.plugin:register"],
        "console_scripts": ["shadowkv-build-models = vllm_shadowkv.models:main"],
    },
)
