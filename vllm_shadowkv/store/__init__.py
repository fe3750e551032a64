"""The CPU value store: the host rows a method fetches back during decode (ShadowKV's chunk
values, SpeCache's and TailorKV's exact keys and values)."""

from .value_store import PAGE_ROWS, CpuValueStore, ValueStoreFull, paged_bytes

__all__ = ["PAGE_ROWS", "CpuValueStore", "ValueStoreFull", "paged_bytes"]
