"""Compile the engine's decode kernels when the worker warms up, before it serves.

vLLM calls ``Worker.compile_or_warm_up_model`` (the CPU worker overrides it) once per worker,
after the KV cache is bound and before the first request; with ``enforce_eager`` its own warm-up
does nothing. Wrapping both runs ``backend/warm_up.py`` after vLLM's, when a layer of the model
has the engine's impl (nothing otherwise).
"""

from __future__ import annotations

import functools

_EXPECTED = ["self"]


def apply() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    for cls in (Worker, CPUWorker):
        _wrap(cls)


def _wrap(cls) -> None:
    from vllm_shadowkv.patches import check_signature, own_attribute

    original = own_attribute(cls, "compile_or_warm_up_model")
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, f"{cls.__name__}.compile_or_warm_up_model")

    @functools.wraps(original)
    def compile_or_warm_up_model(self):
        result = original(self)
        from vllm_shadowkv.backend.warm_up import warm_up
        from vllm_shadowkv.plugin import logger

        seconds = warm_up(self.model_runner)
        if seconds is not None:
            logger.info("shadowkv: decode kernels compiled in %.1f s", seconds)
        return result

    compile_or_warm_up_model._shadowkv_original = original
    cls.compile_or_warm_up_model = compile_or_warm_up_model

