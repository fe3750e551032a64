"""MiniKV: settings, its pages (quantized groups and 16-bit rows per layer), and the hooks."""

from vllm_shadowkv.methods.minikv.method import MiniKVMethod
from vllm_shadowkv.methods.minikv.settings import MiniKVSettings

__all__ = ["MiniKVMethod", "MiniKVSettings"]
