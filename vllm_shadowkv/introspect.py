"""Ask a running engine what it really does, through vLLM's own worker-extension mechanism.

Start vLLM with ``--worker-extension-cls vllm_shadowkv.introspect.ShadowKVWorkerExtension``
(``worker_extension_cls=`` in ``LLM``); then ``llm.collective_rpc("shadowkv_attention_backends")``,
or ``POST /collective_rpc {"method": "shadowkv_attention_backends"}`` on a server started with
``VLLM_SERVER_DEV_MODE=1``, returns, per worker, the backend each attention layer runs;
``shadowkv_stats`` returns each request's mode (dense or sparse), hit rate and bytes fetched, and
the value store's occupancy.
"""

from __future__ import annotations

EXTENSION_CLASS = "vllm_shadowkv.introspect.ShadowKVWorkerExtension"


class ShadowKVWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def shadowkv_attention_backends(self) -> dict[str, str]:
        """Layer name -> name of the attention backend that layer was built with."""
        context = self.vllm_config.compilation_config.static_forward_context
        return {
            name: layer.attn_backend.get_name()
            for name, layer in context.items()
            if getattr(layer, "attn_backend", None) is not None
        }

    def shadowkv_stats(self) -> dict:
        """Per-request mode and selection traffic (live and recently finished requests), and
        the value store's occupancy, on this worker."""
        from dataclasses import asdict

        from vllm_shadowkv.backend.worker_state import STATE

        def row(stats):
            return asdict(stats) | {"hit_rate": stats.hit_rate,
                                    "fidelity": stats.fidelity_means()}

        store = STATE._store
        return {
            "requests": {req_id: row(s) for req_id, s in STATE.requests.items()},
            "finished": {req_id: row(s) for req_id, s in STATE.finished},
            "store": {
                "used_bytes": store.used_bytes if store else 0,
                "allocated_bytes": store.allocated_bytes if store else 0,
                "capacity_bytes": store.capacity_bytes if store else 0,
                "num_keys": store.num_keys if store else 0,
                "bytes_fetched": store.bytes_fetched if store else 0,
            },
            "compressed_requests": len(STATE.compressed),
        }
