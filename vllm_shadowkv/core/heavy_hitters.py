"""H2O heavy hitters for MiniKV: cumulative attention per key, selection, per-layer budgets.

The score of key j is the attention the prompt's queries pay it, summed over query rows (H2O
column sums): sum_i exp(q_i . k_j * scale - LSE_i) under the causal mask, normalised per row
(MiniKV spec §10.1). Under GQA each KV head sums the scores of its group's query heads and
selects for itself, so K/V are never expanded to query heads (spec §10.3).

Chunked prefill: each chunk adds its queries' contributions to every key so far, so summing
chunk by chunk equals one whole-prompt pass; the [n, L] map of a long prompt is never
materialised. The rows' LSE comes from the prefill's own exact attention where the engine has it
(``lse``; on the CPU torch's flash kernel gives it), else from a pass of its own. On the CPU the
column sums are then the LSE of the transposed attention through the same flash kernel, in the
inputs' dtype: each key asks the chunk's query rows, and each row carries its own -LSE in three
extra channels (a 16-bit high, middle and low part: exact to fp32 rounding). About the exact
attention's time again (benchmarks/bench_heavy_hitters.py). On CUDA (and in "triton" kernel mode)
a Triton kernel takes them (triton_kernels/heavy_hitter_kernels.py); the reference takes the
logits in fp32 tiles of QUERY_BLOCK x KEY_BLOCK: ``chunk_column_sums_reference``.
"""

import torch

from .attention import causal_attention_cpu

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

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
    it (else computed here). -> [h_kv, start + n] fp32.
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


LSE_CHANNELS = 3  # -LSE / scale as a sum of three 16-bit parts: fp32's 24 bits of mantissa


def _chunk_column_sums_cpu(q: torch.Tensor, k: torch.Tensor, scale: float,
                           lse: torch.Tensor | None = None) -> torch.Tensor:
    """``chunk_column_sums_reference`` through the flash kernel. sum_i exp(s q_i.k_j - lse_i)
    is the exp of the LSE of an attention in which key j is the query and row i the key, both
    widened by the -LSE channels ([k_j, 1, 1, 1] . [q_i, x_i, ...] with x_i = -lse_i / s split
    into 16-bit parts), in the inputs' dtype with the kernel's fp32 accumulation (fp32 copies of
    Q and K cost as much again). Prefix keys see every row; a chunk key sees the rows at or
    after it, which is causal once both sequences are reversed."""
    n, h_q, head_dim = q.shape
    length, h_kv, _ = k.shape
    group, start = h_q // h_kv, length - n
    if lse is None:
        _, lse = causal_attention_cpu(q, k, k, scale)  # [h_kv, G, n]; the values do not matter
    dtype = q.dtype if q.dtype == k.dtype else torch.float32
    width = -(-(head_dim + LSE_CHANNELS) // 16) * 16  # the extra channels, padded with zeros
    keys = q.new_zeros(1, h_kv, length, width, dtype=dtype)
    keys[..., :head_dim] = k.transpose(0, 1)
    keys[..., head_dim:head_dim + LSE_CHANNELS] = 1.0
    chunk_keys = keys[:, :, start:].flip(2)
    rows = q.transpose(0, 1).unflatten(0, (h_kv, group))  # [h_kv, G, n, d]
    total = torch.full((h_kv, length), float("-inf"), device=q.device)
    for g in range(group):
        row_keys = q.new_zeros(1, h_kv, n, width, dtype=dtype)
        row_keys[..., :head_dim] = rows[:, g]
        rest = -lse[:, g].float() / scale
        for c in range(head_dim, head_dim + LSE_CHANNELS):
            row_keys[..., c] = rest
            rest = rest - row_keys[..., c].float()
        if start:
            prefix = _flash_cpu(keys[:, :, :start], row_keys, row_keys, 0.0, False,
                                scale=scale)[1][0]
            total[:, :start] = torch.logaddexp(total[:, :start], prefix)
        reversed_rows = row_keys.flip(2)
        own = _flash_cpu(chunk_keys, reversed_rows, reversed_rows, 0.0, True, scale=scale)[1][0]
        total[:, start:] = torch.logaddexp(total[:, start:], own.flip(-1))
    return total.exp()


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
