"""TailorKV: quantization-friendly layers KIVI-quantized on the GPU pages,
sparsity-friendly layers offloaded to the host store with critical-channel top-k at decode."""

from vllm_shadowkv.methods.tailorkv.method import TailorKVMethod
from vllm_shadowkv.methods.tailorkv.settings import TailorKVSettings

__all__ = ["TailorKVMethod", "TailorKVSettings"]
