"""``qwen-scope classify`` on the nano model: fit from seed files, filter a jsonl corpus into kept / rejected rows
that agree with the rule applied in Python, reload the saved rule; a missing rule says what to pass."""
from __future__ import annotations

import json

import torch

from qwen_scope import FeatureClassifier, nano_scope
from qwen_scope.cli import main
from tests.qwen_scope.scope_helpers import corpus_windows


def test_classify_fits_filters_and_reloads(tmp_path, capsys):
    code, prose = corpus_windows()
    (tmp_path / "pos.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code[:4]))
    (tmp_path / "neg.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in prose[:4]))
    corpus = code[4:10] + prose[4:10]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                                   for i, t in enumerate(corpus)))
    out = tmp_path / "out"
    assert main(["classify", str(tmp_path / "corpus.jsonl"), "--positives", str(tmp_path / "pos.jsonl"),
                 "--negatives", str(tmp_path / "neg.jsonl"), "--layers", "3", "--out", str(out),
                 "--batch-size", "5", "--no-progress"]) == 0
    kept = [json.loads(line) for line in (out / "kept.jsonl").read_text().splitlines()]
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert len(kept) + len(rejected) == 12 and f"kept {len(kept)}" in capsys.readouterr().out
    clf = FeatureClassifier.from_json((out / "rule.json").read_text(), nano_scope([3]))
    fired = clf.predict(corpus)
    assert sorted(r["id"] for r in kept) == torch.nonzero(fired).flatten().tolist()
    assert all(len(r["_scores"]) == len(clf.rules) for r in kept + rejected)
    again = tmp_path / "again"
    assert main(["classify", str(tmp_path / "corpus.jsonl"), "--rule", str(out / "rule.json"), "--out", str(again),
                 "--no-progress"]) == 0
    assert (again / "kept.jsonl").read_text() == (out / "kept.jsonl").read_text()


def test_classify_without_a_rule_says_what_to_pass(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"text": "x"}\n')
    assert main(["classify", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "pass --rule rule.json, or both --positives and --negatives" in capsys.readouterr().err
