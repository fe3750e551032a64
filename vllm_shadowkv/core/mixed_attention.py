"""SpeCache's decode attention over a low-bit cache in which the top-k tokens are exact.

The quantized groups stay packed. The k tokens per KV head whose exact 16-bit K/V have been
fetched into slots are masked out of the quantized part and attended from the slots; the two
parts are merged by LSE (digest §12.6), as is the caller's exact part (16-bit residual, the
step's own tokens). The top-k comes from one query row's attention over the low-bit keys:
the output row's in the "current" prefetch mode, the speculative row's in the speculative one.
"""

import torch

from . import ops
from .attention import attention_with_lse, merge_attention
from .kivi import KiviFormat, QuantizedGroups, dequantize_keys
from .quant_attention import group_blocks

_KEY_FIELDS = ("key_codes", "key_scale", "key_zero")


def quant_logits(
    q: torch.Tensor,
    groups: QuantizedGroups,
    group_table: torch.Tensor,
    group_count: torch.Tensor,
    fmt: KiviFormat,
    scale: float,
) -> torch.Tensor:
    """One query row per request, q [B, h_q, d], against its quantized keys (pool and table
    as in quant_attention.quant_attention) -> logits [B, h_q, max(group_count) * G] fp32,
    token t of table entry j at j * G + t, -inf past the request's tokens."""
    batch, h_q, head_dim = q.shape
    h_kv = groups.key_codes.shape[1]
    rows = q.float().view(batch, h_kv, h_q // h_kv, head_dim)
    blocks = []
    for ids, _, valid in group_blocks(group_table, group_count, fmt, groups):
        keys = groups._replace(**{f: getattr(groups, f)[ids] for f in _KEY_FIELDS})
        k = dequantize_keys(keys, fmt, torch.float32).unflatten(0, (batch, -1))  # [B, n*G, h, d]
        logits = torch.matmul(rows, k.permute(0, 2, 3, 1)) * scale  # [B, h_kv, g, n * G]
        blocks.append(logits.flatten(1, 2).masked_fill(~valid, float("-inf")))
    if not blocks:
        return q.new_full((batch, h_q, 0), float("-inf"), dtype=torch.float32)
    return torch.cat(blocks, dim=-1)


def top_k_tokens(
    logits: torch.Tensor, other_lse: torch.Tensor, h_kv: int, k: int
) -> torch.Tensor:
    """The k quantized tokens per KV head that the row attends most -> ids [B, h_kv, k] int32
    (a set, unordered; -1 past the request's tokens).

    logits [B, h_q, S] from quant_logits; other_lse [B, h_q] the log-sum-exp of the row's other
    keys (residual, current tokens), so the probabilities are those of the whole attention
    row, as the paper's ArgTopK(Softmax(QK^T)). A KV head's score of a token is the sum of its
    query heads' probabilities (digest §12.1): one fetched pair serves the whole group, and
    the error its low-bit copy leaves in each head's output is weighted by that probability;
    summing logits would let a head with a flat row (small probabilities) outvote a peaked one.
    """
    batch, h_q, width = logits.shape
    lse = torch.logaddexp(torch.logsumexp(logits, dim=-1), other_lse.float())
    lse = torch.where(torch.isinf(lse), 0.0, lse)  # a row with no key at all
    probs = torch.exp(logits - lse.unsqueeze(-1)).view(batch, h_kv, h_q // h_kv, width).sum(2)
    valid = (logits > float("-inf")).view(batch, h_kv, h_q // h_kv, width)[:, :, 0]
    scores = torch.where(valid, probs, -1.0)  # a valid token can underflow to 0
    out = torch.full((batch, h_kv, k), -1, dtype=torch.int32, device=logits.device)
    take = min(k, width)
    if take:
        best = torch.topk(scores, take, dim=-1)
        out[..., :take] = torch.where(best.values >= 0, best.indices, -1).to(torch.int32)
    return out


def mixed_attention(
    q: torch.Tensor,
    groups: QuantizedGroups,
    group_table: torch.Tensor,
    group_count: torch.Tensor,
    fmt: KiviFormat,
    scale: float,
    slot_tokens: torch.Tensor,
    slot_k: torch.Tensor,
    slot_v: torch.Tensor,
    logits_row: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Attention of q [B, s_q, h_q, d] over each request's quantized tokens with those held
    exact in slots taken from the slots instead: slot_tokens [B, h_kv, k] int32 quantized
    token ids (as in quant_logits; -1 empty slot), slot_k, slot_v [B, h_kv, k, d] their exact
    K/V. -> out [B, s_q, h_q, d] (q's dtype), lse [B, s_q, h_q] fp32, to be merged with the
    caller's exact part; with ``logits_row``, also that row's quant_logits from the same pass
    (the speculative row's, for the next step's top-k)."""
    quant = ops.quant_attention(q, groups, group_table, group_count, fmt, scale, slot_tokens,
                                logits_row)
    exact = attention_with_lse(q, slot_k, slot_v, (slot_tokens >= 0).unsqueeze(2), scale)
    out, lse = merge_attention([quant[0], exact[0]], [quant[1], exact[1]])
    return (out, lse) if logits_row is None else (out, lse, quant[2])
