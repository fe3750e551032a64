"""The exact torch paged attention against SDPA on contiguous K/V (vLLM's backend-test recipe:
context scattered into a randomly permuted paged cache, ragged decode/prefill/mixed batches)."""

import pytest
import torch
import torch.nn.functional as F

from vllm_shadowkv.backend.paged_attention import paged_attention, split_kv_cache, write_kv

BATCHES = {  # (seq_lens, query_lens)
    "decode": ([37, 300, 129], [1, 1, 1]),
    "prefill": ([17, 200], [17, 200]),
    "mixed": ([513, 45, 96, 1], [1, 45, 30, 1]),
}


def reference(q, k, v, scale):
    """q [Q, Hq, d] are the last Q positions of k, v [S, Hkv, d]."""
    S, Q = k.shape[0], q.shape[0]
    mask = torch.arange(S)[None, :] <= torch.arange(S - Q, S)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (32, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_sdpa(batch, heads, dtype):
    torch.manual_seed(0)
    seq_lens, query_lens = BATCHES[batch]
    (hq, hkv), d, block = heads, 64, 16
    blocks_per_req = [-(-s // block) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 5
    kv_cache = torch.zeros(num_blocks, hkv, block, 2 * d, dtype=dtype)
    key_cache, value_cache = split_kv_cache(kv_cache, d)
    perm = torch.randperm(num_blocks - 1) + 1  # block 0 stays the null block, as in vLLM
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    used, queries, refs, starts = 0, [], [], [0]
    for i, (s, q_len) in enumerate(zip(seq_lens, query_lens)):
        ids = perm[used : used + blocks_per_req[i]]
        used += blocks_per_req[i]
        block_table[i, : len(ids)] = ids
        k, v = torch.randn(s, hkv, d, dtype=dtype), torch.randn(s, hkv, d, dtype=dtype)
        positions = torch.arange(s)
        write_kv(k, v, key_cache, value_cache, ids[positions // block] * block + positions % block)
        q = torch.randn(q_len, hq, d, dtype=dtype)
        queries.append(q)
        refs.append(reference(q, k, v, d**-0.5))
        starts.append(starts[-1] + q_len)
    query = torch.cat(queries)
    out = torch.empty_like(query)
    paged_attention(query, key_cache, value_cache, starts, seq_lens, block_table, d**-0.5, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), torch.cat(refs), atol=tol, rtol=tol)


def test_write_kv_skips_padding_slots():
    kv_cache = torch.zeros(4, 2, 8, 2 * 4)
    key_cache, value_cache = split_kv_cache(kv_cache, 4)
    k = torch.ones(3, 2, 4)
    write_kv(k, 2 * k, key_cache, value_cache, torch.tensor([9, -1, 10]))
    assert key_cache[1, :, 1].eq(1).all() and value_cache[1, :, 2].eq(2).all()
    assert kv_cache.count_nonzero() == 2 * 2 * 4 * 2  # 2 tokens x 2 heads x (k + v) x 4
