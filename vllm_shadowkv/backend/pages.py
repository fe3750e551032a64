"""Reading and writing one layer's pages in the places ``layout.PageLayout`` assigns.

The layer cache vLLM hands the backend is ``[num_blocks, 1, block_size, slot_elems]`` in the model
dtype; each block is one page of ``page_bytes``. Exact tokens, compressed pages and the state of
a sparse request are views of those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_shadowkv.backend.layout import PageLayout, StateLayout
from vllm_shadowkv.core.compress import CompressedPrompt
from vllm_shadowkv.core.landmarks import chunk_landmarks


def page_bytes_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page_bytes]`` uint8 view of the layer cache (no copy)."""
    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)


def exact_view(kv_cache: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """``[num_blocks, exact_per_page, 2 (k, v), h_kv, d]`` view of the layer cache (no copy)."""
    n = layout.exact_per_page * 2 * layout.key_width
    pages = kv_cache.view(kv_cache.shape[0], -1)[:, :n]
    return pages.view(-1, layout.exact_per_page, 2, layout.num_kv_heads, layout.head_size)


def exact_token_slots(layout: PageLayout, prompt_len: int, block_ids: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, slot in page) of exact tokens at ``positions`` of one request."""
    ne = layout.exact_per_page
    index, offset = positions // ne, positions % ne
    if layout.is_sparse(prompt_len):
        generated = positions >= prompt_len
        base = (layout.exact_blocks(prompt_len) + layout.packed_blocks(prompt_len)
                + layout.state_blocks(prompt_len))
        rel = positions - prompt_len
        index = torch.where(generated, base + rel // ne, index)
        offset = torch.where(generated, rel % ne, offset)
    return block_ids[index.long()].long(), offset


def read_exact(kv_cache, layout, prompt_len, block_ids, positions):
    """Keys and values ``[n, h_kv, d]`` of exact tokens at ``positions``."""
    blocks, slots = exact_token_slots(layout, prompt_len, block_ids, positions)
    kv = exact_view(kv_cache, layout)[blocks, slots]  # [n, 2, h, d]
    return kv[:, 0], kv[:, 1]


def write_exact(kv_cache, layout, blocks, slots, key, value) -> None:
    view = exact_view(kv_cache, layout)
    view[blocks, slots, 0] = key.to(view.dtype)
    view[blocks, slots, 1] = value.to(view.dtype)


# -- compressed pages and per-request state ------------------------------------------------------
def _region(layout: PageLayout, prompt_len: int, block_ids: torch.Tensor):
    staging = layout.exact_blocks(prompt_len)
    packed = layout.packed_blocks(prompt_len)
    state = layout.state_blocks(prompt_len)
    packed_ids = block_ids[staging: staging + packed].long()
    state_ids = block_ids[staging + packed: staging + packed + state].long()
    return packed_ids, state_ids


def _packed_split(layout: PageLayout) -> tuple[int, int]:
    """Elements of A rows and of landmarks in one compressed page."""
    bs, c = layout.block_size, layout.config.chunk_size
    return bs * layout.config.rank, (bs // c) * layout.key_width


@dataclass
class SparseState:
    """One sparse request's compressed prompt and selection slots (one layer), read from pages."""

    prompt: CompressedPrompt
    slot_chunks: torch.Tensor  # [h, k] int32, -1 empty
    slot_k: torch.Tensor  # [h, k*c, d]
    slot_v: torch.Tensor


def write_compressed(kv_cache, layout: PageLayout, prompt_len: int, block_ids: torch.Tensor,
                     prompt: CompressedPrompt, post_rope_keys: torch.Tensor) -> None:
    """Store a freshly compressed prompt: A rows and all chunk landmarks in its compressed pages,
    B, outliers and the exact region in its state pages, with empty selection slots."""
    packed_ids, state_ids = _region(layout, prompt_len, block_ids)
    dtype, h, d = kv_cache.dtype, layout.num_kv_heads, layout.head_size
    tokens, c = prompt.compressed_tokens, layout.config.chunk_size
    a_elems, lm_elems = _packed_split(layout)
    pages = kv_cache.view(kv_cache.shape[0], -1)
    a = torch.zeros(len(packed_ids) * layout.block_size, layout.config.rank, dtype=dtype,
                    device=kv_cache.device)
    a[:tokens] = prompt.a
    landmarks = torch.zeros(len(packed_ids) * layout.block_size // c, h, d, dtype=dtype,
                            device=kv_cache.device)
    landmarks[: tokens // c] = chunk_landmarks(post_rope_keys[:tokens], c)
    pages[packed_ids, :a_elems] = a.view(len(packed_ids), a_elems)
    pages[packed_ids, a_elems: a_elems + lm_elems] = landmarks.view(len(packed_ids), lm_elems)

    st = layout.state(prompt_len)
    raw = torch.zeros(len(state_ids) * layout.page_bytes, dtype=torch.uint8,
                      device=kv_cache.device)
    _put(raw, st.b, prompt.b)
    _put(raw, st.outliers, prompt.outliers.to(torch.int32))
    _put(raw, st.exact_k, prompt.exact_k)
    _put(raw, st.exact_v, prompt.exact_v)
    _put(raw, st.slot_chunks, torch.full((h, st.num_slots), -1, dtype=torch.int32))
    page_bytes_view(kv_cache)[state_ids] = raw.view(len(state_ids), layout.page_bytes)


def read_sparse_state(kv_cache, layout: PageLayout, prompt_len: int,
                      block_ids: torch.Tensor) -> SparseState:
    packed_ids, state_ids = _region(layout, prompt_len, block_ids)
    dtype, h, d = kv_cache.dtype, layout.num_kv_heads, layout.head_size
    c, r = layout.config.chunk_size, layout.config.rank
    tokens = layout.compressed_tokens(prompt_len)
    n_chunks = tokens // c
    a_elems, lm_elems = _packed_split(layout)
    pages = kv_cache.view(kv_cache.shape[0], -1)[packed_ids]
    a = pages[:, :a_elems].reshape(-1, r)[:tokens]
    landmarks = pages[:, a_elems: a_elems + lm_elems].reshape(-1, h, d)[:n_chunks]

    st = layout.state(prompt_len)
    raw = page_bytes_view(kv_cache)[state_ids].flatten()
    outliers = _get(raw, st.outliers, torch.int32, (h, st.num_outliers))
    selectable = torch.ones(h, n_chunks, dtype=torch.bool, device=kv_cache.device)
    selectable.scatter_(1, outliers.long(), False)
    sel_ids = torch.arange(n_chunks, device=kv_cache.device).expand(h, n_chunks)[selectable]
    sel_ids = sel_ids.view(h, -1)  # [h, n_sel] ascending, as the core's compress_prompt
    sel_landmarks = landmarks.transpose(0, 1).gather(1, sel_ids.unsqueeze(-1).expand(-1, -1, d))
    prompt = CompressedPrompt(
        num_tokens=prompt_len,
        a=a,
        a_positions=torch.arange(tokens, dtype=torch.int32, device=kv_cache.device),
        b=_get(raw, st.b, dtype, (h, r, d)),
        landmarks=sel_landmarks.transpose(0, 1).contiguous(),
        landmark_chunks=sel_ids.T.to(torch.int32).contiguous(),
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


def write_slots(kv_cache, layout: PageLayout, prompt_len: int, block_ids: torch.Tensor,
                state: SparseState) -> None:
    """Persist the selection slots (the hit cache) after a decode step."""
    _, state_ids = _region(layout, prompt_len, block_ids)
    st: StateLayout = layout.state(prompt_len)
    raw = page_bytes_view(kv_cache)[state_ids].flatten()
    _put(raw, st.slot_chunks, state.slot_chunks)
    _put(raw, st.slot_k, state.slot_k)
    _put(raw, st.slot_v, state.slot_v)
    page_bytes_view(kv_cache)[state_ids] = raw.view(len(state_ids), layout.page_bytes)


def _put(raw: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
    data = tensor.contiguous().view(-1).view(torch.uint8)
    raw[offset: offset + data.numel()] = data.to(raw.device)


def _get(raw: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    nbytes = torch.tensor([], dtype=dtype).element_size()
    count = 1
    for s in shape:
        count *= s
    return raw[offset: offset + count * nbytes].view(dtype).view(shape).clone()
