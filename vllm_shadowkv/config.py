"""The ``shadowkv`` settings: one typed, validated config with the paper's defaults.

Set through vLLM's own ``--additional-config '{"shadowkv": {...}}'`` (``additional_config=`` in
``LLM``). Everything is checked at start-up, in the front-end process, and a bad value raises
``ShadowKVConfigError`` naming the key and what is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from vllm_shadowkv.core.params import SELECTIONS

CONFIG_KEY = "shadowkv"


class ShadowKVConfigError(ValueError):
    """A ``shadowkv`` setting, or the model or engine options, cannot be served."""


@dataclass(frozen=True)
class ShadowKVConfig:
    rank: int = 160
    """Rank r of the low-rank pre-RoPE key factorisation (A [tokens, r] x B [kv_heads, r, d])."""
    chunk_size: int = 8
    """Tokens per chunk; one landmark (mean post-RoPE key) per chunk. Must divide the block size."""
    sparse_budget: int = 2048
    """Tokens selected per KV head at each decode step (top sparse_budget/chunk_size chunks);
    outliers, the local window and generated tokens come on top of it."""
    outlier_chunks: int = 48
    """Chunks per KV head with the lowest within-chunk cosine similarity, always attended exactly."""
    local_window: int = 32
    """Last prompt tokens always attended exactly."""
    min_sparse_len: int = 4096
    """Context length (tokens) from which a request is decoded sparsely; dense below it."""
    value_store_gib: float = 16.0
    """Size of the CPU value store in GiB (pinned host memory on CUDA), per worker."""
    max_staging_requests: int = 1
    """Long prompts held exactly at once while they are prefilled, before compression: bounds
    the transient full-size KV of compressions in flight. More wait for their turn."""
    selection: str = "landmarks"
    """Which chunks a decode step attends: "landmarks" (ShadowKV: top-k landmark scores for the
    query) or "sink_recent" (a naive baseline for accuracy studies: the first chunk and the most
    recent chunks, whatever the query; set outlier_chunks 0 to give it the whole budget)."""
    measure_fidelity: bool = False
    """Diagnostic: keep an exact copy of each compressed prompt's K/V in host memory (outside
    every budget: not for production) and record, per layer and decode step, the relative error
    of the sparse attention output against dense attention and the recall of the truly
    top-attended chunks. Generation is unchanged."""

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> ShadowKVConfig:
        """Parse ``additional_config[CONFIG_KEY]`` (absent means all defaults)."""
        if additional_config is None:
            return cls()
        if not isinstance(additional_config, dict):
            raise ShadowKVConfigError(
                f"additional_config must be a JSON object, got {type(additional_config).__name__}"
            )
        raw = additional_config.get(CONFIG_KEY, {})
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ShadowKVConfigError(f"additional_config.{CONFIG_KEY} is not JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ShadowKVConfigError(
                f"additional_config.{CONFIG_KEY} must be a JSON object of settings, "
                f"got {type(raw).__name__}"
            )
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ShadowKVConfig:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ShadowKVConfigError(
                f"unknown {CONFIG_KEY} setting(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(known)}"
            )
        values = {}
        for key, value in raw.items():
            want = {"float": float, "bool": bool, "str": str}.get(known[key].type, int)
            values[key] = _typed(key, value, want)
        config = cls(**values)
        config._check_ranges()
        return config

    def _check_ranges(self) -> None:
        _at_least("rank", self.rank, 1)
        _at_least("chunk_size", self.chunk_size, 1)
        _at_least("sparse_budget", self.sparse_budget, self.chunk_size)
        _at_least("outlier_chunks", self.outlier_chunks, 0)
        _at_least("local_window", self.local_window, 0)
        _at_least("min_sparse_len", self.min_sparse_len, 1)
        _at_least("max_staging_requests", self.max_staging_requests, 1)
        if self.sparse_budget % self.chunk_size:
            raise ShadowKVConfigError(
                f"{CONFIG_KEY}.sparse_budget ({self.sparse_budget}) must be a multiple of "
                f"chunk_size ({self.chunk_size}): tokens are selected in whole chunks"
            )
        if self.selection not in SELECTIONS:
            raise ShadowKVConfigError(
                f"{CONFIG_KEY}.selection must be one of {', '.join(map(repr, SELECTIONS))}, "
                f"got {self.selection!r}"
            )
        if not self.value_store_gib > 0:
            raise ShadowKVConfigError(
                f"{CONFIG_KEY}.value_store_gib must be > 0 (GiB), got {self.value_store_gib}"
            )

    def check_engine(self, *, block_size: int, num_kv_heads: int, head_size: int) -> None:
        """Checks that need the engine's shapes (per tensor-parallel rank)."""
        if block_size % self.chunk_size:
            raise ShadowKVConfigError(
                f"{CONFIG_KEY}.chunk_size ({self.chunk_size}) must divide the KV block size "
                f"({block_size}); allowed chunk sizes here: {_divisors(block_size)}"
            )
        key_width = num_kv_heads * head_size
        if self.rank > key_width:
            raise ShadowKVConfigError(
                f"{CONFIG_KEY}.rank ({self.rank}) exceeds the key width of this model: "
                f"num_kv_heads ({num_kv_heads}) x head_dim ({head_size}) = {key_width}; "
                f"allowed: 1..{key_width}"
            )

    @property
    def selected_chunks(self) -> int:
        return self.sparse_budget // self.chunk_size


def _typed(key: str, value: Any, want: type) -> int | float | bool | str:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        ok = ok or isinstance(value, float)
    if want in (bool, str):
        ok = isinstance(value, want)
    if not ok:
        kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[want]
        raise ShadowKVConfigError(
            f"{CONFIG_KEY}.{key} must be {kind}, got {value!r} ({type(value).__name__})"
        )
    return want(value)


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ShadowKVConfigError(f"{CONFIG_KEY}.{key} must be >= {low}, got {value}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
