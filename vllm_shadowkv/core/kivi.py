"""KIVI low-bit KV quantization (MiniKV, TailorKV, SpeCache), in units of token groups.

A token group is `group` consecutive tokens of one KV head: the unit a compressed KV page holds.
Keys are quantized per channel across the group's tokens; values per token across channel
groups of `value_group` channels. Every tensor of `QuantizedGroups` leads with [n_groups, h_kv],
so the same layout serves as a pool indexed by group id:

    key_codes    [n, h_kv, G, d // per_word] int32    key_scale, key_zero     [n, h_kv, d]
    value_codes  [n, h_kv, G, d // per_word] int32    value_scale, value_zero [n, h_kv, G, d // vg]

(G = group, vg = value_group, per_word = 32 // bits codes per int32; scales in the cache dtype.)
Codes are packed along the channel axis for keys and values alike, so any group size packs
whole words (along tokens, 1-bit keys in groups of 16 would fill half a word); code i of a word
sits at bits [i*bits, (i+1)*bits).

Quantizer (KIVI): zero = min, scale = (max - min) / (2^bits - 1), code = round((x - zero) /
scale) clamped. At 1 bit the levels would be exactly min and max, which breaks generation
(SpeCache §3.4), so by default 1 bit uses SpeCache's modified quantizer: zero = (3 min + max) / 4,
scale = (max - min) / 2, i.e. the midpoints of the two half-ranges. TailorKV uses the plain one.
"""

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

SUPPORTED_BITS = (1, 2, 4)


@dataclass(frozen=True)
class KiviFormat:
    bits: int = 2
    group: int = 16  # tokens per key group = tokens per token group (page)
    head_dim: int = 128
    value_group: int = 16  # channels per value group
    midpoint_one_bit: bool = True  # SpeCache's 1-bit quantizer (TailorKV too); False: plain KIVI

    def __post_init__(self):
        assert self.bits in SUPPORTED_BITS, self.bits
        assert self.group > 0
        assert self.head_dim % self.codes_per_word == 0, "channels must fill whole words"
        assert self.head_dim % self.value_group == 0

    @property
    def codes_per_word(self) -> int:
        return 32 // self.bits

    @property
    def words_per_token(self) -> int:
        return self.head_dim // self.codes_per_word

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def group_bytes(self, scale_dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one token group of one KV head: codes, then scale + zero of K and V."""
        codes = 2 * self.group * self.words_per_token * 4
        key_params = 2 * self.head_dim
        value_params = 2 * self.group * (self.head_dim // self.value_group)
        return codes + (key_params + value_params) * scale_dtype.itemsize


class QuantizedGroups(NamedTuple):
    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., C] integers in [0, 2^bits) -> [..., C * bits // 32] int32."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    words = (codes.to(torch.int64).unflatten(-1, (-1, per_word)) << shifts).sum(dim=-1)
    # Two's complement: a word with its top bit set is a negative int32.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words [..., W] int32 -> codes [..., W * 32 // bits] int32 in [0, 2^bits)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _quantize(x: torch.Tensor, dim: int, fmt: KiviFormat):
    """Quantize x along dim -> (codes int32 shaped like x; scale, zero in x's dtype, reduced
    over dim). Codes come from the scale and zero as stored, so the dequantization error stays
    within half a step of the stored scale."""
    lo = x.amin(dim=dim).float()
    hi = x.amax(dim=dim).float()
    if fmt.bits == 1 and fmt.midpoint_one_bit:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    else:
        zero, scale = lo, (hi - lo) / fmt.max_code
    zero, scale = zero.to(x.dtype), scale.to(x.dtype)
    safe = torch.where(scale > 0, scale.float(), 1.0).unsqueeze(dim)
    codes = torch.round((x.float() - zero.float().unsqueeze(dim)) / safe).clamp(0, fmt.max_code)
    return codes.to(torch.int32), scale, zero


def quantize_groups(k: torch.Tensor, v: torch.Tensor, fmt: KiviFormat) -> QuantizedGroups:
    """k, v [n_groups * G, h_kv, d] (16-bit, consecutive tokens per group) -> QuantizedGroups."""
    tokens, h_kv, head_dim = k.shape
    assert v.shape == k.shape and head_dim == fmt.head_dim and tokens % fmt.group == 0
    n = tokens // fmt.group
    k = k.reshape(n, fmt.group, h_kv, head_dim).transpose(1, 2)  # [n, h, G, d]
    v = v.reshape(n, fmt.group, h_kv, head_dim).transpose(1, 2)
    key_codes, key_scale, key_zero = _quantize(k, 2, fmt)
    v = v.unflatten(-1, (-1, fmt.value_group))  # [n, h, G, d // vg, vg]
    value_codes, value_scale, value_zero = _quantize(v, 4, fmt)
    return QuantizedGroups(
        pack_codes(key_codes, fmt.bits), key_scale, key_zero,
        pack_codes(value_codes.flatten(-2), fmt.bits), value_scale, value_zero)


def dequantize_groups(
    q: QuantizedGroups, fmt: KiviFormat, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """QuantizedGroups -> k, v [n_groups * G, h_kv, d] in dtype (default: the scales' dtype).
    Dequantization is done in fp32, as the fused attention does."""
    dtype = dtype or q.key_scale.dtype
    value_codes = unpack_codes(q.value_codes, fmt.bits).float().unflatten(-1, (-1, fmt.value_group))
    v = value_codes * q.value_scale.float().unsqueeze(-1) + q.value_zero.float().unsqueeze(-1)
    return dequantize_keys(q, fmt, dtype), _token_major(v, fmt).to(dtype)


def dequantize_keys(
    q: QuantizedGroups, fmt: KiviFormat, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The keys alone (SpeCache scores every quantized token): k [n_groups * G, h_kv, d]."""
    key_codes = unpack_codes(q.key_codes, fmt.bits).float()  # [n, h, G, d]
    k = key_codes * q.key_scale.float().unsqueeze(2) + q.key_zero.float().unsqueeze(2)
    return _token_major(k, fmt).to(dtype or q.key_scale.dtype)


def dequantize_tokens(
    pool: QuantizedGroups, group_table: torch.Tensor, tokens: torch.Tensor, fmt: KiviFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single tokens of a pool of groups: tokens [B, h_kv, k] ids into request b's table
    entries (token t of entry j is j * G + t; -1: none, read as token 0), group_table [B, >=]
    pool ids -> k, v [B, h_kv, k, d] fp32. Each token is dequantized as a group of one: its own
    codes and value scales, its group's key scales."""
    batch, h_kv, k = tokens.shape
    ids = tokens.long().clamp_min(0)
    entry, row = ids // fmt.group, ids % fmt.group
    group = group_table.long().gather(1, entry.view(batch, -1)).view(batch, h_kv, k)
    group = group.clamp(0, pool.key_codes.shape[0] - 1)
    head = torch.arange(h_kv, device=tokens.device).view(1, -1, 1)
    one = QuantizedGroups(pool.key_codes[group, head, row].flatten(0, 2)[:, None, None],
                          pool.key_scale[group, head].flatten(0, 2)[:, None],
                          pool.key_zero[group, head].flatten(0, 2)[:, None],
                          pool.value_codes[group, head, row].flatten(0, 2)[:, None, None],
                          pool.value_scale[group, head, row].flatten(0, 2)[:, None, None],
                          pool.value_zero[group, head, row].flatten(0, 2)[:, None, None])
    keys, values = dequantize_groups(one, replace(fmt, group=1), torch.float32)  # [N, 1, d]
    return keys.view(batch, h_kv, k, -1), values.view(batch, h_kv, k, -1)


def _token_major(x: torch.Tensor, fmt: KiviFormat) -> torch.Tensor:
    """[n, h_kv, G, ...] with G * ... = G * d -> [n * G, h_kv, d]."""
    n, h_kv = x.shape[:2]
    return x.reshape(n, h_kv, fmt.group, fmt.head_dim).transpose(1, 2).reshape(-1, h_kv,
                                                                              fmt.head_dim)
