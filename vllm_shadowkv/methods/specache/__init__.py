"""SpeCache: low-bit pages, the whole 16-bit prompt KV in the CPU store, top-k
fetch (method.py); the guess row's proposer for the speculative mode (guess.py, with
patches/guess_row.py); the attention math in core/mixed_attention.py."""

from vllm_shadowkv.methods.specache.method import SpeCacheMethod
from vllm_shadowkv.methods.specache.settings import SpeCacheSettings

__all__ = ["SpeCacheMethod", "SpeCacheSettings"]
