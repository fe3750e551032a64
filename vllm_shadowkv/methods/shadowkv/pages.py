"""ShadowKV's region of a compressed request, in the pages the engine assigns it.

A page of ``block_size`` token slots holds, for ``block_size`` compressed prompt tokens, their A
rows ``[block_size, r]`` and the landmarks of their chunks ``[block_size / c, h_kv, d]``: one
token slot is ``r + h_kv*d/c`` elements (576 B at Llama-3.1-8B shapes instead of 4 KiB exact).
The region is those compressed pages, then the per-request state pages: B, outlier chunk ids,
the exact region (outlier chunks + local window) and the selection slots (ids, K, V: the hit
cache that persists between decode steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_shadowkv.core.compress import CompressedPrompt
from vllm_shadowkv.core.landmarks import chunk_landmarks, selectable_landmarks
from vllm_shadowkv.methods.base import KVShapes
from vllm_shadowkv.methods.shadowkv.settings import ShadowKVSettings

ALIGN = 16  # bytes; keeps every state field aligned for any dtype view


@dataclass(frozen=True)
class StateLayout:
    """Byte offsets of one compressed request's per-request state (one layer)."""

    num_outliers: int  # o: outlier chunks per KV head
    exact_tokens: int  # o*c outlier tokens + the local window
    num_slots: int  # k: selected chunks per KV head
    b: int
    outliers: int
    exact_k: int
    exact_v: int
    slot_chunks: int
    slot_k: int
    slot_v: int
    nbytes: int


@dataclass(frozen=True)
class ShadowKVPages:
    settings: ShadowKVSettings
    shapes: KVShapes

    @property
    def token_bytes(self) -> int:
        """One compressed token: its A row and its share of a chunk landmark."""
        s = self.settings
        return (s.rank + math.ceil(self.shapes.key_width / s.chunk_size)) * self.shapes.elem_bytes

    def compressed_tokens(self, prompt_len: int) -> int:
        """Prompt tokens that go to the low-rank pool; 0 means the request stays exact."""
        return self.settings.params.compressed_chunks(prompt_len) * self.settings.chunk_size

    def packed_blocks(self, prompt_len: int) -> int:
        return -(-self.compressed_tokens(prompt_len) // self.shapes.block_size)

    def state(self, prompt_len: int) -> StateLayout:
        p, c = self.settings.params, self.settings.chunk_size
        n_chunks = p.compressed_chunks(prompt_len)
        o = min(p.outlier_chunks, n_chunks)
        k = p.select_chunks  # the core keeps a fixed slot count (unused slots stay empty)
        exact = o * c + prompt_len - n_chunks * c
        e, h, d = self.shapes.elem_bytes, self.shapes.num_kv_heads, self.shapes.head_size
        sizes = {
            "b": h * p.rank * d * e,
            "outliers": h * o * 4,
            "exact_k": h * exact * d * e,
            "exact_v": h * exact * d * e,
            "slot_chunks": h * k * 4,
            "slot_k": h * k * c * d * e,
            "slot_v": h * k * c * d * e,
        }
        offsets, at = {}, 0
        for name, size in sizes.items():
            offsets[name] = at
            at += -(-size // ALIGN) * ALIGN
        return StateLayout(num_outliers=o, exact_tokens=exact, num_slots=k, nbytes=at, **offsets)

    def state_blocks(self, prompt_len: int) -> int:
        return -(-self.state(prompt_len).nbytes // (self.shapes.block_size * self.token_bytes))

    # -- page I/O -----------------------------------------------------------------------------
    def _split(self, region_ids: torch.Tensor, prompt_len: int):
        packed = self.packed_blocks(prompt_len)
        return region_ids[:packed], region_ids[packed:]

    def _packed_elems(self) -> tuple[int, int]:
        """Elements of A rows and of landmarks in one compressed page."""
        bs, c = self.shapes.block_size, self.settings.chunk_size
        return bs * self.settings.rank, (bs // c) * self.shapes.key_width

    def write_compressed(self, kv_cache, region_ids: torch.Tensor, prompt: CompressedPrompt,
                         post_rope_keys: torch.Tensor) -> None:
        """A freshly compressed prompt: A rows and all chunk landmarks in its compressed pages;
        B, outliers and the exact region in its state pages, with empty selection slots."""
        packed_ids, state_ids = self._split(region_ids, prompt.num_tokens)
        dtype, device = kv_cache.dtype, kv_cache.device
        h, d, c = self.shapes.num_kv_heads, self.shapes.head_size, self.settings.chunk_size
        tokens, bs = prompt.compressed_tokens, self.shapes.block_size
        a_elems, lm_elems = self._packed_elems()
        pages = kv_cache.view(kv_cache.shape[0], -1)
        a = torch.zeros(len(packed_ids) * bs, self.settings.rank, dtype=dtype, device=device)
        a[:tokens] = prompt.a
        landmarks = torch.zeros(len(packed_ids) * bs // c, h, d, dtype=dtype, device=device)
        landmarks[: tokens // c] = chunk_landmarks(post_rope_keys[:tokens], c)
        pages[packed_ids, :a_elems] = a.view(len(packed_ids), a_elems)
        pages[packed_ids, a_elems: a_elems + lm_elems] = landmarks.view(len(packed_ids), lm_elems)

        st = self.state(prompt.num_tokens)
        raw = torch.zeros(len(state_ids), _page_bytes(kv_cache), dtype=torch.uint8, device=device)
        flat = raw.view(-1)
        _put(flat, st.b, prompt.b)
        _put(flat, st.outliers, prompt.outliers.to(torch.int32))
        _put(flat, st.exact_k, prompt.exact_k)
        _put(flat, st.exact_v, prompt.exact_v)
        _put(flat, st.slot_chunks, torch.full((h, st.num_slots), -1, dtype=torch.int32))
        _bytes_view(kv_cache)[state_ids] = raw

    def read_state(self, kv_cache, region_ids: torch.Tensor, prompt_len: int) -> SparseState:
        """The compressed prompt and its selection slots, read from the request's pages."""
        packed_ids, state_ids = self._split(region_ids, prompt_len)
        dtype, device = kv_cache.dtype, kv_cache.device
        h, d = self.shapes.num_kv_heads, self.shapes.head_size
        c, r = self.settings.chunk_size, self.settings.rank
        tokens = self.compressed_tokens(prompt_len)
        a_elems, lm_elems = self._packed_elems()
        pages = kv_cache.view(kv_cache.shape[0], -1)[packed_ids]
        a = pages[:, :a_elems].reshape(-1, r)[:tokens]
        landmarks = pages[:, a_elems: a_elems + lm_elems].reshape(-1, h, d)[: tokens // c]

        st = self.state(prompt_len)
        raw = _bytes_view(kv_cache)[state_ids].flatten()
        outliers = _get(raw, st.outliers, torch.int32, (h, st.num_outliers))
        sel_landmarks, sel_ids = selectable_landmarks(landmarks, outliers.long())
        prompt = CompressedPrompt(
            num_tokens=prompt_len,
            a=a,
            a_positions=torch.arange(tokens, dtype=torch.int32, device=device),
            b=_get(raw, st.b, dtype, (h, r, d)),
            landmarks=sel_landmarks,
            landmark_chunks=sel_ids,
            outliers=outliers,
            exact_k=_get(raw, st.exact_k, dtype, (h, st.exact_tokens, d)),
            exact_v=_get(raw, st.exact_v, dtype, (h, st.exact_tokens, d)),
        )
        k_tokens = st.num_slots * c
        return SparseState(
            prompt=prompt,
            slot_chunks=_get(raw, st.slot_chunks, torch.int32, (h, st.num_slots)),
            slot_k=_get(raw, st.slot_k, dtype, (h, k_tokens, d)),
            slot_v=_get(raw, st.slot_v, dtype, (h, k_tokens, d)),
        )

    def write_slots(self, kv_cache, region_ids: torch.Tensor, prompt_len: int,
                    state: SparseState) -> None:
        """Persist the selection slots (the hit cache) after a decode step."""
        _, state_ids = self._split(region_ids, prompt_len)
        st = self.state(prompt_len)
        raw = _bytes_view(kv_cache)[state_ids]
        flat = raw.view(-1)
        _put(flat, st.slot_chunks, state.slot_chunks)
        _put(flat, st.slot_k, state.slot_k)
        _put(flat, st.slot_v, state.slot_v)
        _bytes_view(kv_cache)[state_ids] = raw


@dataclass
class SparseState:
    """One compressed request's prompt and selection slots (one layer), read from pages."""

    prompt: CompressedPrompt
    slot_chunks: torch.Tensor  # [h, k] int32, -1 empty
    slot_k: torch.Tensor  # [h, k*c, d]
    slot_v: torch.Tensor


def _page_bytes(kv_cache: torch.Tensor) -> int:
    return kv_cache[0].numel() * kv_cache.element_size()


def _bytes_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page_bytes]`` uint8 view of the layer cache (no copy)."""
    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)


def _put(raw: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
    data = tensor.contiguous().view(-1).view(torch.uint8)
    raw[offset: offset + data.numel()] = data.to(raw.device)


def _get(raw: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    count = math.prod(shape)
    return raw[offset: offset + count * dtype.itemsize].view(dtype).view(shape).clone()
