"""The CPU value store: where the values of compressed chunks live during decode."""

from .value_store import PAGE_ROWS, CpuValueStore, ValueStoreFull, paged_bytes

__all__ = ["PAGE_ROWS", "CpuValueStore", "ValueStoreFull", "paged_bytes"]
