"""Exact GQA attention that also returns the log-sum-exp, the merge of partial results, and
exact causal attention over packed sequences (FlashAttention's varlen contract, for CUDA).

Decode attends several key sets (exact region, selected slots, generated tokens); each is
attended separately and the results are merged through their LSE, so nothing is concatenated.
On the CPU, `attention_with_lse` runs torch's fused flash kernel (16-bit inputs, fp32
accumulation, no score matrix, no copy of K/V per query head); `attention_with_lse_reference`
is the explicit computation it is tested against and what other devices run.
"""

import functools

import torch

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `attention_with_lse_reference`."""
    if q.device.type != "cpu":
        return attention_with_lse_reference(q, k, v, key_mask, scale)
    batch, s_q, h_q, head_dim = q.shape
    h_kv, width = k.shape[1], k.shape[2]
    if width == 0:  # torch's kernel divides by the key count
        return _without_keys(q)
    group = h_q // h_kv
    # The group's query heads (and the step's query tokens) become query rows of their KV head.
    rows = q.reshape(batch, s_q, h_kv, group, head_dim).permute(0, 2, 1, 3, 4)
    rows = rows.reshape(batch, h_kv, s_q * group, head_dim)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    bias, empty = None, None
    if key_mask is not None:
        mask = key_mask.expand(batch, key_mask.shape[1], key_mask.shape[2], width)
        if mask.shape[2] > 1:  # per query token: one row per (token, query head)
            mask = mask.repeat_interleave(group, dim=2)
        bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        empty = ~mask.any(dim=-1)  # [B, h_kv|1, rows|1]
    out, lse = _flash_cpu(rows.to(dtype), k.to(dtype), v.to(dtype), 0.0, False, attn_mask=bias,
                          scale=scale)
    if empty is not None and bool(empty.any()):  # the kernel gives lse 0 to a row with no key
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    out = out.view(batch, h_kv, s_q, group, head_dim).permute(0, 2, 1, 3, 4)
    lse = lse.view(batch, h_kv, s_q, group).permute(0, 2, 1, 3)
    return out.reshape(batch, s_q, h_q, head_dim).to(q.dtype), lse.reshape(batch, s_q, h_q)


def causal_attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``q`` positions of a sequence attend all its ``s`` keys, causally, on the CPU:
    query [q, Hq, d], key/value [s, Hkv, d] -> out [q, Hq, d], lse [Hkv, G, q] fp32.

    torch's flash kernel, once per query head of each KV group (K/V are never repeated per
    query head), over the prefix (no mask) and the chunk (causal), merged by their LSE: no
    [q, s] mask and no fp32 copy of the context."""
    q_len, h_q, head_dim = query.shape
    s_len, h_kv, _ = key.shape
    group, prefix = h_q // h_kv, s_len - q_len
    queries = query.transpose(0, 1).unflatten(0, (h_kv, group))  # [h_kv, G, q, d]
    keys, values = key.transpose(0, 1)[None], value.transpose(0, 1)[None]  # [1, h_kv, s, d]
    out = torch.empty(h_kv, group, q_len, head_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(h_kv, group, q_len, dtype=torch.float32, device=query.device)
    for g in range(group):
        q = queries[:, g][None]
        chunk = _flash_cpu(q, keys[:, :, prefix:], values[:, :, prefix:], 0.0, q_len > 1,
                           scale=scale)
        if prefix:
            before = _flash_cpu(q, keys[:, :, :prefix], values[:, :, :prefix], 0.0, False,
                                scale=scale)
            chunk = merge_attention([before[0], chunk[0]], [before[1], chunk[1]])
        out[:, g], lse[:, g] = chunk[0][0], chunk[1][0]
    return out.flatten(0, 1).transpose(0, 1), lse


def attention_with_lse_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, s_q, h_q, d]; k, v [B, h_kv, S, d]; key_mask bool, broadcastable to
    [B, h_kv, s_q, S] (True = attend). -> out [B, s_q, h_q, d] (q's dtype), lse [B, s_q, h_q]
    fp32. A query row with no key gets out 0 and lse -inf."""
    if k.shape[2] == 0:
        return _without_keys(q)
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


def _without_keys(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over an empty key set: out 0, lse -inf for every query row."""
    return q.new_zeros(q.shape), torch.full(q.shape[:3], float("-inf"), device=q.device)


def decode_masks(exact_width, exact_len, slot_chunks, chunk_size, gen_before, gen_width, s_q):
    """The sparse decode step's key masks, broadcastable to [B, h_kv, s_q, width] each: the exact
    region [B, 1, 1, E] (the first ``exact_len[b]`` valid), the slots [B, h_kv, 1, k*c] (a
    chunk valid where ``slot_chunks`` >= 0) and the generated tokens [B, 1, s_q, G] (token t
    sees the first ``gen_before[b] + t + 1``)."""
    device = slot_chunks.device
    exact = torch.arange(exact_width, device=device) < exact_len.view(-1, 1)
    slots = (slot_chunks >= 0).repeat_interleave(chunk_size, dim=-1)
    visible = gen_before.view(-1, 1) + torch.arange(1, s_q + 1, device=device)  # [B, s_q]
    gen = torch.arange(gen_width, device=device) < visible.unsqueeze(-1)
    return exact[:, None, None], slots.unsqueeze(2), gen.unsqueeze(1)


def decode_attention(q, rows, k_rows, v_rows, exact_width, exact_len, slot_chunks, chunk_size,
                     gen_before, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse decode step's attention over K/V rows where they lie (the CPU step's pages):
    q [B, s_q, h_q, d]; rows [N, d]; k_rows, v_rows int64 [B, h_kv, W], in order the exact
    region (``exact_width`` rows), the slots (k chunks of ``chunk_size`` rows) and the
    generated tokens, the step's own last, masked as ``decode_masks`` says.
    -> out [B, s_q, h_q, d] (q's dtype), lse [B, s_q, h_q] fp32, as ``attention_with_lse``.
    (Reference of native.decode_attention: one gather, the masks, one fused call.)"""
    batch, s_q = q.shape[:2]
    h_kv, width = k_rows.shape[1:]
    keys, values = (torch.index_select(rows, 0, ids.flatten()).view(*ids.shape, rows.shape[1])
                    for ids in (k_rows, v_rows))
    gen_width = width - exact_width - slot_chunks.shape[-1] * chunk_size
    masks = decode_masks(exact_width, exact_len, slot_chunks, chunk_size, gen_before, gen_width,
                         s_q)
    mask = torch.cat([m.expand(batch, h_kv, s_q, -1) for m in masks], dim=-1)
    return attention_with_lse(q, keys, values, mask, scale)


def paged_causal_attention_reference(
    query: torch.Tensor, kv: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``q`` positions of a sequence attend all its ``s`` tokens, causally, their keys
    and values in pages: query [q, Hq, d]; kv [num_blocks, slots_per_page, 2 (k, v), Hkv, d];
    blocks, slots [s] int64, where token t sits -> out [q, Hq, d], lse [Hkv, G, q] fp32.
    (Reference of triton_kernels/prefill_kernels.py: gathers the tokens and writes the scores.)"""
    q_len, h_q, _ = query.shape
    s_len, h_kv = blocks.shape[0], kv.shape[3]
    tokens = kv[blocks, slots].permute(1, 2, 0, 3)[:, None]  # [2, 1, Hkv, s, d]
    positions = torch.arange(s_len, device=query.device)
    causal = (positions <= positions[s_len - q_len:, None])[None, None]  # [1, 1, q, s]
    out, lse = attention_with_lse_reference(query.contiguous()[None], tokens[0], tokens[1],
                                            causal, scale)
    return out[0], lse[0].transpose(0, 1).reshape(h_kv, h_q // h_kv, q_len)


def varlen_causal_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor, max_q: int, max_k: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's varlen contract: sequences packed along the tokens, the ``q_i`` query
    rows of sequence i are its last positions and attend its ``s_i`` keys causally. query
    [Tq, Hq, d]; key, value [Tk, Hkv, d]; cu_seq_q, cu_seq_k int32 [N + 1] (offsets);
    max_q, max_k the longest q_i, s_i -> out [Tq, Hq, d], lse [Hq, Tq] fp32.
    (Reference of `varlen_causal_attention_flash`.)"""
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32, device=query.device)
    q_cut, k_cut = cu_seq_q.tolist(), cu_seq_k.tolist()
    for q_start, q_end, k_start, k_end in zip(q_cut, q_cut[1:], k_cut, k_cut[1:]):
        if q_end == q_start:
            continue
        assert q_end - q_start <= min(max_q, k_end - k_start) and k_end - k_start <= max_k
        positions = torch.arange(k_end - k_start, device=query.device)
        causal = positions <= positions[k_end - k_start - (q_end - q_start):, None]
        keys = key[k_start:k_end].transpose(0, 1)[None]
        values = value[k_start:k_end].transpose(0, 1)[None]
        o, l = attention_with_lse_reference(query[q_start:q_end][None], keys, values,
                                            causal[None, None], scale)
        out[q_start:q_end], lse[:, q_start:q_end] = o[0], l[0].transpose(0, 1)
    return out, lse


def varlen_causal_attention_flash(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale):
    """The same through FlashAttention's varlen kernel as torch ships it (CUDA): the aten op
    that ``torch.nn.attention.varlen.varlen_attn`` wraps, called directly, since the wrapper
    took GQA and the scale only lately (torch 2.13) and the op has had them for long. K/V stay
    at their KV heads; the LSE comes with the output; the causal mask is aligned bottom-right,
    so a later prefill chunk needs no mask."""
    out, lse = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, True, False, scale=scale)[:2]
    return out, lse


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def flash_varlen_supported(query: torch.Tensor) -> bool:
    """Whether FlashAttention's varlen kernel takes these inputs: CUDA with a torch built with
    it, sm80 or newer, 16-bit, head size a multiple of 8 up to 256."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256
            and _flash_capable(query.device))


def merge_attention(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets: out [.., d] and lse [..] per set."""
    out, lse = merge_stacked(torch.stack([o.float() for o in outs]), torch.stack(lses))
    return out.to(outs[0].dtype), lse


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_attention over the first dimension of outs [n, .., d] (fp32) and lses [n, ..]."""
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return (torch.exp(lses - safe).unsqueeze(-1) * outs).sum(dim=0), lse
