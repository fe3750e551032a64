"""RULER-style long-context tasks, generated offline and deterministically for any tokenizer.

Families (RULER's names and templates, Hsieh et al. 2024):
  niah_single      one needle "One of the special magic numbers for KEY is: VALUE."
  niah_multikey    the same plus three distractor needles with other keys
  niah_multivalue  four needles with the same key and different values; all are asked for
  niah_multiquery  four needles with different keys; all four keys are asked for
  vt               variable tracking: a chain of assignments VAR X = 12345, VAR Y = VAR X, ...
  cwe              common-words extraction: the ten most frequent words of a long list

A harder family of our own, kept out of TASKS (RULER's set) so that every default run and
calibration set stays as it was; ``generate`` takes it like the others:
  niah_collide     niah_multivalue's four needles of one key, plus mention decoys: sentences
                   that name the asked key three times but give no number, one in every
                   DECOY_EVERY haystack sentences, and distractor needles (other keys with
                   values), one per DISTRACTOR_TOKENS tokens. A decoy's tokens match the query
                   as a key but hold no value, so full attention, which scores token by token,
                   still finds only the needles; a chunk mean (a ShadowKV landmark) over two or
                   three mentions scores above a needle chunk's mean over its one value token,
                   so the decoys collide with the needles in the landmarks and crowd them out
                   of a small top-k. The distractor needles' value tokens, like the needles',
                   stand out of their chunks, so they also compete for the outlier chunks.

``length`` is the prompt's length in tokens of the given tokenizer (special tokens included,
generation excluded); ``depth`` (0..1) places the first needle at that fraction of the
haystack, the other needles at seeded random places.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from vllm_shadowkv.eval import filler

NIAH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
TASKS = (*NIAH_TASKS, "vt", "cwe")
HARD_TASKS = ("niah_collide",)  # not RULER's: see the module docstring
NEEDLE_TASKS = (*NIAH_TASKS, *HARD_TASKS)  # tasks with a needle depth

NIAH_HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
NIAH_ANSWER = " The special magic numbers for {query} mentioned in the provided text are"
VT_HEADER = "Memorize and track the chain of variable assignment hidden in the following text.\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_ANSWER = (" Answer: According to the chain of variable assignment in the text above, "
             "{n} variables are assigned the value {value}, they are:")
CWE_HEADER = "Below is a numbered list of words. In these words, some appear more often than others.\n"
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
# niah_collide's decoys: the asked key three times, no number. Every word is a filler word or a
# word of the templates above, so the fixture model's vocabulary (built from those) covers them.
DECOYS = (
    "The special magic numbers for {key}, {key} and {key} are hidden in the following text.",
    "The {key}, the {key} and the {key} {verb} the {adj} {obj} {prep} the {place}.",
)
DECOY_EVERY = 24          # haystack sentences per decoy (about 250 tokens of the fixture's)
DISTRACTOR_TOKENS = 512   # context tokens per distractor needle (at least two)


@dataclass
class Sample:
    task: str
    length: int                 # requested prompt length in tokens
    depth: float | None         # requested depth of the first needle (None: not a needle task)
    seed: int
    prompt: str                 # what the user says: instructions, context and question
    answer_prefix: str          # appended after the prompt (or after the chat template)
    answers: list[str]          # every one must appear in the output (string_match_all)
    needles: list[str]          # the inserted needle sentences, first one at ``depth``


def generate(task: str, tokenizer, length: int, depth: float | None = 0.5, seed: int = 0) -> Sample:
    """One sample of ``task`` whose prompt is about ``length`` tokens of ``tokenizer``."""
    if task not in TASKS + HARD_TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS + HARD_TASKS)}")
    # A string seed: reproducible across processes (hash() of a tuple is salted).
    rng = random.Random(f"{task}/{length}/{depth}/{seed}")
    if task == "cwe":
        return _cwe(tokenizer, length, seed, rng)
    if task == "vt":
        return _vt(tokenizer, length, seed, rng)
    if task == "niah_collide":
        return _collide(tokenizer, length, depth if depth is not None else 0.5, seed, rng)
    return _niah(task, tokenizer, length, depth if depth is not None else 0.5, seed, rng)


def _niah(task, tokenizer, length, depth, seed, rng) -> Sample:
    n_keys = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 1, "niah_multiquery": 4}[task]
    n_values = 4 if task == "niah_multivalue" else 1
    keys = rng.sample(filler.KEYS, n_keys)
    values = rng.sample(filler.VALUES, n_keys * n_values)
    pairs = [(keys[i // n_values], v) for i, v in enumerate(values)]
    needles = [NEEDLE.format(key=k, value=v) for k, v in pairs]
    # multikey asks for the first key only: the other needles are distractors.
    asked = keys[:1] if task == "niah_multikey" else keys
    answers = [v for k, v in pairs if k in asked]
    query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    question, prefix = NIAH_QUESTION.format(query=query), NIAH_ANSWER.format(query=query)
    depths = [depth] + [rng.random() for _ in needles[1:]]
    prompt = _fit_haystack(tokenizer, length, NIAH_HEADER, question + prefix, needles, depths, rng)
    return Sample(task, length, depth, seed, prompt[: -len(prefix)], prefix, answers, needles)


def _collide(tokenizer, length, depth, seed, rng) -> Sample:
    key = rng.choice(filler.KEYS)
    values = rng.sample(filler.VALUES, 4)
    others_k = [k for k in filler.KEYS if k != key]
    others_v = [v for v in filler.VALUES if v not in values]
    n_distract = max(2, length // DISTRACTOR_TOKENS)
    pairs = [(key, v) for v in values]
    pairs += [(rng.choice(others_k), rng.choice(others_v)) for _ in range(n_distract)]
    needles = [NEEDLE.format(key=k, value=v) for k, v in pairs]
    question, prefix = NIAH_QUESTION.format(query=key), NIAH_ANSWER.format(query=key)
    depths = [depth] + [rng.random() for _ in needles[1:]]
    stream = _with_decoys(filler.sentences(rng), key, random.Random(rng.random()))
    prompt = _fit_haystack(tokenizer, length, NIAH_HEADER, question + prefix, needles, depths, rng,
                           stream)
    return Sample("niah_collide", length, depth, seed, prompt[: -len(prefix)], prefix, values, needles)


def _with_decoys(stream, key, rng):
    """``stream``'s sentences with every DECOY_EVERY-th (from a random phase) a mention decoy."""
    phase = rng.randrange(DECOY_EVERY)
    for i, sentence in enumerate(stream):
        if i % DECOY_EVERY == phase:
            yield rng.choice(DECOYS).format(
                key=key, verb=rng.choice(filler.VERBS), adj=rng.choice(filler.ADJECTIVES),
                obj=rng.choice(filler.OBJECTS), prep=rng.choice(filler.PREPOSITIONS),
                place=rng.choice(filler.PLACES))
        else:
            yield sentence


def _vt(tokenizer, length, seed, rng) -> Sample:
    names = rng.sample(filler.VARIABLES, 5)
    value = str(rng.randrange(10_000, 100_000))
    needles = [f"VAR {names[0]} = {value}."]
    needles += [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = sorted(rng.random() for _ in needles)  # the chain in reading order
    question = VT_QUESTION.format(value=value)
    prefix = VT_ANSWER.format(n=len(names), value=value)
    prompt = _fit_haystack(tokenizer, length, VT_HEADER, question + prefix, needles, depths, rng)
    return Sample("vt", length, None, seed, prompt[: -len(prefix)], prefix, names, needles)


def _cwe(tokenizer, length, seed, rng) -> Sample:
    pool = rng.sample(filler.filler_words(), len(filler.filler_words()))
    common, rare = pool[:10], pool[10:]
    order = rng.random()  # one shuffle seed for every candidate size: sizes differ, not draws

    def prompt_of(items: int) -> str:
        words = _cwe_words(common, rare, items, random.Random(order))
        return CWE_HEADER + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)) + CWE_QUESTION

    fits = lambda items: _count(tokenizer, prompt_of(items) + CWE_ANSWER) <= length  # noqa: E731
    lo, hi = 40, 40  # the largest list that fits, by doubling then bisection
    while fits(hi * 2):
        hi *= 2
    lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return Sample("cwe", length, None, seed, prompt_of(lo), CWE_ANSWER, common, [])


def _cwe_words(common, rare, items, rng) -> list[str]:
    """``items`` words where each common word is at least twice as frequent as any rare one."""
    n_common = 30
    while True:
        per_rare = max(1, math.ceil((items - 10 * n_common) / len(rare)))
        if n_common >= 2 * per_rare + 2 or items <= 10 * n_common:
            break
        n_common = 2 * per_rare + 2
    n_common = min(n_common, items // 10)
    words = [w for w in common for _ in range(n_common)]
    words += [rare[i % len(rare)] for i in range(items - len(words))]
    rng.shuffle(words)
    return words


def _count(tokenizer, text: str, special: bool = True) -> int:
    return len(tokenizer(text, add_special_tokens=special)["input_ids"])


def _fit_haystack(tokenizer, length, header, tail, needles, depths, rng, stream=None) -> str:
    """header + filler (``stream``'s sentences, default the filler grammar's) with ``needles``
    at ``depths`` + tail, about ``length`` tokens in all."""
    fixed = _count(tokenizer, header + " ".join(needles) + tail)
    budget = max(0, length - fixed)
    stream = filler.sentences(rng) if stream is None else stream
    sents, sizes = [], []
    while sum(sizes) < budget:
        batch = [next(stream) for _ in range(max(8, (budget - sum(sizes)) // 8))]
        counts = tokenizer([" " + s for s in batch], add_special_tokens=False)["input_ids"]
        for s, ids in zip(batch, counts):
            if sum(sizes) + len(ids) > budget:
                break
            sents.append(s)
            sizes.append(len(ids))
        else:
            continue
        break
    while True:  # tokens do not add up exactly across sentence joins: trim until it fits
        text = _assemble(header, sents, sizes, needles, depths, tail)
        excess = _count(tokenizer, text) - length
        if excess <= 0 or not sents:
            return text
        drop = 0
        while excess > 0 and drop < len(sents):
            excess -= sizes[-1 - drop]
            drop += 1
        sents, sizes = sents[:-drop], sizes[:-drop]


def _assemble(header, sents, sizes, needles, depths, tail) -> str:
    """Put each needle at the sentence boundary nearest its depth (in tokens of the haystack)."""
    total, cum = sum(sizes), [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    slots: dict[int, list[str]] = {}
    for needle, depth in zip(needles, depths):
        boundary = min(range(len(cum)), key=lambda i: abs(cum[i] - depth * total))
        slots.setdefault(boundary, []).append(needle)
    parts = []
    for i in range(len(sents) + 1):
        parts += slots.get(i, [])
        if i < len(sents):
            parts.append(sents[i])
    return header + " ".join(parts) + tail


# Scoring, as RULER's evaluate.py: case-insensitive substring match of each reference.
def string_match_all(prediction: str, answers: list[str]) -> float:
    """Fraction of the references found in the prediction (RULER: niah, vt, cwe)."""
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def score(sample: Sample, prediction: str) -> float:
    return string_match_all(prediction, sample.answers)
