"""Plugin load, registration, patches and the packaging guard."""

import os
import subprocess
import sys

import pytest

from vllm_shadowkv import plugin
from vllm_shadowkv.patches import PatchTargetChanged, check_signature


def test_unsupported_vllm_version_is_refused():
    plugin.check_vllm_version("0.32.3")
    for version in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x \(>=0\.32\.0,<0\.33\).*"
                                               + version.replace(".", r"\.")):
            plugin.check_vllm_version(version)


def test_an_unsupported_vllm_runs_without_the_plugin(monkeypatch):
    """vLLM calls every installed general plugin in every process without catching: under a
    vLLM the plugin does not support it must say why and stay out, not stop vLLM."""
    from unittest.mock import Mock

    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(plugin, "logger", Mock())
    monkeypatch.setattr(plugin, "register_backend", Mock())
    plugin.register()
    message = plugin.logger.error.call_args[0][0] % plugin.logger.error.call_args[0][1:]
    assert "found vLLM 0.33.0" in message and "vllm-shadowkv is disabled" in message
    assert "shadowkv, minikv" in message
    assert not plugin.register_backend.called


def test_register_is_idempotent_and_names_every_method():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_shadowkv.methods import NAMES

    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_CLASS_PATH
    for name in NAMES:
        member = AttentionBackendEnum[name.upper()]
        assert plugin.named_method(member) == name
        assert member.get_path() == plugin.BACKEND_CLASS_PATH


def test_custom_slot_survives_the_trip_to_a_fresh_process():
    """What the spawned engine core does: unpickle before loading plugins, then load them. The
    front end hands it CUSTOM (the method travels in the config's stamp)."""
    import pickle

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    payload = pickle.dumps(AttentionBackendEnum.CUSTOM).hex()
    code = (
        "import pickle\n"
        f"backend = pickle.loads(bytes.fromhex('{payload}'))\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print(backend.name, backend.get_path())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["CUSTOM", plugin.BACKEND_CLASS_PATH]


def test_cpu_selection_patch_honours_shadowkv_only():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig
    import torch

    plugin.register()
    config = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                     block_size=128)
    pick = CpuPlatform.get_attn_backend_cls
    assert pick(AttentionBackendEnum.CUSTOM, config) == plugin.BACKEND_CLASS_PATH
    assert pick(None, config) == AttentionBackendEnum.CPU_ATTN.get_path()
    with pytest.raises(ValueError, match="cannot serve this layer: attention type"):
        pick(AttentionBackendEnum.CUSTOM, config._replace(attn_type="encoder_only"))


def test_patch_targets_are_checked():
    def moved(cls, selected_backend, attn_selector_config, num_heads, extra):
        pass

    with pytest.raises(PatchTargetChanged, match="not a supported version"):
        check_signature(moved, ["selected_backend", "attn_selector_config", "num_heads"], "x")

    from vllm_shadowkv.patches import own_attribute

    class Base:
        def load_model(self):
            pass

    class Runner(Base):  # a vLLM that stopped overriding the patched method
        pass

    assert own_attribute(Base, "load_model") is Base.__dict__["load_model"]
    with pytest.raises(PatchTargetChanged, match="Runner.load_model: the class no longer "
                                                 "defines it"):
        own_attribute(Runner, "load_model")


def test_patches_are_installed_on_the_live_vllm():
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    plugin.register()
    assert CpuPlatform.get_attn_backend_cls.__func__._shadowkv_original is not None
    assert type(current_platform).check_and_update_config.__func__._shadowkv_original is not None
    assert GPUModelRunner._update_states._shadowkv_original is not None
    from vllm.v1.core.sched.scheduler import Scheduler

    assert Scheduler.update_from_output._shadowkv_original is not None  # patches/pre_decode.py
    from vllm.model_executor.layers.attention.attention import Attention

    assert Attention.get_kv_cache_spec._shadowkv_original is not None
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    for worker in (Worker, CPUWorker):  # patches/kernel_warm_up.py
        assert worker.compile_or_warm_up_model._shadowkv_original is not None
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert KVCacheManager.get_computed_blocks._shadowkv_original is not None  # prefix_cache_hits
    assert BlockPool._emit_block_removed_events._shadowkv_original is not None  # kv_cache_events
    assert KVCacheCoordinator.emit_cached_block_events._shadowkv_original is not None
    from vllm.v1.engine.input_processor import InputProcessor

    assert InputProcessor.process_inputs._shadowkv_original is not None  # streaming_input


def test_released_requests_are_ended_or_suspended():
    from types import SimpleNamespace

    from vllm_shadowkv.patches.runner_requests import released_requests

    output = SimpleNamespace(
        finished_req_ids={"done", "aborted"}, preempted_req_ids={"pre"},
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids={"resumed"}))
    assert released_requests(output) == ({"done", "aborted"}, {"pre", "resumed"})
    output.preempted_req_ids = None
    assert released_requests(output) == ({"done", "aborted"}, {"resumed"})


def test_kv_spec_is_registered_with_its_manager():
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_shadowkv.backend.kv_spec import CompressedKVManager, CompressedKVSpec

    plugin.register()
    spec = CompressedKVSpec(block_size=128, num_kv_heads=8, head_size=128, dtype=__import__(
        "torch").bfloat16, num_head_slots=1, state_content_bytes=576)
    assert KVCacheSpecRegistry.get_manager_class(spec) is CompressedKVManager
    assert spec.page_size_bytes == 128 * 576


def test_triton_kernels_is_not_a_top_level_module(tmp_path):
    """vLLM takes an importable `triton_kernels` for OpenAI's MoE kernels: ours must not be."""
    code = (
        "import importlib.util, vllm_shadowkv.triton_kernels\n"
        "from vllm.utils.import_utils import has_triton_kernels\n"
        "print(importlib.util.find_spec('triton_kernels'), has_triton_kernels())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["None", "False"]
