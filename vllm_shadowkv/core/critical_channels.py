"""TailorKV's token selection in offloaded (sparsity-friendly) layers: critical channels, partial
scores over them, top-k tokens per KV head (digest §5.2, Eq. 10).

Keys are read channel-major, as the store's key copy for scoring holds them: ``keys_cm``
[h_kv, d, N] (any strides), request b's prompt in columns [key_start[b], key_start[b] +
prompt_len[b]). Only the prompt's middle, tokens [sink, prompt_len - recent), competes: the
sink, the recent window and the generated tokens are attended exactly anyway.

GQA, as the paper's code does (digest §11.8): the group's query heads are summed (signed; the
paper takes the mean, the same order) for both the channel choice and the partial scores, and
the top-k is per KV head.

`channel_scores` is the torch reference of the compiled CPU kernel in cpu_kernels.py, which
reads channel rows gathered out of the host store. `channel_scores_paged` reads them where the
store keeps them (on CUDA the kernel loads pinned host memory directly, so the step never waits
for the host to gather); it is the reference of the Triton kernel in
vllm_shadowkv.triton_kernels.channel_kernels (same signature). The others are vectorised torch
used on every device (small tensors, or one torch.topk). `channel_top_k` (`select_tokens` over
`channel_scores_paged`) is the reference of the CPU's C kernel, which reads the pages in place
too and takes the top-k by radix select.
"""

import torch


def key_channel_absmax(keys_cm: torch.Tensor, key_start: torch.Tensor,
                       prompt_len: torch.Tensor) -> torch.Tensor:
    """max over each request's prompt tokens of |K| per channel -> [B, h_kv, d] fp32 (0 for an
    empty prompt). Computed once at prompt end."""
    h_kv, head_dim, _ = keys_cm.shape
    out = torch.zeros(len(prompt_len), h_kv, head_dim, dtype=torch.float32,
                      device=keys_cm.device)
    for b, (start, n) in enumerate(zip(key_start.tolist(), prompt_len.tolist())):
        if n:
            keys = keys_cm[:, :, start:start + n]
            # max and -min: no |K| copy of a long prompt
            out[b] = torch.maximum(keys.amax(dim=-1), -keys.amin(dim=-1)).float()
    return out


def group_query(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """q [B, h_q, d] -> the signed sum of each KV head's query heads [B, h_kv, d] fp32."""
    batch, h_q, head_dim = q.shape
    return q.float().view(batch, h_kv, h_q // h_kv, head_dim).sum(dim=2)


def critical_channels(q: torch.Tensor, key_absmax: torch.Tensor, num_channels: int) -> torch.Tensor:
    """The ``num_channels`` channels with the largest |q| x max|K| per (request, KV head) ->
    [B, h_kv, num_channels] int32, in no particular order.

    q [B, h_q, d]: the current layer's query or the one predicted from the previous layer's
    hidden state (the paper's q-hat); key_absmax [B, h_kv, d] from `key_channel_absmax`.
    """
    weight = group_query(q, key_absmax.shape[1]).abs() * key_absmax
    return torch.topk(weight, num_channels, dim=-1).indices.to(torch.int32)


def channel_scores(
    q: torch.Tensor,
    keys_cm: torch.Tensor,
    channels: torch.Tensor,
    key_start: torch.Tensor,
    prompt_len: torch.Tensor,
    sink: int,
    recent: int,
    max_len: int,
) -> torch.Tensor:
    """Signed partial scores sum_{c in channels} q[c] K[t, c] per (request, KV head, token) ->
    [B, h_kv, max_len] fp32, indexed by the token's position in the prompt; -inf outside
    [sink, prompt_len - recent) and past max_len.

    q [B, h_q, d] (one decode query per request); channels [B, h_kv, d_s] int32.
    """
    return scores_per_request(q, keys_cm, channels, key_start, prompt_len, sink, recent,
                              max_len, partial_scores)


def channel_scores_paged(
    q: torch.Tensor,
    pool: torch.Tensor,
    page_offset: torch.Tensor,
    page_start: torch.Tensor,
    channels: torch.Tensor,
    prompt_len: torch.Tensor,
    sink: int,
    recent: int,
    max_len: int,
    chunk: int,
    page_rows: int,
) -> torch.Tensor:
    """`channel_scores` over keys in a host store's pages. Request b's channel-major key copy is
    rows of ``chunk`` tokens of one channel, ``[h_kv, d, n_b, chunk]`` flattened to rows
    (n_b = ceil(prompt_len[b] / chunk), the last one padded); row r lies in page
    ``page_start[b] + r // page_rows``, whose first element is ``pool[page_offset[page]]``.

    pool: 1-D, the store's memory; page_offset [P] int64; page_start [B] int32. The kernel adds
    offsets to pool's address, so a store of several extents passes its first and reaches the
    others in the same address space; this reference indexes pool, so its pages must lie in it."""
    head_dim, h_kv = q.shape[-1], channels.shape[1]
    page_offset = page_offset.to(pool.device)
    parts, starts, at = [], [], 0
    for first_page, n in zip(page_start.tolist(), prompt_len.tolist()):
        chunks = -(-n // chunk)
        row = torch.arange(h_kv * head_dim * chunks, device=pool.device)
        page = page_offset[first_page + row // page_rows]
        element = (page + (row % page_rows) * chunk).view(-1, 1) + torch.arange(chunk,
                                                                                device=pool.device)
        parts.append(pool[element].view(h_kv, head_dim, chunks * chunk))
        starts.append(at)
        at += chunks * chunk
    keys_cm = torch.cat(parts, dim=2).to(q.device) if parts else q.new_empty(h_kv, head_dim, 0)
    key_start = torch.tensor(starts, dtype=torch.int32, device=q.device)
    return channel_scores(q, keys_cm, channels, key_start, prompt_len, sink, recent, max_len)


def channel_top_k(q: torch.Tensor, pool: torch.Tensor, page_offset: torch.Tensor,
                  page_start: torch.Tensor, channels: torch.Tensor, prompt_len: torch.Tensor,
                  sink: int, recent: int, max_len: int, chunk: int, page_rows: int,
                  k: int) -> torch.Tensor:
    """`select_tokens` over `channel_scores_paged`: the step's top-k middle tokens per (request,
    KV head) read from the store's pages -> [B, h_kv, k] int32, -1 after (a set: this
    reference puts the best first, the C kernel does not)."""
    scores = channel_scores_paged(q, pool, page_offset, page_start, channels, prompt_len, sink,
                                  recent, max_len, chunk, page_rows)
    return select_tokens(scores, prompt_len, sink, recent, k)


def partial_scores(q_crit: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q_crit [h_kv, d_s] fp32, keys [h_kv, d_s, m] -> [h_kv, m] fp32."""
    return torch.einsum("hc,hcm->hm", q_crit, keys.float())


def scores_per_request(q, keys_cm, channels, key_start, prompt_len, sink, recent, max_len,
                       product) -> torch.Tensor:
    """`channel_scores`, one request at a time: its channel rows gathered, then ``product``
    (`partial_scores` or a compiled equivalent)."""
    batch = q.shape[0]
    h_kv, head_dim, _ = keys_cm.shape
    out = q.new_full((batch, h_kv, max_len), float("-inf"), dtype=torch.float32)
    qg = group_query(q, h_kv)
    heads = torch.arange(h_kv, device=q.device).view(-1, 1)
    for b, (start, n) in enumerate(zip(key_start.tolist(), prompt_len.tolist())):
        lo, hi = sink, min(n - recent, max_len)
        if hi <= lo:
            continue
        ch = channels[b].long()  # [h_kv, d_s]
        # Channel rows by index_select (a row copy each; advanced indexing is ~4x slower).
        rows = (heads * head_dim + ch).flatten()
        keys = keys_cm[:, :, start + lo:start + hi].reshape(h_kv * head_dim, hi - lo)
        keys = keys.index_select(0, rows).view(h_kv, -1, hi - lo)  # [h_kv, d_s, m]
        out[b, :, lo:hi] = product(qg[b].gather(1, ch), keys)
    return out


def select_tokens(scores: torch.Tensor, prompt_len: torch.Tensor, sink: int, recent: int,
                  k: int) -> torch.Tensor:
    """Top-k tokens per (request, KV head) of `channel_scores` -> their positions in the prompt
    [B, h_kv, k] int32. Request b selects min(k, its candidates) tokens, -1 after; the order of
    the selected ids within a row is unspecified (a set)."""
    batch, h_kv, max_len = scores.shape
    out = torch.full((batch, h_kv, k), -1, dtype=torch.int32, device=scores.device)
    take = min(k, max_len)
    if take == 0:
        return out
    # Sorted: the finite scores come first, so a row's first `candidates` entries are real.
    idx = torch.topk(scores, take, dim=-1).indices
    candidates = ((prompt_len - recent).clamp(max=max_len) - sink).clamp(min=0)
    real = torch.arange(take, device=scores.device) < candidates.view(-1, 1, 1)
    out[..., :take] = torch.where(real, idx.to(torch.int32), -1)
    return out
