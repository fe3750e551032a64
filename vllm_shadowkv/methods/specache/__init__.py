"""SpeCache (issue 15): low-bit pages, the whole 16-bit KV in the CPU store, top-k prefetch.
Built so far: its settings and the guess row's proposer (guess.py, with patches/guess_row.py);
the attention math is in core/mixed_attention.py."""

from vllm_shadowkv.methods.specache.settings import SpeCacheSettings

__all__ = ["SpeCacheSettings"]
