"""Chunk landmarks (mean post-RoPE key) and outlier chunks (lowest in-chunk cosine similarity)."""

import torch


def chunk_geometry(keys: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n_chunks*c, h_kv, d] post-RoPE -> (landmarks: each chunk's mean key [n_chunks, h_kv,
    d] fp32, the cosine of each chunk's least similar token to its landmark [n_chunks, h_kv])."""
    n_tokens, num_heads, head_dim = keys.shape
    chunks = keys.float().view(n_tokens // chunk_size, chunk_size, num_heads, head_dim)
    landmarks = chunks.mean(dim=1)
    cos = torch.nn.functional.cosine_similarity(chunks, landmarks.unsqueeze(1), dim=-1)
    return landmarks, cos.amin(dim=1)


def outlier_chunks(min_cos: torch.Tensor, count: int) -> torch.Tensor:
    """Per KV head, the `count` chunks whose least similar token is least similar (``min_cos``
    [n_chunks, h_kv] from `chunk_geometry`): [h_kv, count] int64 chunk ids, ascending. The mean
    hides these chunks' tokens, so they are kept exact instead of being selected through their
    landmark.
    """
    ids = torch.topk(min_cos.T, count, dim=-1, largest=False).indices
    return ids.sort(dim=-1).values


def selectable_landmarks(landmarks: torch.Tensor, outliers: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the landmarks of the chunks that are not outliers (those are attended
    exactly): landmarks [n_chunks, h_kv, d], outliers [h_kv, o] -> (landmarks [n_sel, h_kv, d]
    in the landmarks' dtype, chunk ids [n_sel, h_kv] int32), ascending chunk id."""
    n_chunks, num_heads, head_dim = landmarks.shape
    selectable = torch.ones(num_heads, n_chunks, dtype=torch.bool, device=landmarks.device)
    selectable.scatter_(1, outliers.long(), False)
    chunk_ids = torch.arange(n_chunks, device=landmarks.device).expand(num_heads, n_chunks)
    sel_ids = chunk_ids[selectable].view(num_heads, -1)  # [h, n_sel]
    picked = landmarks.transpose(0, 1).gather(1, sel_ids.unsqueeze(-1).expand(-1, -1, head_dim))
    return picked.transpose(0, 1).contiguous(), sel_ids.T.to(torch.int32).contiguous()
