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

METHODS: dict[str, type[KVMethod]] = {
    ShadowKVMethod.name: ShadowKVMethod,
    MiniKVMethod.name: MiniKVMethod,
    SpeCacheMethod.name: SpeCacheMethod,
}
# Names reserved for the methods of the project's papers that are not built yet: selecting one
# is refused at start-up with the list of the built ones (not vLLM's "unknown backend").
PLANNED = ("tailorkv",)
NAMES = (*METHODS, *PLANNED)


def method_class(name: str) -> type[KVMethod]:
    cls = METHODS.get(name.lower())
    if cls is None:
        state = "is not built yet" if name.lower() in PLANNED else "is not a method of this plugin"
        raise SettingsError(
            f"--attention-backend {name} {state}; available: {', '.join(METHODS)}")
    return cls
