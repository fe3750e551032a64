"""Let the engine's impl give each attention layer its own KV-cache spec.

``AttentionBackend.customize_spec(spec)`` sees neither the layer nor the engine config (vLLM asks
for specs outside its config context), but a method's pages depend on both: its resolved
settings, and per-layer policy (a budget per layer, quantized vs offloaded layers). ``Attention.
get_kv_cache_spec`` knows the layer; when the layer's impl is the engine's, the impl builds the
spec from the settings it captured when the model was built.
"""

from __future__ import annotations

_EXPECTED = ["self", "vllm_config"]


def apply() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    from vllm_shadowkv.patches import check_signature

    original = Attention.get_kv_cache_spec
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "Attention.get_kv_cache_spec")

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        layer_spec = getattr(self.impl, "layer_kv_spec", None)
        return spec if spec is None or layer_spec is None else layer_spec(spec, self.layer_name)

    get_kv_cache_spec._shadowkv_original = original
    Attention.get_kv_cache_spec = get_kv_cache_spec
