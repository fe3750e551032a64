"""The CPU value store: where the values of compressed chunks live during decode."""

from .value_store import CpuValueStore, ValueStoreFull

__all__ = ["CpuValueStore", "ValueStoreFull"]
