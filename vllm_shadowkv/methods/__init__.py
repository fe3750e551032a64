"""The method table: every method the engine hosts, by its ``--attention-backend`` name.

A new method is a package here with a ``KVMethod`` subclass and its settings dataclass
(``base.py`` says what it provides and what it gets from the engine), and one line below. The
engine tests iterate this table.
"""

from __future__ import annotations

from vllm_shadowkv.methods.base import KVMethod, SettingsError
from vllm_shadowkv.methods.minikv import MiniKVMethod
from vllm_shadowkv.methods.shadowkv import ShadowKVMethod
from vllm_shadowkv.methods.specache import SpeCacheMethod
from vllm_shadowkv.methods.tailorkv import TailorKVMethod

METHODS: dict[str, type[KVMethod]] = {
    ShadowKVMethod.name: ShadowKVMethod,
    MiniKVMethod.name: MiniKVMethod,
    SpeCacheMethod.name: SpeCacheMethod,
    TailorKVMethod.name: TailorKVMethod,
}
NAMES = tuple(METHODS)


def method_class(name: str) -> type[KVMethod]:
    cls = METHODS.get(name.lower())
    if cls is None:
        raise SettingsError(f"--attention-backend {name} is not a method of this plugin; "
                            f"available: {', '.join(METHODS)}")
    return cls
