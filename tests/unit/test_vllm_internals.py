"""Canaries: each piece of vLLM's internals the engine reads, checked against the installed vLLM.

The patches check the signatures of what they wrap; these check what the engine reads without
wrapping it. Each failure names the piece and where the engine uses it, so a vLLM upgrade that
moves one fails here, loudly, instead of misbehaving inside a running engine.
"""

import dataclasses
import inspect

import pytest


def fields_of(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.get_annotations(cls))


def test_scheduler_output_names_released_requests():
    """patches/runner_requests.py: finished, preempted and resumed requests are released."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    missing = {"finished_req_ids", "preempted_req_ids", "scheduled_cached_reqs"} - fields_of(
        SchedulerOutput)
    assert not missing, f"SchedulerOutput lost {missing} (read by patches/runner_requests.py)"
    assert "resumed_req_ids" in fields_of(CachedRequestData), (
        "CachedRequestData.resumed_req_ids is gone (read by patches/runner_requests.py)")


def test_input_batch_has_request_ids_and_prompt_lengths():
    """WorkerState.batch_requests: the runner's input_batch rows, in metadata order."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    assert isinstance(InputBatch.__dict__.get("req_ids"), property), (
        "InputBatch.req_ids is no longer a property (read by WorkerState.batch_requests)")
    source = inspect.getsource(InputBatch.__init__)
    assert "self.num_prompt_tokens" in source, (
        "InputBatch.num_prompt_tokens is gone (read by WorkerState.batch_requests)")


def test_runner_owns_the_input_batch():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "self.input_batch" in inspect.getsource(GPUModelRunner.__init__), (
        "GPUModelRunner.input_batch is gone (read by WorkerState.batch_requests)")


def test_common_attention_metadata_fields():
    """EngineMetadataBuilder.build reads these."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    wanted = {"query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "num_reqs",
              "num_actual_tokens", "block_table_tensor"}
    missing = wanted - fields_of(CommonAttentionMetadata)
    assert not missing, f"CommonAttentionMetadata lost {missing} (read by EngineMetadataBuilder)"


@pytest.mark.parametrize("name, params", [
    ("remove_skipped_blocks", ["self", "request_id", "processed_computed_tokens",
                               "num_prompt_tokens"]),
    ("get_num_blocks_to_allocate", ["self", "request_id", "num_tokens", "new_computed_blocks",
                                    "total_computed_tokens", "num_local_computed_tokens",
                                    "num_tokens_main_model", "apply_admission_cap",
                                    "prefill_end"]),
    ("allocate_new_blocks", ["self", "request_id", "num_tokens", "num_tokens_main_model"]),
    ("free", ["self", "request_id"]),
    ("_remove_blocks_in_range", None),
    # prefix caching
    ("find_longest_cache_hit", ["block_hashes", "max_length", "kv_cache_group_ids",
                                "block_pool", "kv_cache_spec", "drop_eagle_block",
                                "alignment_tokens", "dcp_world_size", "pcp_world_size"]),
    ("cache_blocks", ["self", "request", "num_tokens", "retention_interval",
                      "replay_boundaries"]),
    ("_has_partial_local_hit", ["self", "new_computed_blocks", "num_local_computed_tokens"]),
    ("_get_num_evictable_blocks", ["blocks"]),
])
def test_block_manager_protocol(name, params):
    """CompressedKVManager overrides or calls these methods of vLLM's single-type manager."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    method = getattr(FullAttentionManager, name, None)
    assert method is not None, f"FullAttentionManager.{name} is gone (CompressedKVManager)"
    if params is not None:
        got = list(inspect.signature(method).parameters)
        assert got == params, f"FullAttentionManager.{name}{got}: CompressedKVManager expects {params}"


def test_block_manager_state():
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    source = inspect.getsource(SingleTypeKVCacheManager.__init__)
    for attr in ("self.req_to_blocks", "self.new_block_ids", "self._record_new_block_ids",
                 "self.block_pool", "self.num_cached_block", "self.kv_cache_group_id"):
        assert attr in source, f"SingleTypeKVCacheManager{attr[4:]} is gone (CompressedKVManager)"


def test_block_pool_caches_blocks_by_any_key():
    """CompressedKVManager.cache_blocks keys exact pages by hashes of its own in vLLM's pool."""
    from vllm.v1.core.block_pool import BlockPool

    params = list(inspect.signature(BlockPool._insert_block_hash).parameters)
    assert params == ["self", "block_hash_with_group_id", "block", "num_tokens"], (
        f"BlockPool._insert_block_hash{params}: CompressedKVManager.cache_blocks calls it")
    assert "self.hash_block_size" in inspect.getsource(BlockPool.__init__), (
        "BlockPool.hash_block_size is gone (CompressedKVManager.find_longest_cache_hit)")


def test_block_pool_words_kv_cache_events():
    """CompressedKVManager announces the blocks its pages fill as vLLM's pool announces its own."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool

    params = list(inspect.signature(BlockPool._build_block_stored_event).parameters)
    assert params == ["self", "request", "block_hashes", "parent_block_hash", "start_token_idx",
                      "end_token_idx", "block_size", "kv_cache_group_id", "extra_keys_list"], (
        f"BlockPool._build_block_stored_event{params}: CompressedKVManager._announce calls it")
    source = inspect.getsource(BlockPool.__init__)
    for attr in ("self.kv_event_queue", "self.enable_kv_cache_events"):
        assert attr in source, f"BlockPool{attr[4:]} is gone (CompressedKVManager._announce)"
    params = list(inspect.signature(kv_cache_utils.generate_block_hash_extra_keys).parameters)
    assert params == ["request", "start_token_idx", "end_token_idx", "start_mm_idx"], (
        f"generate_block_hash_extra_keys{params}: CompressedKVManager._announce calls it")


def test_layer_index_and_rotary_embedding():
    """EngineImpl: the layer index from its name, and the model's own rotary embedding."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models.utils import extract_layer_index

    assert extract_layer_index("model.layers.7.self_attn.attn") == 7
    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps read it when built
        rope = get_rope(64, max_position=128, is_neox_style=True, rope_parameters=None)
    for attr in ("cos_sin_cache", "rotary_dim", "is_neox_style"):
        assert hasattr(rope, attr), f"the rotary embedding lost {attr} (read by EngineImpl)"


def test_attention_layer_exposes_its_impl_and_name():
    """patches/layer_kv_spec.py reads Attention.impl and Attention.layer_name."""
    from vllm.model_executor.layers.attention.attention import Attention

    source = inspect.getsource(Attention.__init__)
    assert "self.impl" in source and "self.layer_name" in source, (
        "Attention.impl / Attention.layer_name are gone (patches/layer_kv_spec.py)")
