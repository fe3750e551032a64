"""vllm-shadowkv: ShadowKV KV-cache compression and offloading as a vLLM attention backend.

Installed as a vLLM general plugin (entry point ``vllm.general_plugins: shadowkv``); vLLM loads
it in every process. Select it with ``--attention-backend shadowkv`` or
``LLM(..., attention_backend="shadowkv")``.
"""

__version__ = "0.1.0"

BACKEND_NAME = "SHADOWKV"
# vLLM versions this plugin is written and tested against (its patches check their targets too).
SUPPORTED_VLLM = (0, 32)
