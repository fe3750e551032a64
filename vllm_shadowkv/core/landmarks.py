"""Chunk landmarks (mean post-RoPE key) and outlier chunks (lowest in-chunk cosine similarity)."""

import torch


def chunk_landmarks(keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """keys [n_chunks*c, h_kv, d] post-RoPE -> landmarks [n_chunks, h_kv, d], fp32."""
    n_tokens, num_heads, head_dim = keys.shape
    chunks = keys.float().view(n_tokens // chunk_size, chunk_size, num_heads, head_dim)
    return chunks.mean(dim=1)


def outlier_chunks(keys: torch.Tensor, landmarks: torch.Tensor, count: int) -> torch.Tensor:
    """Per KV head, the `count` chunks whose least similar token (cosine vs the chunk's landmark)
    is least similar: [h_kv, count] int64 chunk ids, ascending. The mean hides these chunks'
    tokens, so they are kept exact instead of being selected through their landmark.
    """
    n_chunks, num_heads, head_dim = landmarks.shape
    chunks = keys.float().view(n_chunks, -1, num_heads, head_dim)
    cos = torch.nn.functional.cosine_similarity(chunks, landmarks.unsqueeze(1), dim=-1)
    min_cos = cos.amin(dim=1)  # [n_chunks, h_kv]
    ids = torch.topk(min_cos.T, count, dim=-1, largest=False).indices
    return ids.sort(dim=-1).values
