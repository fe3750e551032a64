"""TailorKV's next-layer query prediction (patches/predicted_query.py) on vLLM's own Llama
decoder layers (GQA: 4 query heads, 2 KV heads, head_dim 16, qkv bias), on the CPU, with a
stand-in for the attention op: q̂ of layer l is layer l's own query of layer l-1's normed input."""

import gc
import tempfile
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_shadowkv.methods.base import SettingsError
from vllm_shadowkv.patches import PatchTargetChanged, predicted_query

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4, 64, 4, 2, 16


class TinyLlama(nn.Module):
    def __init__(self, vllm_config, config):
        from vllm.model_executor.models.llama import LlamaDecoderLayer

        super().__init__()
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(vllm_config, prefix=f"model.layers.{i}", config=config)
            for i in range(LAYERS))

    def forward(self, positions, hidden):
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual


@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    config = VllmConfig(model_config=ModelConfig(tiny_model, dtype="float32"))
    with set_current_vllm_config(config):
        started = not parallel_state.model_parallel_is_initialized()
        if started:  # tensor parallelism of one rank: the layers ask for their TP group
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"file://{tempfile.mkdtemp()}/init")
            parallel_state.initialize_model_parallel(1, 1)
        yield config
    if started:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@pytest.fixture
def model(vllm_config, request):
    """The tiny model with its weights as the GPU has them (the query rows are the first rows
    of qkv_proj.weight), or with ``request.param`` True as the CPU GEMM repacks them (none)."""
    from transformers import LlamaConfig
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         attention_bias=True, rope_theta=10000.0)
    vllm_config.compilation_config.static_forward_context.clear()  # the layers register
    with set_current_vllm_config(vllm_config):
        model = TinyLlama(vllm_config, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name
                    else 0.2 * torch.randn_like(p))
    for module in model.modules():
        if isinstance(module, LinearBase):
            module._cpu_skip_gemm_dispatch = not getattr(request, "param", False)
    with set_current_vllm_config(vllm_config):  # as the loader does
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    seen = _stand_in_attention(model)
    predicted_query.apply()
    yield model, seen
    predicted_query.disable()
    del model
    gc.collect()  # the CPU GEMM's handles are freed here, not while a later step is traced


def _stand_in_attention(model):
    """Each layer's attention op: causal GQA attention, recording its query and what
    ``predicted`` gives for this layer and the next while it runs (as the backend would)."""
    seen = {}
    for i, layer in enumerate(model.layers):
        def attention(q, k, v, i=i):
            n = q.shape[0]
            seen[i] = {"q": q.reshape(n, HEADS, HEAD_DIM).clone()}
            for j in (i, i + 1):
                got = predicted_query.predicted(j)
                seen[i][j] = None if got is None else got.clone()
            q, k, v = (t.reshape(n, -1, HEAD_DIM).transpose(0, 1) for t in (q, k, v))
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)
            return out.transpose(0, 1).reshape(n, HEADS * HEAD_DIM)

        layer.self_attn.attn.forward = attention
    return seen


def _step(model, n):
    """One forward of n tokens at positions 3.., under a forward context whose metadata names
    the step's tokens; returns each layer's attention input (the normed hidden state)."""
    from vllm.forward_context import ForwardContext, override_forward_context

    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, args, kwargs, i=i: inputs.__setitem__(i, kwargs["hidden_states"].clone()),
        with_kwargs=True, prepend=True) for i, layer in enumerate(model.layers)]
    metadata = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(num_actual_tokens=n)
                for i in range(LAYERS)}
    positions = torch.arange(3, 3 + n)
    torch.manual_seed(n)
    context = ForwardContext(no_compile_layers={}, attn_metadata=metadata, slot_mapping={})
    with torch.no_grad(), override_forward_context(context):
        model(positions, torch.randn(n, HIDDEN))
    for hook in hooks:
        hook.remove()
    return positions, inputs


def _own_query(model, seen, layer, positions, hidden):
    """Layer ``layer``'s query, its own projection and RoPE, of this hidden state."""
    with torch.no_grad():
        model.layers[layer].self_attn(positions=positions, hidden_states=hidden)
    return seen[layer]["q"]


# Repacked weights (as quantized or LoRA ones) have no query rows: the whole qkv_proj, cut.
@pytest.mark.parametrize("model", [False, True], ids=["query-rows", "repacked-qkv"],
                         indirect=True)
@pytest.mark.parametrize("n", [1, 5])
def test_prediction_is_the_next_layers_query_of_the_previous_input(model, n):
    model, seen = model
    predicted_query.enable(model, max_num_tokens=8, dtype=torch.float32)
    positions, inputs = _step(model, n)
    step = {i: dict(s) for i, s in seen.items()}
    assert step[0][0] is None  # layer 0: nothing before it
    for layer in range(1, LAYERS):
        want = _own_query(model, seen, layer, positions, inputs[layer - 1])
        assert want.shape == (n, HEADS, HEAD_DIM)
        # Readable from the previous layer's attention (to prefetch) and from its own.
        torch.testing.assert_close(step[layer - 1][layer], want)
        torch.testing.assert_close(step[layer][layer], want)
        # It is the previous input's projection, not this layer's own query.
        assert not torch.allclose(step[layer][layer], step[layer]["q"], atol=1e-3)


def test_nothing_is_predicted_when_disabled_or_outside_a_step(model):
    model, seen = model
    _step(model, 3)
    assert all(s[i] is None and s[i + 1] is None for i, s in seen.items())
    assert not any(layer.self_attn._forward_pre_hooks for layer in model.layers)
    for _ in range(2):  # once more replaces the hooks
        predicted_query.enable(model, max_num_tokens=8, dtype=torch.float32)
    assert [len(layer.self_attn._forward_pre_hooks) for layer in model.layers] == [1, 1, 1, 0]
    assert predicted_query.predicted(1) is None  # no forward context
    predicted_query.disable()
    assert not any(layer.self_attn._forward_pre_hooks for layer in model.layers)


def test_a_step_larger_than_the_buffer_is_refused(model):
    model, _ = model
    predicted_query.enable(model, max_num_tokens=4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="5 tokens in one forward.*holds 4"):
        _step(model, 5)


def test_other_attention_is_refused(model):
    model, _ = model

    class Qwen2Attention(nn.Module):
        pass

    class Qwen2ForCausalLM(nn.Module):
        pass

    other = Qwen2ForCausalLM()
    other.self_attn = Qwen2Attention()
    other.self_attn.attn = model.layers[0].self_attn.attn
    with pytest.raises(SettingsError, match="Qwen2ForCausalLM has Qwen2Attention attention "
                                            "layers. Use tailorkv.channel_query 'current'"):
        predicted_query.enable(other, max_num_tokens=8, dtype=torch.float32)
    with pytest.raises(SettingsError, match="Sequential has no attention layers"):
        predicted_query.enable(nn.Sequential(nn.Linear(2, 2)), max_num_tokens=8,
                               dtype=torch.float32)


@pytest.mark.parametrize("method, channel_query, enabled", [
    ("tailorkv", "predicted", True), ("tailorkv", "current", False), (None, None, False)])
def test_the_runner_enables_it_for_tailorkvs_predicted_query(method, channel_query, enabled,
                                                              monkeypatch):
    from vllm_shadowkv.config import STAMP_KEY, Stamp
    from vllm_shadowkv.methods.tailorkv.settings import TailorKVSettings

    calls = []
    monkeypatch.setattr(predicted_query, "enable", lambda *a, **k: calls.append((a, k)))
    additional = {}
    if method:
        stamp = Stamp(method, TailorKVSettings(channel_query=channel_query), 1 << 30)
        additional[STAMP_KEY] = stamp.to_json()
    config = SimpleNamespace(additional_config=additional,
                             parallel_config=SimpleNamespace(use_ubatching=False))
    runner = SimpleNamespace(vllm_config=config,
                             get_model=lambda: "the model", max_num_tokens=256,
                             dtype=torch.bfloat16)
    predicted_query.enable_if_asked(runner)
    want = [(("the model",), {"max_num_tokens": 256, "dtype": torch.bfloat16})]
    assert calls == (want if enabled else [])


def test_load_model_is_wrapped_and_changed_targets_are_refused(monkeypatch):
    from vllm.model_executor.models.llama import LlamaAttention
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    predicted_query.apply()
    predicted_query.apply()  # idempotent
    for cls in (GPUModelRunner, CPUModelRunner):
        original = cls.__dict__["load_model"]._shadowkv_original
        assert getattr(original, "_shadowkv_original", None) is None

    def load_model(self, load_dummy_weights=False, *, model=None, load_config=None):
        pass

    monkeypatch.setattr(GPUModelRunner, "load_model", load_model)
    with pytest.raises(PatchTargetChanged, match="GPUModelRunner.load_model"):
        predicted_query.apply()
    monkeypatch.undo()

    def forward(self, hidden_states, positions):
        pass

    monkeypatch.setattr(LlamaAttention, "forward", forward)
    with pytest.raises(PatchTargetChanged, match="LlamaAttention.forward"):
        predicted_query.apply()


@pytest.mark.parametrize("model", [False], indirect=True)
def test_compiled_the_prediction_is_written_before_the_attention_op(model):
    """torch.compile moves a plain write to a global buffer after the graph's opaque ops: the
    custom op's positions copy keeps it ahead of each attention op (vLLM's is opaque too)."""
    model, seen = model
    python_attention = {i: layer.self_attn.attn.forward for i, layer in enumerate(model.layers)}

    @torch.library.custom_op("shadowkv_test::attention", mutates_args=())
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return python_attention[layer](q, k, v)

    attention.register_fake(lambda q, k, v, layer: q.new_empty(q.shape[0], HEADS * HEAD_DIM))
    for i, layer in enumerate(model.layers):
        layer.self_attn.attn.forward = lambda q, k, v, i=i: attention(q, k, v, i)
    eager = model.forward
    predicted_query.enable(model, max_num_tokens=8, dtype=torch.float32)
    model.forward = torch.compile(eager, backend="aot_eager", fullgraph=True)
    positions, inputs = _step(model, 5)
    step = {i: dict(s) for i, s in seen.items()}
    model.forward = eager
    for layer in range(1, LAYERS):
        want = _own_query(model, seen, layer, positions, inputs[layer - 1])
        torch.testing.assert_close(step[layer - 1][layer], want)
        torch.testing.assert_close(step[layer][layer], want)


def test_the_front_end_refuses_a_model_not_built_on_vllms_llama():
    """Before anything loads: vLLM's Llama and the models built on it pass (their attention
    layers are checked again when the model loads); Qwen2 is refused, naming the way out."""
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.mistral import MistralForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    predicted_query.check_model_class(LlamaForCausalLM, "LlamaForCausalLM")
    predicted_query.check_model_class(MistralForCausalLM, "MistralForCausalLM")
    with pytest.raises(SettingsError, match=r"needs a Llama-family model .*; Qwen2ForCausalLM "
                                            r"is Qwen2ForCausalLM. Use tailorkv.channel_query "
                                            r"'current'"):
        predicted_query.check_model_class(Qwen2ForCausalLM, "Qwen2ForCausalLM")
