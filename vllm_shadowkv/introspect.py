"""Ask a running engine what it really does, through vLLM's own worker-extension mechanism.

Start vLLM with ``--worker-extension-cls vllm_shadowkv.introspect.ShadowKVWorkerExtension``
(``worker_extension_cls=`` in ``LLM``); then ``llm.collective_rpc("shadowkv_attention_backends")``,
or ``POST /collective_rpc {"method": "shadowkv_attention_backends"}`` on a server started with
``VLLM_SERVER_DEV_MODE=1``, returns, per worker, the backend each attention layer runs.
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
