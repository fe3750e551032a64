"""Task generators and scoring: deterministic, the needle where asked, the answer nowhere else,
the length asked for, in tokens of two different tokenizers."""

import re
from collections import Counter

import pytest

from vllm_shadowkv.eval import filler, tasks


def _count(tok, text, special=True):
    return len(tok(text, add_special_tokens=special)["input_ids"])


@pytest.mark.parametrize("task", tasks.TASKS + tasks.HARD_TASKS)
def test_same_seed_same_sample_other_seed_other_sample(byte_tokenizer, task):
    a = tasks.generate(task, byte_tokenizer, 1024, 0.3, seed=7)
    b = tasks.generate(task, byte_tokenizer, 1024, 0.3, seed=7)
    c = tasks.generate(task, byte_tokenizer, 1024, 0.3, seed=8)
    assert a == b
    assert (a.prompt, a.answers) != (c.prompt, c.answers)


@pytest.mark.parametrize("task", tasks.TASKS + tasks.HARD_TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_length_within_tolerance(tokenizer, task, length):
    s = tasks.generate(task, tokenizer, length, 0.5, seed=1)
    n = _count(tokenizer, s.prompt + s.answer_prefix)
    # Never longer than asked; shorter by at most about a sentence (or a list item run).
    assert length - max(64, 0.03 * length) <= n <= length


@pytest.mark.parametrize("task", tasks.NEEDLE_TASKS)
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


@pytest.mark.parametrize("task", tasks.TASKS + tasks.HARD_TASKS)
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


def test_collide_decoys_name_the_key_and_give_no_number(word_tokenizer):
    """niah_collide: four needles of the asked key, distractor needles of other keys, and one
    mention decoy (the asked key three times) per DECOY_EVERY haystack sentences. In the fixture
    model's tokens a value follows a key at offset 3 (the relation its retrieval head reads)
    only inside the needles, and the asked key's only there for the answers."""
    for length, seed in ((1024, 0), (4096, 1), (8192, 2)):
        s = tasks.generate("niah_collide", word_tokenizer, length, 0.5, seed)
        key = s.answer_prefix.split(" for ")[1].split()[0]
        assert len(s.answers) == 4 and len(s.needles) == 4 + max(2, length // tasks.DISTRACTOR_TOKENS)
        assert all(f"for {key} is: {v}." in s.needles[i] for i, v in enumerate(s.answers))
        assert all(key not in n for n in s.needles[4:])
        assert not set(s.answers) & {n.split()[-1].rstrip(".") for n in s.needles[4:]}
        haystack = s.prompt[len(tasks.NIAH_HEADER):s.prompt.rindex("\nWhat")]
        for n in s.needles:
            haystack = haystack.replace(n, " ", 1)
        sentences = haystack.count(".")
        decoys = haystack.count(f"{key},")
        assert decoys * tasks.DECOY_EVERY <= sentences + tasks.DECOY_EVERY
        assert decoys * tasks.DECOY_EVERY >= sentences - tasks.DECOY_EVERY
        assert haystack.count(key) == 3 * decoys and decoys >= length // 400
        ids = word_tokenizer(s.prompt + s.answer_prefix)["input_ids"]
        assert word_tokenizer.unk_token_id not in ids  # the fixture's vocabulary covers it
        words = word_tokenizer.convert_ids_to_tokens(ids)
        pairs = [(words[i - 3], w) for i, w in enumerate(words) if w in filler.VALUES]
        assert len(pairs) == len(s.needles) and all(k in filler.KEYS for k, _ in pairs)
        assert sorted(v for k, v in pairs if k == key) == sorted(s.answers)


def test_hard_tasks_are_not_in_rulers_set():
    # Default runs, benchmarks and calibration sets iterate TASKS / NIAH_TASKS: unchanged.
    assert not set(tasks.HARD_TASKS) & set(tasks.TASKS)
    assert tasks.NEEDLE_TASKS == (*tasks.NIAH_TASKS, *tasks.HARD_TASKS)
    with pytest.raises(ValueError, match="niah_collide"):
        tasks.generate("nope", None, 1024)


def test_pools_are_disjoint():
    words = set(filler.filler_words())
    assert not words & set(filler.KEYS)
    assert not words & set(filler.VALUES)
    assert filler.QUESTION_MARKER not in words and filler.QUESTION_MARKER not in filler.KEYS
    assert len(set(filler.KEYS)) == len(filler.KEYS) and len(set(filler.VALUES)) == len(filler.VALUES)


def test_string_match_all():
    answers = ["1234567", "7654321"]
    assert tasks.string_match_all("They are 1234567 and 7654321.", answers) == 1.0
    assert tasks.string_match_all("Only 7654321 here", answers) == 0.5
    assert tasks.string_match_all("none", answers) == 0.0
    assert tasks.string_match_all("Walrus, OTTER", ["walrus", "otter"]) == 1.0  # case-insensitive
