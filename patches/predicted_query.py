"""TailorKV's next-layer query (digest §5.2 Stage 1, §11.2): q̂(l) = RoPE_l(W_q(l) · x(l-1)).

An attention backend sees only its own layer's q, k and v, so the prediction is made in the
model. Wraps ``GPUModelRunner.load_model`` (and the CPU runner's, which overrides it): when the
stamp runs ``tailorkv`` with ``channel_query "predicted"``, ``enable(model)`` puts a forward
pre-hook on each ``LlamaAttention`` (Llama, Mistral and the other models built on it) whose
successor layer is one too. The hook projects the hidden state the layer's attention receives
(after its input RMSNorm) with the successor's query rows of ``qkv_proj`` (this rank's heads, with
their bias) and rotates it with the successor's RoPE at the same positions. A hook, not a wrap of
``LlamaAttention.forward``: subclasses (Mistral's) override forward. Every other model and
setting is left alone: no hook, no cost.

Layer l's prediction goes to a static double buffer (slot l & 1) through a custom op that hands
back a copy of the positions, which the hooked layer's own RoPE then reads. Under torch.compile a
plain write to a global buffer is moved after the graph's opaque ops (the attention ops included)
and a CUDA graph replays only kernels, so: the data dependency keeps the write ahead of the hooked
layer's attention, and ``predicted`` takes the row count from the step's attention metadata.
Layer l's prediction is written before layer l-1's attention and overwritten at layer l+1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_EXPECTED = {"GPUModelRunner": ["self", "load_dummy_weights", "model"],
             "CPUModelRunner": ["self", "load_dummy_weights"]}
_FORWARD = ["self", "positions", "hidden_states"]
_OP = "keep_predicted_query"


@dataclass
class _Predictions:
    buffer: torch.Tensor  # [2, max_num_tokens, local q heads, head_dim]
    layer_names: dict[int, str]  # predicted layer index -> its attention layer name
    hooks: list = field(default_factory=list)


_STATE: _Predictions | None = None


def apply() -> None:
    from vllm.model_executor.models.llama import LlamaAttention
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_shadowkv.patches import check_signature, own_attribute

    check_signature(LlamaAttention.forward, _FORWARD, "LlamaAttention.forward")  # the hook's
    _register_op()
    for cls in (GPUModelRunner, CPUModelRunner):
        original = own_attribute(cls, "load_model")
        if getattr(original, "_shadowkv_original", None) is not None:
            continue
        check_signature(original, _EXPECTED[cls.__name__], f"{cls.__name__}.load_model")
        cls.load_model = _load_model(original)


def _load_model(original):
    def load_model(self, *args, **kwargs):
        original(self, *args, **kwargs)
        enable_if_asked(self)

    load_model._shadowkv_original = original
    return load_model


def enable_if_asked(runner) -> None:
    from vllm_shadowkv.config import stamp_of

    stamp = stamp_of(runner.vllm_config)
    if (stamp is not None and stamp.method == "tailorkv"
            and stamp.settings.channel_query == "predicted"):
        if runner.vllm_config.parallel_config.use_ubatching:
            from vllm_shadowkv.methods.base import SettingsError

            raise SettingsError("tailorkv.channel_query 'predicted' does not run with "
                                "micro-batching (--enable-dbo, ubatch_size > 1): its rows are "
                                "the whole step's; use 'current' or turn micro-batching off")
        enable(runner.get_model(), max_num_tokens=runner.max_num_tokens, dtype=runner.dtype)


def check_model_class(model_cls: type, architecture: str) -> None:
    """The front end's check, before anything loads: the model is vLLM's Llama or built on it
    (Llama, Mistral, Phi-3, ...). ``enable`` checks the attention layers themselves when the
    model loads (a Llama subclass may bring attention of its own, as Llama 4 does)."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    if not issubclass(model_cls, LlamaForCausalLM):
        from vllm_shadowkv.methods.base import SettingsError

        raise SettingsError(
            f"tailorkv.channel_query 'predicted' needs a Llama-family model (vLLM's "
            f"LlamaForCausalLM or a model built on it: Llama, Mistral, ...); {architecture} is "
            f"{model_cls.__name__}. Use tailorkv.channel_query 'current'")


def enable(model: torch.nn.Module, *, max_num_tokens: int, dtype: torch.dtype) -> None:
    """Predict the query of every LlamaAttention layer from its predecessor's input (layers
    whose predecessor is on this rank and is one too). Refuses any other attention."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.llama import LlamaAttention
    from vllm.model_executor.models.utils import extract_layer_index

    global _STATE
    disable()
    _register_op()
    layers = {}  # layer index -> (its LlamaAttention, its attention layer name)
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            parent = model.get_submodule(name.rpartition(".")[0])
            if not isinstance(parent, LlamaAttention) or _forward_of(parent)[:3] != _FORWARD:
                _refuse(model, f"{type(parent).__name__} attention layers")
            layers[extract_layer_index(module.layer_name)] = (parent, module.layer_name)
    if not layers:
        _refuse(model, "no attention layers")
    first = next(iter(layers.values()))[0]
    buffer = torch.empty(2, max_num_tokens, first.num_heads, first.head_dim, dtype=dtype,
                         device=first.qkv_proj.weight.device)
    state = _Predictions(buffer, {})
    for index, (attention, name) in sorted(layers.items()):
        if index - 1 in layers:
            hook = _predict_next(attention, index & 1)
            state.hooks.append(layers[index - 1][0].register_forward_pre_hook(
                hook, with_kwargs=True))
            state.layer_names[index] = name
    _STATE = state


def disable() -> None:
    global _STATE
    if _STATE is not None:
        for handle in _STATE.hooks:
            handle.remove()
    _STATE = None


def predicted(layer_index: int) -> torch.Tensor | None:
    """This step's predicted query of the layer, ``[num_tokens, local q heads, head_dim]`` in
    the order of the layer's query rows; valid in layer_index-1's and layer_index's attention.
    None when disabled, for a layer without a predecessor, or outside a step with metadata."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    state = _STATE
    if state is None or layer_index not in state.layer_names or not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    assert not isinstance(metadata, list), "micro-batching is refused when the model loads"
    if isinstance(metadata, dict):
        metadata = metadata.get(state.layer_names[layer_index])
    if metadata is None:  # profiling run
        return None
    return state.buffer[layer_index & 1, : metadata.num_actual_tokens]


def _predict_next(successor, slot: int):
    """The pre-hook of the successor's predecessor: args/kwargs are (positions, hidden_states)."""
    from vllm.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod

    qkv, q_size = successor.qkv_proj, successor.q_size
    weight = getattr(qkv, "weight", None)
    # The query rows of the fused weight, unless they are not plain rows (quantized, LoRA, or
    # repacked by the CPU GEMM): then the whole qkv projection, cut.
    rows = (type(qkv) is QKVParallelLinear
            and isinstance(qkv.quant_method, UnquantizedLinearMethod) and weight is not None
            and weight.dim() == 2 and weight.shape[0] == q_size + 2 * successor.kv_size)

    def before_attention(module, args, kwargs):
        args = list(args)
        positions = kwargs["positions"] if "positions" in kwargs else args[0]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
        if rows:
            bias = None if qkv.bias is None else qkv.bias[:q_size]
            q = torch.nn.functional.linear(hidden, qkv.weight[:q_size], bias)
        else:
            q = qkv(hidden)[0][..., :q_size]
        q, _ = successor.rotary_emb(positions, q)
        positions = torch.ops.vllm_shadowkv.keep_predicted_query(q, positions, slot)
        if "positions" in kwargs:
            kwargs["positions"] = positions
        else:
            args[0] = positions
        return tuple(args), kwargs

    return before_attention


def _keep(query: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
    buffer = _STATE.buffer
    n = query.shape[0]
    if n > buffer.shape[1]:
        raise RuntimeError(f"vllm-shadowkv: {n} tokens in one forward, the predicted-query "
                           f"buffer holds {buffer.shape[1]} (the runner's max_num_tokens)")
    buffer[slot, :n].copy_(query.reshape(buffer[slot, :n].shape))
    return positions.clone()  # the dependency that orders this write before the attention


def _register_op() -> None:
    if hasattr(torch.ops.vllm_shadowkv, _OP):
        return
    op = torch.library.custom_op(f"vllm_shadowkv::{_OP}", _keep, mutates_args=(),
                                 schema="(Tensor query, Tensor positions, int slot) -> Tensor")
    op.register_fake(lambda query, positions, slot: torch.empty_like(positions))


def _forward_of(attention) -> list[str]:
    import inspect

    return list(inspect.signature(type(attention).forward).parameters)


def _refuse(model, has: str) -> None:
    from vllm_shadowkv.methods.base import SettingsError

    raise SettingsError(
        f"tailorkv.channel_query 'predicted' needs Llama-family attention layers (vLLM's "
        f"LlamaAttention: Llama, Mistral, ...); {type(model).__name__} has {has}. Use "
        f"tailorkv.channel_query 'current'")
