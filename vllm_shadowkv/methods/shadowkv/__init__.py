"""ShadowKV: settings, its region of the pages, and the method's hooks."""

from vllm_shadowkv.methods.shadowkv.method import ShadowKVMethod
from vllm_shadowkv.methods.shadowkv.settings import ShadowKVSettings

__all__ = ["ShadowKVMethod", "ShadowKVSettings"]
