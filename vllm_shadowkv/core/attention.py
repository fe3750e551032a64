"""Exact GQA attention that also returns the log-sum-exp, and the merge of partial results.

Decode attends several key sets (exact region, selected slots, generated tokens); each is
attended separately and the results are merged through their LSE, so nothing is concatenated.
"""

import torch


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, s_q, h_q, d]; k, v [B, h_kv, S, d]; key_mask bool, broadcastable to
    [B, h_kv, s_q, S] (True = attend). -> out [B, s_q, h_q, d] (q's dtype), lse [B, s_q, h_q]
    fp32. A query row with no key gets out 0 and lse -inf."""
    batch, s_q, h_q, head_dim = q.shape
    h_kv = k.shape[1]
    group = h_q // h_kv
    qg = q.view(batch, s_q, h_kv, group, head_dim).permute(0, 2, 3, 1, 4).float()
    logits = torch.matmul(qg, k.float().transpose(-1, -2).unsqueeze(2)) * scale  # [B,h,G,s,S]
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.unsqueeze(2), float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(logits - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v.float().unsqueeze(2)) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (row_max + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, s_q, h_q, head_dim)
    lse = lse.permute(0, 3, 1, 2).reshape(batch, s_q, h_q)
    return out.to(q.dtype), lse


def merge_attention(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets: out [.., d] and lse [..] per set."""
    lse_all = torch.stack(lses)  # [n, ...]
    lse = torch.logsumexp(lse_all, dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lse_all - safe).unsqueeze(-1)
    out = (weights * torch.stack([o.float() for o in outs])).sum(dim=0)
    return out.to(outs[0].dtype), lse
