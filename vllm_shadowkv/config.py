"""Which method runs and with which settings: parsed and checked once, in the front end.

Each method's settings come through vLLM's own ``--additional-config`` under the method's name
(``{"shadowkv": {...}}``; a JSON string there is parsed too). The front end resolves them
against the model (``EngineSettings.resolved``) and the host-store size against vLLM's
``--kv-offloading-size``, then writes the result under ``STAMP_KEY``: the engine processes read
that and never re-derive anything.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, fields
from typing import Any

from vllm_shadowkv.methods import NAMES, method_class
from vllm_shadowkv.methods.base import EngineSettings, KVMethod, KVShapes, SettingsError

STAMP_KEY = "vllm_shadowkv"  # additional_config key the front end writes; users do not
DEFAULT_STORE_GIB = 16.0
# The default store never takes more than this share of the host memory available to each
# worker on the node (the rest: weights, vLLM's CPU KV cache, co-tenants); an explicit size must
# fit in HOST_LIMIT of it, or a full store would get the server killed for memory.
DEFAULT_HOST_SHARE, HOST_LIMIT = 0.5, 0.9
GiB, MiB = 1 << 30, 1 << 20


def settings_block(additional_config: Any, method: str) -> dict[str, Any]:
    """The raw settings of ``method``; a block for any other method of this plugin is an error
    (it would be silently ignored)."""
    if additional_config is None:
        return {}
    if not isinstance(additional_config, dict):
        raise SettingsError(
            f"additional_config must be a JSON object, got {type(additional_config).__name__}")
    cased = [k for k in additional_config
             if isinstance(k, str) and k.lower() in NAMES and k not in NAMES]
    if cased:
        raise SettingsError(
            f"additional_config key(s) {', '.join(map(repr, cased))} would be ignored: the "
            f"methods' keys are lower case ({', '.join(NAMES)})")
    others = [k for k in additional_config if k in NAMES and k != method]
    if others:
        raise SettingsError(
            f"additional_config has settings for {', '.join(map(repr, others))}, but the "
            f"attention backend is {method!r}; put them under {method!r} or select that method")
    raw = additional_config.get(method, {})
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SettingsError(f"additional_config.{method} is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise SettingsError(f"additional_config.{method} must be a JSON object of settings, "
                            f"got {type(raw).__name__}")
    return raw


def parse_settings(settings_cls: type[EngineSettings], raw: dict[str, Any]) -> EngineSettings:
    """Typed settings: unknown keys and wrong types raise ``SettingsError`` naming the key and
    what is allowed; then the range checks."""
    key = settings_cls.method
    hints = typing.get_type_hints(settings_cls)
    known = [f.name for f in fields(settings_cls)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SettingsError(f"unknown {key} setting(s) {', '.join(map(repr, unknown))}; "
                            f"allowed: {', '.join(known)}")
    settings = settings_cls(**{name: _typed(key, name, value, hints[name])
                               for name, value in raw.items()})
    settings.check()
    return settings


def _typed(key: str, name: str, value: Any, hint) -> Any:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    allowed = set(typing.get_args(hint)) if union else {hint}
    # Settings that take words declare them (typing.Literal): a wrong type names them too.
    words = [w for t in allowed if typing.get_origin(t) is typing.Literal
             for w in typing.get_args(t)]
    takes_list = any(typing.get_origin(t) is tuple for t in allowed)
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, (list, tuple)) and takes_list:
        return tuple(value)  # a list setting (TailorKV's q_layers): check() sees the items
    if isinstance(value, str) and value in words:
        return value
    wants = [t for t in (bool, str, float, int) if t in allowed]
    for want in wants:  # the first type the value is (a setting may take true or a word)
        if _is(value, want):
            return want(value)
    kinds = [_KINDS[want] for want in wants]
    if words:
        kinds.append(f"one of {', '.join(map(repr, words))}")
    if takes_list:
        kinds.insert(0, "a list")
    if type(None) in allowed:
        kinds.append("null (unset)")
    raise SettingsError(f"{key}.{name} must be {' or '.join(kinds)}, got {value!r} "
                        f"({type(value).__name__})")


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _is(value: Any, want: type) -> bool:
    if want in (bool, str):
        return isinstance(value, want)
    return (isinstance(value, int) and not isinstance(value, bool)
            or want is float and isinstance(value, float))


@dataclass(frozen=True)
class Stamp:
    """What the front end decided, for every engine process: the method, its resolved
    settings and the host-store size per worker. Travels as JSON in ``additional_config``
    (vLLM hashes that dict as JSON)."""

    method: str
    settings: EngineSettings
    store_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "settings": self.settings.as_dict(),
                "store_bytes": self.store_bytes}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Stamp:
        settings_cls = method_class(raw["method"]).settings_cls
        return cls(raw["method"], settings_cls(**raw["settings"]), int(raw["store_bytes"]))

    def build(self, shapes: KVShapes) -> KVMethod:
        return method_class(self.method)(self.settings, shapes)


def stamp_of(vllm_config) -> Stamp | None:
    """The front end's decision, or None when no method of this plugin was selected."""
    additional = vllm_config.additional_config
    raw = additional.get(STAMP_KEY) if isinstance(additional, dict) else None
    return Stamp.from_json(raw) if raw else None


def store_capacity(settings: EngineSettings, cache_config, world_size: int,
                   host_per_worker: int | None = None) -> tuple[int, str]:
    """The host store per worker and where its size came from (for messages).
    ``host_per_worker``: the host memory available to each worker of this node (None: unknown,
    as under Ray), which bounds the default."""
    if settings.value_store_gib is not None:
        return int(settings.value_store_gib * GiB), f"{settings.key}.value_store_gib"
    if cache_config.kv_offloading_size is not None:
        return (int(cache_config.kv_offloading_size * GiB) // world_size,
                "--kv-offloading-size")
    default = int(DEFAULT_STORE_GIB * GiB)
    share = None if host_per_worker is None else int(DEFAULT_HOST_SHARE * host_per_worker)
    if share is not None and share < default:
        return share, (f"the default: {DEFAULT_HOST_SHARE:.0%} of the host memory available per "
                       f"worker, under {DEFAULT_STORE_GIB:g} GiB here")
    return default, f"the default {DEFAULT_STORE_GIB:g} GiB"


def human_bytes(nbytes: int) -> str:
    """GiB, or MiB where GiB would round to nothing."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 10 else f"{nbytes / MiB:.1f} MiB"
