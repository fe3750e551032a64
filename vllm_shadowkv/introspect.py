"""Ask a running engine what it really does, through vLLM's own worker-extension mechanism.

Start vLLM with ``--worker-extension-cls vllm_shadowkv.introspect.EngineWorkerExtension``
(``worker_extension_cls=`` in ``LLM``); then ``llm.collective_rpc("kv_compression_backends")``,
or ``POST /collective_rpc {"method": "kv_compression_backends"}`` on a server started with
``VLLM_SERVER_DEV_MODE=1``, returns, per worker, the backend each attention layer runs (the
method's name for the plugin's layers, vLLM's backend name for the others);
``kv_compression_stats`` returns the method, each request's mode (dense or sparse), hit rate and
bytes fetched, and the host store's occupancy.
"""

from __future__ import annotations

EXTENSION_CLASS = "vllm_shadowkv.introspect.EngineWorkerExtension"


class EngineWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def kv_compression_backends(self) -> dict[str, str]:
        """Layer name -> the method (upper case) or vLLM backend that layer was built with."""
        context = self.vllm_config.compilation_config.static_forward_context
        return {
            name: getattr(layer.impl, "method_name", layer.attn_backend.get_name()).upper()
            for name, layer in context.items()
            if getattr(layer, "attn_backend", None) is not None
        }

    def kv_compression_runner(self) -> dict:
        """Which model runner this worker built (the plugin's methods need V1's)."""
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = self.model_runner
        return {"class": type(runner).__name__, "v1": isinstance(runner, GPUModelRunner),
                "use_v2_model_runner": self.vllm_config.use_v2_model_runner}

    def kv_compression_stats(self) -> dict:
        """Per-request mode and selection traffic (live, preempted and recently finished
        requests), the host store's occupancy, and the counters /metrics reads, on this
        worker."""
        from dataclasses import asdict

        from vllm_shadowkv.backend.worker_state import STATE

        def row(stats):
            return asdict(stats) | {"hit_rate": stats.hit_rate,
                                    "speculation_hit_rate": stats.speculation_hit_rate,
                                    "fidelity": stats.fidelity_means()}

        stores = STATE._stores.values()
        return {
            "method": STATE.engine.stamp.method if STATE.engine else None,
            "settings": STATE.engine.stamp.settings.as_dict() if STATE.engine else None,
            "requests": {req_id: row(s) for req_id, s in STATE.requests.items()},
            "suspended": {req_id: row(s) for req_id, s in STATE.suspended.items()},
            "finished": {req_id: row(s) for req_id, s in STATE.finished},
            "counters": STATE.snapshot() if STATE.engine else None,
            "store": {
                "used_bytes": sum(s.used_bytes for s in stores),
                "allocated_bytes": sum(s.allocated_bytes for s in stores),
                "capacity_bytes": STATE.engine.stamp.store_bytes if STATE.engine else 0,
                "num_keys": sum(s.num_keys for s in stores),
                "bytes_fetched": sum(s.bytes_fetched for s in stores),
            },
            "compressed_requests": len(STATE.compressed),
        }
