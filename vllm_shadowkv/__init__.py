"""vllm-shadowkv: KV-cache compression and offloading methods as vLLM attention backends.

Installed as a vLLM general plugin (entry point ``vllm.general_plugins: shadowkv``); vLLM loads
it in every process. Select a method with ``--attention-backend shadowkv`` or
``LLM(..., attention_backend="shadowkv")``; ``vllm_shadowkv.methods`` lists them.
"""

__version__ = "0.1.0"

# vLLM versions this plugin is written and tested against (its patches check their targets too).
SUPPORTED_VLLM = (0, 32)
