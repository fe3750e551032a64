"""Dense reference attention for the core tests (torch SDPA, GQA by repeating KV heads)."""

import torch


def dense_attention(q, keys, values, scale=None):
    """q [s_q, h_q, d] as the last s_q positions of keys/values [T, h_kv, d] (causal among them)
    -> out [s_q, h_q, d] fp32."""
    s_q, h_q, _ = q.shape
    total, h_kv, _ = keys.shape
    group = h_q // h_kv
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(total) <= (total - s_q + torch.arange(s_q)).unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
