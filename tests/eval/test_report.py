"""Summaries, tables and merged reports from scored records (no engine)."""

import json

from vllm_shadowkv.eval import report, run, tasks


def _rec(backend, task, length, score, depth=0.5, decode=None, mode=None, hit=None,
         fidelity=None):
    r = {"backend": backend, "task": task, "length": length, "depth": depth, "seed": 0,
         "score": score, "decode_score": decode}
    if mode is not None:
        r.update(mode=mode, expected_sparse=True, hit_rate=hit, decode_steps=3, **(fidelity or {}))
    return r


RECORDS = [
    _rec("default", "niah_single", 4096, 1.0),
    _rec("default", "niah_multivalue", 4096, 1.0, decode=1.0),
    _rec("shadowkv@3%", "niah_single", 4096, 1.0, mode="sparse", hit=0.5,
         fidelity={"relative_error": 0.01, "chunk_recall": 0.75}),
    _rec("shadowkv@3%", "niah_multivalue", 4096, 0.5, decode=1 / 3, mode="sparse", hit=0.25,
         fidelity={"relative_error": 0.03, "chunk_recall": 0.25}),
]
ENGINES = [{"backend": "default", "length": None, "settings": {}, "requests": 2, "seconds": 1.0},
           {"backend": "shadowkv@3%", "length": 4096, "requests": 2, "seconds": 2.0,
            "settings": {"sparse_budget": 120, "outlier_chunks": 2}}]


def test_summary_has_decode_accuracy_and_sparse_modes():
    s = report.summarize(RECORDS)
    mv = [r for r in s["by_task"] if r["task"] == "niah_multivalue"]
    assert [(r["backend"], r["accuracy"], r["decode_samples"]) for r in mv] == [
        ("default", 100.0, 1), ("shadowkv@3%", 50.0, 1)]
    assert abs(mv[1]["decode_accuracy"] - 100 / 3) < 1e-9
    single = [r for r in s["by_task"] if r["task"] == "niah_single"]
    assert all(r["decode_accuracy"] is None and r["decode_samples"] == 0 for r in single)
    assert s["by_length"] == [{"backend": "shadowkv@3%", "length": 4096, "requests": 2,
                               "sparse": 2, "hit_rate": 0.375, "speculation_hit_rate": None,
                               "relative_error": 0.02, "chunk_recall": 0.5}]


def test_markdown_tables():
    md = report.markdown(report.summarize(RECORDS), ["default", "shadowkv@3%"], ENGINES)
    assert "| niah_multivalue | 4096 | 100.0 | 50.0 |" in md
    assert "| niah_multivalue | 4096 | 100.0 (1) | 33.3 (1) |" in md
    assert "| `shadowkv@3%` | 4096 | 120 | 2 | 2/2 | 0.38 | 0.0200 / 0.50 | 2.0 |" in md
    assert "| `default` | all |  |  |  |  |  | 1.0 |" in md


def test_fidelity_is_the_step_weighted_mean_over_layers():
    stats = {"fidelity": {0: {"relative_error": 0.1, "chunk_recall": 1.0, "steps": 1},
                          3: {"relative_error": 0.2, "chunk_recall": 0.5, "steps": 3}}}
    got = run.fidelity(stats)
    assert abs(got["relative_error"] - 0.175) < 1e-12 and abs(got["chunk_recall"] - 0.625) < 1e-12
    assert run.fidelity({"fidelity": {}}) == {} and run.fidelity(None) == {}


def test_merge_runs(tmp_path):
    for name, recs, engines in (("a", RECORDS[:2], ENGINES[:1]), ("b", RECORDS[2:], ENGINES[1:])):
        (tmp_path / name).mkdir()
        meta = {"backends": sorted({r["backend"] for r in recs}), "engines": engines}
        (tmp_path / name / "results.json").write_text(json.dumps({"meta": meta, "records": recs}))
    summary = report.merge(tmp_path / "m", [tmp_path / "a", tmp_path / "b"])
    assert summary == report.summarize(RECORDS)
    assert "| `shadowkv@3%` | 4096 | 120 | 2 | 2/2 |" in (tmp_path / "m" / "results.md").read_text()
    assert (tmp_path / "m" / "heatmap_shadowkv_3.png").stat().st_size > 0


def test_decode_score_skips_answers_of_the_first_token(word_tokenizer):
    s = tasks.generate("niah_multivalue", word_tokenizer, 512, 0.5, 0)
    ids = word_tokenizer(" " + " ".join(s.answers), add_special_tokens=False)["input_ids"]
    text = word_tokenizer.decode(ids)
    assert run.decode_score(word_tokenizer, s, ids, text) == 1.0
    partial = word_tokenizer.decode(ids[:2])  # first (prefill) answer + one decoded of three
    assert abs(run.decode_score(word_tokenizer, s, ids[:2], partial) - 1 / 3) < 1e-9
    single = tasks.generate("niah_single", word_tokenizer, 512, 0.5, 0)
    one = word_tokenizer(" " + single.answers[0], add_special_tokens=False)["input_ids"]
    assert run.decode_score(word_tokenizer, single, one, word_tokenizer.decode(one)) is None
    assert run.decode_score(word_tokenizer, single, None, "x") is None


def test_expected_sparse_follows_min_sparse_len():
    from vllm_shadowkv.eval.backends import parse

    spec = parse('shadowkv:{"min_sparse_len": 1024, "outlier_chunks": 2}')
    assert run.expected_sparse(spec, 1024) and not run.expected_sparse(spec, 1023)
    assert not run.expected_sparse(parse("shadowkv"), 2048)  # default min_sparse_len 4096


def test_not_sparse_flags_dense_or_never_decoded_requests():
    base = {"expected_sparse": True, "mode": "sparse", "output_token_ids": [5, 1], "decode_steps": 3}
    ok_first_token_only = {**base, "output_token_ids": [5], "decode_steps": 0}
    dense = {**base, "mode": "dense"}
    never = {**base, "decode_steps": 0}
    short = {**base, "expected_sparse": False, "mode": "dense"}
    default = {"output_token_ids": [5, 1]}
    records = [base, ok_first_token_only, dense, never, short, default]
    assert run.not_sparse(records) == [dense, never]
