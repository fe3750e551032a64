"""H2O heavy hitters for MiniKV: cumulative attention per key, selection, per-layer budgets.

The score of key j is the attention the prompt's queries pay it, summed over query rows (H2O
column sums): sum_i exp(q_i . k_j * scale - LSE_i) under the causal mask, normalised per row
(MiniKV spec §10.1). Under GQA each KV head sums the scores of its group's query heads and
selects for itself, so K/V are never expanded to query heads (spec §10.3).

Chunked prefill: each chunk adds its queries' contributions to every key so far, so summing
chunk by chunk equals one whole-prompt pass; the [n, L] map of a long prompt is never
materialised. Where a bf16 chunk's attention ran in C (``csrc/prefill_attention.c``, on
AVX512-BF16 or AVX2) it gave each row's LSE, and a C kernel adds exp(logit - LSE) into the keys'
sums in one pass (``column_sums_lse`` in ``csrc/column_sums.c``). Where vLLM's kernel ran it (no LSE), on
a CPU with AMX tiles a C kernel takes bf16 chunks (``csrc/column_sums.c``: two passes of 16 x 16
tiles, 2.7-3.9x the GEMM tiles' speed). Elsewhere on the CPU (``gemm_column_sums``) a tile of
whole rows (a few query tokens of one KV head's group, all their keys) is one 16-bit GEMM whose
logits come out centred: an extra channel subtracts an estimate of each row's largest logit
inside the GEMM, so the bf16 output rounds each logit to 2^-9 of its distance from that
estimate, not of its size. The tile then normalises its rows itself. At Llama-3.1-8B shapes
they cost 1.2-1.5x vLLM's attention of the same chunks: MiniKV's prefill attention work
2.1-2.6x the default's, where torch's flash kernel with the LSE and a transposed flash pass for
the sums cost 4.4-5.3x (benchmarks/bench_heavy_hitters.py). On CUDA (and in "triton" kernel
mode) a Triton kernel takes them (triton_kernels/heavy_hitter_kernels.py) with the LSE the
engine's paged prefill kernel gives; the reference takes the logits in fp32 tiles of
QUERY_BLOCK x KEY_BLOCK: ``chunk_column_sums_reference``.
"""

import torch

QUERY_BLOCK = 256
KEY_BLOCK = 2048
PYRAMID_DEPTH = 7


def _tiles(qg: torch.Tensor, k: torch.Tensor, q_start: int, scale: float):
    """Yield (key offset, causally masked logits [h_kv, G, n', c]) over the keys up to the
    block's last query. qg [h_kv, G, n', d] fp32, queries at positions [q_start, q_start + n')."""
    q_pos = torch.arange(q_start, q_start + qg.shape[2], device=k.device)
    for j0 in range(0, q_start + qg.shape[2], KEY_BLOCK):
        kb = k[j0:j0 + KEY_BLOCK].float().permute(1, 2, 0)  # [h_kv, d, c]
        logits = torch.matmul(qg, kb.unsqueeze(1)) * scale
        causal = torch.arange(j0, j0 + kb.shape[-1], device=k.device) <= q_pos.view(-1, 1)
        yield j0, logits.masked_fill(~causal, float("-inf"))


def accumulate_column_sums(
    col_sums: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, scale: float,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add one prefill chunk's column sums.

    col_sums [h_kv, start] fp32 from the earlier chunks (None for the first); q [n, h_q, d] the
    chunk's queries at positions [start, start + n); k [start + n, h_kv, d] all keys so far;
    lse [h_kv, G, n] fp32 the chunk's causal attention LSE per query row, if the caller has
    it (the Triton kernel uses it; the CPU's GEMM tiles normalise their rows themselves).
    -> [h_kv, start + n] fp32.
    """
    from . import ops  # (imported here: ops dispatches to this module's implementations)

    start = k.shape[0] - q.shape[0]
    chunk = ops.column_sums(q, k, scale, lse)
    if col_sums is not None:
        assert col_sums.shape == (k.shape[1], start)
        chunk[:, :start] += col_sums
    return chunk


def chunk_column_sums_reference(q: torch.Tensor, k: torch.Tensor, scale: float,
                                lse: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk's contribution to every key's column sum: q [n, h_q, d] at positions
    [start, start + n), k [start + n, h_kv, d], lse [h_kv, G, n] or None -> [h_kv, start + n]
    fp32, in fp32 tiles (a first pass over them for the rows' LSE when it is not given)."""
    n, h_q, head_dim = q.shape
    length, h_kv, _ = k.shape
    start = length - n
    total = torch.zeros(h_kv, length, dtype=torch.float32, device=q.device)
    for i0 in range(0, n, QUERY_BLOCK):
        qb = q[i0:i0 + QUERY_BLOCK].float()
        qg = qb.reshape(-1, h_kv, h_q // h_kv, head_dim).permute(1, 2, 0, 3)  # [h_kv, G, n', d]
        row_lse = (lse[..., i0:i0 + QUERY_BLOCK].float() if lse is not None else
                   torch.stack([torch.logsumexp(logits, dim=-1) for _, logits
                                in _tiles(qg, k, start + i0, scale)]).logsumexp(dim=0))
        for j0, logits in _tiles(qg, k, start + i0, scale):
            probs = torch.exp(logits - row_lse.unsqueeze(-1))  # [h_kv, G, n', c]
            total[:, j0:j0 + probs.shape[-1]] += probs.sum(dim=(1, 2))
    return total


TILE_BYTES = 8 << 20  # one GEMM tile's 16-bit logits: a few tokens' rows x all their keys
RECENTRE_ABOVE = 2.0  # a row whose largest logit (scaled) exceeds its estimate by more: redone
# Each row's centring estimate: its largest logit over the first keys and its recent window.
# On SmolLM2 (3K-token prompt) it falls short of the row's maximum by at most 1.8 (scaled) in
# 99 % of rows; the first key and the row's own, by 4.4 (and 98 % of the tiles were redone).
SAMPLE_FIRST, SAMPLE_RECENT = 16, 64
RECENT_BLOCK = 128  # tokens per GEMM of the recent windows


def column_sum_tile(logits: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's column sums. logits [rows, keys]: q_i . k_j - m_i (m_i an estimate of row
    i's largest; -inf where the key is not visible) -> (the rows' softmax summed over the rows
    [keys] fp32, each row's largest scaled centred logit [rows]: how far its estimate fell
    short). Compiled in cpu_kernels."""
    x = logits.float() * scale
    top = x.amax(dim=1, keepdim=True)
    p = torch.exp(x - top)
    return (p / p.sum(dim=1, keepdim=True)).sum(dim=0), top.squeeze(1)


def _estimated_maxima(queries: torch.Tensor, keys: torch.Tensor, start: int) -> torch.Tensor:
    """Each query row's largest logit over its SAMPLE_FIRST first and SAMPLE_RECENT latest keys
    (unscaled): queries [n, G, d] at positions [start, start + n), keys [start + n, d] -> [n, G].
    The recent windows come from one GEMM per RECENT_BLOCK tokens against the keys their
    windows span, the band read in place: a GEMM per token over its own window (a copy of 64
    keys per token, and 4-row GEMMs) took a third of the column sums' time (2026-11-28)."""
    n, group, head_dim = queries.shape
    positions = torch.arange(start, start + n, device=keys.device).unsqueeze(1)
    first = keys[:SAMPLE_FIRST]
    unseen = torch.arange(len(first), device=keys.device) > positions  # [n, first]
    from_first = (queries.reshape(-1, head_dim) @ first.T).view(n, group, -1)
    from_first = from_first.masked_fill(unseen.unsqueeze(1), float("-inf")).amax(-1)
    # Token i's window ends at its own key: padded[start + i, + SAMPLE_RECENT), the keys padded
    # in front with copies of the first (visible to every row) and behind to whole blocks.
    blocks, width = -(-n // RECENT_BLOCK), RECENT_BLOCK + SAMPLE_RECENT - 1
    tail = blocks * RECENT_BLOCK - n
    padded = torch.cat([keys[:1].expand(SAMPLE_RECENT - 1, -1), keys,
                        keys.new_zeros(tail, head_dim)])
    spans = padded.as_strided((blocks, width, head_dim), (RECENT_BLOCK * head_dim, head_dim, 1),
                              start * head_dim)
    rows = torch.cat([queries, queries.new_zeros(tail, group, head_dim)]).view(blocks, -1, head_dim)
    logits = torch.bmm(rows, spans.transpose(1, 2))  # [blocks, RECENT_BLOCK * G, width]
    # Row (token t of its block, g) reads its band logits[t, g, t:t + SAMPLE_RECENT].
    band = logits.as_strided((blocks, RECENT_BLOCK, group, SAMPLE_RECENT),
                             (RECENT_BLOCK * group * width, group * width + 1, width, 1))
    return torch.maximum(from_first, band.amax(-1).flatten(0, 1)[:n])


def _causal_logits(rows: torch.Tensor, keys: torch.Tensor, future: torch.Tensor
                   ) -> torch.Tensor:
    """rows @ keys.T, the last ``future.shape[1]`` keys (the tile's own tokens) at -inf where
    ``future`` [rows, own] says the row's token comes before them."""
    logits = rows @ keys.T
    logits[:, len(keys) - future.shape[1]:].masked_fill_(future, float("-inf"))
    return logits


def gemm_column_sums(q: torch.Tensor, k: torch.Tensor, scale: float, tile=column_sum_tile
                     ) -> torch.Tensor:
    """``chunk_column_sums_reference`` (without the LSE: each tile holds whole rows and
    normalises them) in one GEMM per tile, in bf16 where q and k are (fp32 otherwise: CPUs
    without native fp16 GEMMs run them 20x slower). Each row's logits are centred in the GEMM
    by a last channel: -m_i against a key channel of ones, m_i ``_estimated_maxima``; the rows
    whose largest logit lies more than RECENTRE_ABOVE from it are done again, centred on the
    maxima found."""
    n, h_q, head_dim = q.shape
    length, h_kv, _ = k.shape
    group, start = h_q // h_kv, length - n
    dtype = torch.bfloat16 if q.dtype == k.dtype == torch.bfloat16 else torch.float32
    tokens = max(1, TILE_BYTES // (group * length * 2))
    total = torch.zeros(h_kv, length, device=q.device)
    row_positions = torch.arange(start, length, device=q.device).repeat_interleave(group)
    for h in range(h_kv):
        keys = k.new_ones(length, head_dim + 1, dtype=dtype)
        keys[:, :head_dim] = k[:, h]
        queries = q[:, h * group:(h + 1) * group].to(dtype)  # [n, G, d]
        rows = torch.cat([queries, -_estimated_maxima(queries, keys[:, :head_dim], start)
                          .unsqueeze(-1).to(dtype)], dim=-1).flatten(0, 1)  # token-major
        for i0 in range(0, n, tokens):
            i1 = min(n, i0 + tokens)
            block, visible = rows[i0 * group:i1 * group], keys[:start + i1]
            own = torch.arange(start + i0, start + i1, device=q.device)
            future = own > row_positions[i0 * group:i1 * group].unsqueeze(1)
            logits = _causal_logits(block, visible, future)
            sums, top = tile(logits, scale)
            short = (top.abs() > RECENTRE_ABOVE).nonzero().squeeze(1)
            if len(short):  # those rows again: out with their first sums, in with the new
                again = block[short]
                again[:, head_dim] -= top[short] / scale
                sums -= tile(logits[short], scale)[0]
                sums += tile(_causal_logits(again, visible, future[short]), scale)[0]
            total[h, :start + i1] += sums
    return total


def select_heavy_hitters(
    col_sums: torch.Tensor, prompt_len: int, heavy: int, recent: int, pool: int = 1
) -> torch.Tensor:
    """Kept prompt positions per KV head, [h_kv, heavy + recent] int64, ascending.

    col_sums [h_kv, >= prompt_len]. The recent window is the last `recent` tokens; the heavy
    hitters are the top-`heavy` scores among the tokens before it, a token's score being the
    largest column sum within pool // 2 positions of it (pool 1: its own). When heavy + recent
    covers the prompt every token is kept ([h_kv, prompt_len]).
    """
    h_kv = col_sums.shape[0]
    device = col_sums.device
    if heavy + recent >= prompt_len:
        return torch.arange(prompt_len, device=device).expand(h_kv, -1).clone()
    before = prompt_len - recent
    scores = col_sums[:, :prompt_len]
    if pool > 1:
        # A heavy token brings its neighbours (SnapKV's pooling): the digits of a number
        # after the token the prompt attends are kept with it.
        scores = torch.nn.functional.max_pool1d(scores.unsqueeze(1), pool, stride=1,
                                                padding=pool // 2).squeeze(1)
    top = torch.topk(scores[:, :before], heavy, dim=-1).indices
    window = torch.arange(before, prompt_len, device=device).expand(h_kv, -1)
    return torch.cat([top.sort(dim=-1).values, window], dim=-1)


def layer_budgets(
    num_layers: int, ratio: float, policy: str = "pyramid", depth: int = PYRAMID_DEPTH
) -> list[float]:
    """Per-layer heavy-hitter budgets (fractions of the prompt) whose mean is `ratio`.

    "uniform": ratio everywhere. "pyramid" (MiniKV §5, the authors' code and rationale rather
    than the text): linear in the layer index from 2x - x/depth at layer 0 down to x/depth at
    the last layer, since lower layers attend more diffusely.
    """
    assert policy in ("pyramid", "uniform"), policy
    if policy == "uniform" or num_layers == 1:
        return [ratio] * num_layers
    top, bottom = 2 * ratio - ratio / depth, ratio / depth
    step = (top - bottom) / (num_layers - 1)
    return [top - layer * step for layer in range(num_layers)]
