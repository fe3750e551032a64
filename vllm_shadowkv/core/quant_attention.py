"""Attention over KIVI-quantized token groups, dequantizing one block of groups at a time.

Torch reference of vllm_shadowkv.triton_kernels.quant_kernels.quant_attention (same signature).
Every query row of a request attends all of its quantized groups (no causal mask among them):
the 16-bit residual is attended separately and merged by LSE (attention.merge_attention). With
``logits_row`` the pass also returns that query row's logits over every token of the request
(SpeCache's top-k: the keys are then dequantized once per step, not twice).
"""

import torch

from .attention import attention_with_lse, merge_attention
from .kivi import KiviFormat, QuantizedGroups, dequantize_groups

# The fp32 keys one block dequantizes, whole batch (then as many bytes of values). A block past
# glibc's mmap threshold (32 MiB at most) is mapped afresh and zero-filled page by page on each
# call: SpeCache's single 64 MiB block of a 16K-token request at Llama-3.1-8B shapes spent half
# its time so. Smaller blocks reuse the heap but each is a call of its own: 8 MiB measured best
# of 2, 8, 16 and 64 (benchmarks/RESULTS.md, "Quantized decode blocks on the CPU").
BLOCK_BYTES = 8 << 20


def quant_attention(
    q: torch.Tensor,
    groups: QuantizedGroups,
    group_table: torch.Tensor,
    group_count: torch.Tensor,
    fmt: KiviFormat,
    scale: float,
    logits_row: int | None = None,
    most_groups: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """q [B, s_q, h_q, d]; groups: a pool of token groups (kivi.QuantizedGroups, leading dims
    [n_pool, h_kv]); group_table [B, max_groups] int32 pool ids, request b owns the first
    group_count[b] [B] int32 entries (the rest are ignored). -> out [B, s_q, h_q, d] (q's
    dtype), lse [B, s_q, h_q] fp32; a request without groups gets out 0 and lse -inf. With
    ``logits_row`` (an index into s_q) also -> logits [B, h_q, max(group_count) * G] fp32 of
    that row, token t of table entry j at j * G + t, as mixed_attention.quant_logits returns
    them. ``most_groups``: max(group_count) where the caller knows it on the host (else it is
    read from the device: a host wait on a GPU)."""
    batch, s_q, h_q, head_dim = q.shape
    assert head_dim == fmt.head_dim and group_table.shape[0] == group_count.shape[0] == batch
    assert logits_row is None or 0 <= logits_row < s_q
    width = longest(group_count, most_groups)
    if width == 0:
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        if logits_row is None:
            return out, lse
        return out, lse, q.new_empty((batch, h_q, 0), dtype=torch.float32)
    q32 = q.float()
    outs, lses, logits = [], [], []
    for ids, valid in group_blocks(group_table, group_count, fmt, groups, most_groups):
        k, v = dequantize_groups(QuantizedGroups(*(t[ids] for t in groups)), fmt,
                                 torch.float32)  # [B * n * G, h_kv, d]
        k = k.unflatten(0, (batch, -1)).transpose(1, 2)  # [B, h_kv, n * G, d]
        v = v.unflatten(0, (batch, -1)).transpose(1, 2)
        out, lse = attention_with_lse(q32, k, v, valid.unsqueeze(2), scale)
        outs.append(out)
        lses.append(lse)
        if logits_row is not None:
            rows = q32[:, logits_row].unflatten(1, (k.shape[1], -1))  # [B, h_kv, g, d]
            row_logits = torch.matmul(rows, k.transpose(-1, -2)) * scale
            logits.append(row_logits.masked_fill(~valid.unsqueeze(2), float("-inf")).flatten(1, 2))
    out, lse = merge_attention(outs, lses)
    if logits_row is None:
        return out.to(q.dtype), lse
    return out.to(q.dtype), lse, torch.cat(logits, dim=-1)


def longest(group_count: torch.Tensor, most_groups: int | None) -> int:
    """max(group_count): the caller's host-side figure when it has one."""
    if most_groups is not None:
        return most_groups
    return int(group_count.max()) if group_count.numel() else 0


def group_blocks(group_table: torch.Tensor, group_count: torch.Tensor, fmt: KiviFormat,
                 groups: QuantizedGroups, most_groups: int | None = None):
    """The requests' table entries of the pool ``groups`` in blocks of at most BLOCK_BYTES of
    fp32 keys dequantized over the batch (at least one entry per request): yields (pool ids
    [B * n] int64, the padding entries clamped into the pool; valid [B, 1, n * G] bool: the
    request's own tokens)."""
    batch = group_table.shape[0]
    width = longest(group_count, most_groups)
    n_pool, h_kv = groups.key_codes.shape[:2]
    token_bytes = h_kv * fmt.head_dim * 4
    block = max(1, BLOCK_BYTES // (token_bytes * fmt.group * max(batch, 1)))  # per request
    for j0 in range(0, width, block):
        cols = torch.arange(j0, min(j0 + block, width), device=group_table.device)
        ids = group_table[:, cols].long().clamp(0, n_pool - 1).flatten()
        yield ids, (cols < group_count.view(-1, 1)).repeat_interleave(fmt.group, dim=1)[:, None]

