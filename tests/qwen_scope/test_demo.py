"""``qwen-scope demo``: the offline tour on the nano model writes a store, a feature database, a dashboard and a
report whose numbers agree with the public API."""
from __future__ import annotations

import json

import pytest
import torch

from qwen_scope.commands.demo import read_corpus
from qwen_scope.demo import DemoConfig, run_demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    torch.set_num_threads(1)
    lines: list[str] = []
    out = tmp_path_factory.mktemp("demo")
    result = run_demo(DemoConfig(out_dir=out, tokens=3000, n_features=3, max_new_tokens=12), echo=lines.append)
    return result, lines


def test_demo_writes_store_database_and_report(demo):
    result, lines = demo
    from qwen_scope.store import ActivationStore

    store = ActivationStore(result.store)
    assert store.n_tokens == 3000
    assert (result.out_dir / "report.txt").read_text().startswith("Sample text")
    summary = json.loads((result.out_dir / "summary.json").read_text())
    assert summary["layer"] == 3 and len(summary["top_features"]) == 3
    assert [line[:5] for line in lines[:5]] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"]
    html = result.dashboard.read_text()
    assert all(str(f["feature"]) in html for f in summary["top_features"])


def test_demo_report_agrees_with_the_public_api(demo):
    result, _ = demo
    from qwen_scope.explore import FeatureDatabase
    from qwen_scope.nano import nano_scope

    scope = nano_scope([3])
    top = scope.features(DemoConfig().text, layers=3).top(3, 3)
    assert [f["feature"] for f in result.top_features] == [s.feature for s in top]
    db = FeatureDatabase.load(result.database)
    for f in result.top_features:
        assert f["max"] == pytest.approx(next(s.max for s in top if s.feature == f["feature"]), rel=1e-4)
        assert f["logit_lens"], "every reported feature has printable logit-lens tokens"
        assert len(f["examples"]) == min(3, len(db.top_examples(f["feature"])))


def test_demo_steering_changes_the_continuation(demo):
    result, _ = demo
    steer = result.steering
    assert steer["strength"] > 0 and steer["baseline"] != steer["steered"]


def test_demo_refuses_a_model_without_a_release(tmp_path):
    with pytest.raises(ValueError, match="needs --release"):
        run_demo(DemoConfig(out_dir=tmp_path, model="some/model"))


def test_read_corpus_accepts_jsonl_and_text_and_names_bad_files(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "a b"}\n{"text": "c"}\n')
    assert read_corpus(str(jsonl)) == ("a b", "c")
    txt = tmp_path / "c.txt"
    txt.write_text("first doc\n\nsecond doc\n")
    assert read_corpus(str(txt)) == ("first doc", "second doc\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": 1}\n')
    with pytest.raises(SystemExit, match="'text' field"):
        read_corpus(str(bad))
    with pytest.raises(SystemExit, match="no such file"):
        read_corpus(str(tmp_path / "missing.txt"))
