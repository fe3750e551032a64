"""SpeCache's decode attention over a low-bit cache in which the top-k tokens are exact.

The quantized groups stay packed. One pass attends all of them and returns one query row's
logits; the top-k comes from those: the output row's in the "current" prefetch mode, the
speculative row's in the speculative one. The k tokens per KV head whose exact 16-bit K/V have
been fetched into slots then replace their low-bit copies in that pass's result (their low-bit
terms subtracted, the exact ones merged, by LSE; digest §12.6), so the low-bit keys are read once
a step, not once for the top-k and again for the attention with it masked. The caller merges
its exact part (16-bit residual, the step's own tokens) by LSE as well.
"""

import torch

from .attention import attention_with_lse
from .kivi import KiviFormat, QuantizedGroups, dequantize_keys, dequantize_tokens
from .quant_attention import group_blocks

_KEY_FIELDS = ("key_codes", "key_scale", "key_zero")


def quant_logits(
    q: torch.Tensor,
    groups: QuantizedGroups,
    group_table: torch.Tensor,
    group_count: torch.Tensor,
    fmt: KiviFormat,
    scale: float,
    most_groups: int | None = None,
) -> torch.Tensor:
    """One query row per request, q [B, h_q, d], against its quantized keys (pool, table and
    ``most_groups`` as in quant_attention.quant_attention) -> logits [B, h_q, max(group_count)
    * G] fp32, token t of table entry j at j * G + t, -inf past the request's tokens."""
    batch, h_q, head_dim = q.shape
    h_kv = groups.key_codes.shape[1]
    rows = q.float().view(batch, h_kv, h_q // h_kv, head_dim)
    blocks = []
    for ids, valid in group_blocks(group_table, group_count, fmt, groups, most_groups):
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


def swap_in_exact(
    quant: tuple[torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    groups: QuantizedGroups,
    group_table: torch.Tensor,
    group_count: torch.Tensor,
    fmt: KiviFormat,
    scale: float,
    slot_tokens: torch.Tensor,
    slot_k: torch.Tensor,
    slot_v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, s_q, h_q, d] over each request's quantized tokens with those held
    exact in slots taken from the slots instead, from ``quant`` = (out, lse), the attention over
    all of them (quant_attention): the slot tokens' low-bit terms are subtracted by their LSE
    weight and the exact ones merged in, so the top-k can come from that same pass's logits.
    slot_tokens [B, h_kv, k] int32 quantized token ids (as in quant_logits; -1 empty slot),
    slot_k, slot_v [B, h_kv, k, d] their exact K/V. -> out [B, s_q, h_q, d] (q's dtype), lse
    [B, s_q, h_q] fp32, to be merged with the caller's exact part. Where the slots hold every
    quantized token of a (request, KV head), the low-bit part is dropped whole (it would
    otherwise leave the rounding of its subtraction)."""
    held = (slot_tokens >= 0).unsqueeze(2)  # [B, h_kv, 1, k]
    low_k, low_v = dequantize_tokens(groups, group_table, slot_tokens, fmt)
    low_out, low_lse = attention_with_lse(q.float(), low_k, low_v, held, scale)
    exact_out, exact_lse = attention_with_lse(q.float(), slot_k, slot_v, held, scale)
    out, lse = quant[0].float(), quant[1]
    top = torch.maximum(lse, exact_lse)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight, low_weight, exact_weight = (torch.exp(x - top) for x in (lse, low_lse, exact_lse))
    covered = held.sum(-1) >= (group_count * fmt.group).view(-1, 1, 1)  # [B, h_kv, 1]
    covered = covered.repeat_interleave(q.shape[2] // held.shape[1], dim=1).transpose(1, 2)
    rest = torch.where(covered, 0.0, (weight - low_weight).clamp_min(0))  # [B, s_q, h_q]
    rest_sum = torch.where((rest > 0).unsqueeze(-1), weight.unsqueeze(-1) * out
                           - low_weight.unsqueeze(-1) * low_out, 0.0)
    total = rest + exact_weight
    out = (rest_sum + exact_weight.unsqueeze(-1) * exact_out) / total.clamp_min(
        torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out.to(q.dtype), top + torch.log(total)  # log(0) = -inf: no keys at all
