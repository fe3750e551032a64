"""How close sparse decode is to dense attention: output relative error and top-chunk recall.

Shared by the core tests and the engine-level evaluation.
"""

from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class Fidelity:
    relative_error: float  # ||out - dense|| / ||dense||
    chunk_recall: float  # share of the truly top-attended chunks that were attended exactly


def chunk_attention_mass(q: torch.Tensor, keys: torch.Tensor, chunk_size: int,
                         scale: float) -> torch.Tensor:
    """Dense attention mass per chunk and KV head, aggregated like the selection (sum over query
    tokens, max over the GQA group). q [s_q, h_q, d]; keys [T, h_kv, d] post-RoPE ->
    [h_kv, ceil(T / chunk_size)] fp32."""
    s_q, h_q, head_dim = q.shape
    num_tokens, h_kv, _ = keys.shape
    qg = q.float().view(s_q, h_kv, h_q // h_kv, head_dim)
    probs = torch.softmax(torch.einsum("shgd,thd->hgst", qg, keys.float()) * scale, dim=-1)
    n_chunks = -(-num_tokens // chunk_size)
    probs = torch.nn.functional.pad(probs, (0, n_chunks * chunk_size - num_tokens))
    per_chunk = probs.view(*probs.shape[:-1], n_chunks, chunk_size).sum(-1)
    return per_chunk.sum(dim=2).amax(dim=1)


def attended_chunks(num_tokens: int, compressed_tokens: int, outliers: torch.Tensor,
                    slot_chunks: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Chunks one request of ``num_tokens`` prompt tokens attends exactly: selected
    (slot_chunks [h_kv, k]), outliers [h_kv, o] (ids -1: none) and the local window (the tokens
    after the ``compressed_tokens``). -> bool [h_kv, ceil(T / chunk_size)]."""
    h_kv = slot_chunks.shape[0]
    n_chunks = -(-num_tokens // chunk_size)
    mask = torch.zeros(h_kv, n_chunks + 1, dtype=torch.bool, device=slot_chunks.device)
    for ids in (slot_chunks, outliers.to(mask.device)):  # -1: an empty slot or padding
        mask.scatter_(1, torch.where(ids >= 0, ids, n_chunks).long(), True)
    mask[:, compressed_tokens // chunk_size:] = True
    return mask[:, :n_chunks]


def measure_fidelity(out: torch.Tensor, dense_out: torch.Tensor, chunk_mass: torch.Tensor,
                     attended: torch.Tensor, top: int) -> Fidelity:
    """out/dense_out: any matching shapes; chunk_mass/attended [h_kv, n_chunks]; recall over each
    KV head's `top` chunks of largest dense mass, averaged over heads."""
    diff = (out.float() - dense_out.float()).norm()
    top_ids = torch.topk(chunk_mass, top, dim=-1).indices
    recall = attended.gather(1, top_ids).float().mean()
    return Fidelity(float(diff / dense_out.float().norm()), float(recall))
