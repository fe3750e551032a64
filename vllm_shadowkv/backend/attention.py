"""The ``shadowkv`` attention backend in vLLM's four-class shape.

``ShadowKVBackend`` declares what the backend supports, ``ShadowKVMetadata`` is one step's batch
description, ``ShadowKVMetadataBuilder`` makes it from vLLM's common metadata, and
``ShadowKVImpl`` stores K/V into the paged cache and runs attention. Today every request is
attended exactly (torch, CPU and CUDA); sparse ShadowKV decode adds to this path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_shadowkv import BACKEND_NAME
from vllm_shadowkv.backend.model_check import SUPPORTED_KV_CACHE_DTYPES
from vllm_shadowkv.backend.paged_attention import paged_attention, split_kv_cache, write_kv


class ShadowKVBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[ShadowKVImpl]:
        return ShadowKVImpl

    @staticmethod
    def get_builder_cls() -> type[ShadowKVMetadataBuilder]:
        return ShadowKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(8)]  # whole chunks of the default chunk_size per block

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # torch attention: any head size

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True


@dataclass
class ShadowKVMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: list[int]  # host copies: the torch path loops over requests
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_actual_tokens]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(self.num_reqs)]


class ShadowKVMetadataBuilder(AttentionMetadataBuilder[ShadowKVMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ShadowKVMetadata:
        m = common_attn_metadata
        return ShadowKVMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
            seq_lens=m.seq_lens[: m.num_reqs].tolist(),
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        )


class ShadowKVImpl(AttentionImpl[ShadowKVMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            f"sliding window ({sliding_window})": sliding_window is not None,
            f"logits soft cap ({logits_soft_cap})": bool(logits_soft_cap),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "attention sinks": sinks is not None,
            f"--kv-cache-dtype {kv_cache_dtype}": kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES,
        }
        found = [name for name, bad in unsupported.items() if bad]
        if found:
            raise ValueError(
                f"The shadowkv attention backend does not support {', '.join(found)}; it serves "
                "decoder layers with full causal RoPE attention and a 16-bit KV cache"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return  # the target layer already wrote this cache
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        n = slot_mapping.shape[0]
        write_kv(key[:n], value[:n], key_cache, value_cache, slot_mapping)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ShadowKVMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("shadowkv does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        query = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        paged_attention(
            query, key_cache, value_cache, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, attn_metadata.block_table, self.scale, out,
        )
        return output
