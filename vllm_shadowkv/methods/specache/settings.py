"""The ``specache`` settings: the paper's defaults (§4.1; digest ../shared/spec/specache.md §7).

KIVI's group size serves keys (tokens per group, one scale and zero per channel) and values
(channels per group, one scale and zero per token) alike, as in the paper's size formula
(B + 32 / g) / 16. At 1 bit the quantizer is SpeCache's modified one (core/kivi.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from vllm_shadowkv.methods.base import EngineSettings, SettingsError, at_least, one_of
from vllm_shadowkv.methods.minikv.settings import EveryTokenQuantized
from vllm_shadowkv.methods.specache.guess import ACCEPTING_PROPOSER, PROPOSER

Prefetch = Literal["current", "speculative"]
PREFETCH_MODES = get_args(Prefetch)


@dataclass(frozen=True)
class SpeCacheSettings(EveryTokenQuantized, EngineSettings):
    method: ClassVar[str] = "specache"

    bits: int = 1
    """Bits per quantized key and value on the pages: 1 (the modified 1-bit KIVI) or 2. The
    default is the paper's headline configuration (1 bit, group 64: about 0.10x of the 16-bit
    KV at 32K, Table 3's throughput)."""
    group_size: int = 64
    """KIVI group: 32 or 64 (tokens per key group, channels per value group)."""
    residual: int = 64
    """Most recent tokens kept 16-bit on the pages before they are quantized together (a
    multiple of group_size)."""
    top_k: int = 64
    """Tokens per KV head and layer whose exact 16-bit K/V are fetched from the CPU store and
    attended in place of their low-bit copies; 0: plain KIVI, nothing fetched."""
    prefetch: Prefetch = "current"
    """"current": the output token's own attention over the low-bit keys picks the top-k, which
    are fetched, then attention again (one row per step, the fetch in line). "speculative" (the
    paper's default; not ours: on SmolLM2 at 1 bit it garbles the needle digits that "current"
    copies exactly unless ``verify_guess``, benchmarks/RESULTS.md): each decode step also runs
    the model's guess of the next token (vLLM's speculative decoding with one token, set up at
    start-up), whose attention picks the next step's top-k, fetched for the next step (on CUDA
    off the critical path); the output row attends those picked the step before."""
    accept_guess: bool = False
    """Speculative only: vLLM's own verification, which emits the guess row's token too when
    the output row's token equals the guess (two tokens that step). Its K/V are then written
    like any row's, and the step's slots are those its last row picks, fetched before the
    attention (nothing is picked ahead). Off: the guess only steers the prefetch and its K/V
    are never kept, as in the paper."""

    verify_guess: bool | Literal["miss"] = False
    """Speculative only. true: the output row still picks its own top-k at every step, and the
    tokens of it that the previous step's guess did not prefetch are fetched in line before
    the attention; the same attention as "current", with most of the fetch ahead of the step.
    "miss": the same, only at the steps whose guess was wrong (the output token is not the
    guess whose row picked the slots, so they were picked for another token); at the others
    the output row attends what the guess prefetched. false: it always attends what the guess
    prefetched, as in the paper."""
    pre_decode: bool = True
    """Speculative only: a compressed request's first decode step is the paper's pre-decoding
    (Alg. 2), one extra forward whose token is not emitted: its output row attends the low-bit
    cache alone, and its own top-k and argmax become what the guess row gives later steps (the
    rows prefetched for the first token, decoded again, and the first guess). Off: the first
    decode step's output row picks and fetches its own top-k in line, and the first guess is
    the placeholder (or the prompt lookup)."""
    guess_lookup: int = 3
    """Speculative only: after a wrong guess (and at the first decode step without
    ``pre_decode``), guess the token that followed the context's end where it occurred before,
    matched on at least this many tokens (prompt lookup, vLLM's n-gram matcher), instead of the
    guess row's prediction, which followed the wrong token; the guess row's when nothing
    matches. 0: always the guess row's (the paper)."""

    def check(self) -> None:
        super().check()  # (bits, group_size, residual: EveryTokenQuantized)
        at_least(self, "top_k", 0)
        at_least(self, "guess_lookup", 0)
        one_of(self, "prefetch", PREFETCH_MODES)
        if not isinstance(self.verify_guess, bool) and self.verify_guess != "miss":
            raise SettingsError(f"specache.verify_guess must be true or false or one of 'miss', "
                                f"got {self.verify_guess!r}")
        for name in ("accept_guess", "verify_guess"):
            if getattr(self, name) and self.prefetch != "speculative":
                raise SettingsError(f"specache.{name} needs prefetch 'speculative' (there is "
                                    f"no guess with prefetch {self.prefetch!r})")

    def speculative_config(self) -> dict | None:
        if self.prefetch != "speculative" or not self.top_k:
            return None  # no guess row: nothing to prefetch
        return {"method": "custom_class",
                "model": ACCEPTING_PROPOSER if self.accept_guess else PROPOSER,
                "num_speculative_tokens": 1}

