"""Task generators and scoring: deterministic, the needle where asked, the answer nowhere else,
the length asked for, in tokens of two different tokenizers."""

import re
from collections import Counter

import pytest

from vllm_shadowkv.eval import filler, tasks


def _count(tok, text, special=True):
    return len(tok(text, add_special_tokens=special)["input_ids"])


@pytest.mark.parametrize("task", tasks.TASKS)
def test_same_seed_same_sample_other_seed_other_sample(byte_tokenizer, task):
    a = tasks.generate(task, byte_tokenizer, 1024, 0.3, seed=7)
    b = tasks.generate(task, byte_tokenizer, 1024, 0.3, seed=7)
    c = tasks.generate(task, byte_tokenizer, 1024, 0.3, seed=8)
    assert a == b
    assert (a.prompt, a.answers) != (c.prompt, c.answers)


@pytest.mark.parametrize("task", tasks.TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_length_within_tolerance(tokenizer, task, length):
    s = tasks.generate(task, tokenizer, length, 0.5, seed=1)
    n = _count(tokenizer, s.prompt + s.answer_prefix)
    # Never longer than asked; shorter by at most about a sentence (or a list item run).
    assert length - max(64, 0.03 * length) <= n <= length


@pytest.mark.parametrize("task", tasks.NIAH_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_first_needle_at_requested_depth(tokenizer, task, depth):
    s = tasks.generate(task, tokenizer, 2048, depth, seed=3)
    header = _count(tokenizer, tasks.NIAH_HEADER)
    context_end = s.prompt.rindex(tasks.NIAH_QUESTION.split("{")[0])
    # Needles other than the first sit elsewhere: measure the haystack without them.
    before = s.prompt[: s.prompt.index(s.needles[0])]
    others_before = sum(_count(tokenizer, " " + n, False) for n in s.needles[1:] if n in before)
    others_all = sum(_count(tokenizer, " " + n, False) for n in s.needles[1:])
    first = _count(tokenizer, s.needles[0], False)
    haystack = _count(tokenizer, s.prompt[:context_end]) - header - others_all - first
    position = _count(tokenizer, before) - header - others_before
    assert abs(position / haystack - depth) <= 0.03


@pytest.mark.parametrize("task", tasks.TASKS)
def test_answers_only_inside_needles(byte_tokenizer, task):
    for seed in range(3):
        s = tasks.generate(task, byte_tokenizer, 1024, 0.5, seed)
        rest = s.prompt
        for needle in s.needles:
            assert needle in rest
            rest = rest.replace(needle, " ", 1)
        if task == "cwe":  # the answer is a property of the whole list, not a needle
            continue
        for answer in s.answers:
            assert answer not in rest and answer not in s.answer_prefix
            assert any(answer in needle for needle in s.needles)


def test_task_shapes(byte_tokenizer):
    one = lambda t: tasks.generate(t, byte_tokenizer, 1024, 0.5, 0)  # noqa: E731
    assert (len(one("niah_single").answers), len(one("niah_single").needles)) == (1, 1)
    assert (len(one("niah_multikey").answers), len(one("niah_multikey").needles)) == (1, 4)
    assert (len(one("niah_multivalue").answers), len(one("niah_multivalue").needles)) == (4, 4)
    assert (len(one("niah_multiquery").answers), len(one("niah_multiquery").needles)) == (4, 4)
    vt = one("vt")
    assert len(vt.answers) == 5 and vt.needles[1] == f"VAR {vt.answers[1]} = VAR {vt.answers[0]}."
    cwe = one("cwe")
    words = re.findall(r"\d+\. (\w+)", cwe.prompt)
    counts = Counter(words)
    assert min(counts[w] for w in cwe.answers) > max(
        c for w, c in counts.items() if w not in cwe.answers)


def test_pools_are_disjoint():
    words = set(filler.filler_words())
    assert not words & set(filler.KEYS)
    assert not words & set(filler.VALUES)
    assert filler.QUESTION_MARKER not in words and filler.QUESTION_MARKER not in filler.KEYS
    assert len(set(filler.KEYS)) == len(filler.KEYS) and len(set(filler.VALUES)) == len(filler.VALUES)


def test_string_match_all_and_part():
    answers = ["1234567", "7654321"]
    assert tasks.string_match_all("They are 1234567 and 7654321.", answers) == 1.0
    assert tasks.string_match_all("Only 7654321 here", answers) == 0.5
    assert tasks.string_match_all("none", answers) == 0.0
    assert tasks.string_match_all("Walrus, OTTER", ["walrus", "otter"]) == 1.0  # case-insensitive
    assert tasks.string_match_part("Only 7654321 here", answers) == 1.0
    assert tasks.string_match_part("none", answers) == 0.0
