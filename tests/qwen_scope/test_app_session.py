"""The explorer's session on the nano model: prompt view, token features, cards (database and live), search, compare,
evaluation table — values checked against the verbs they wrap."""
from __future__ import annotations

import functools

import pytest
import torch

from qwen_scope.app import AppSession
from qwen_scope.explore.builder import Chunk, build_feature_database

TEXT = "def close(self):\n    return self.file"


@functools.lru_cache(maxsize=None)
def _scope():
    from qwen_scope import nano_scope

    return nano_scope([2, 3])


def _database(scope, layer: int = 3):
    """A feature database of a few corpus documents at ``layer``, one feature labelled."""
    from qwen_scope import nano_corpus

    chunks, start = [], 0
    for d, text in enumerate(nano_corpus(4)):
        feats = scope.features(text[:300], layers=[layer])
        T = len(feats.tokens)
        lf = feats[layer]
        chunks.append(Chunk(feats.token_ids, torch.full((T,), d), torch.arange(T), (lf.values, lf.indices), start))
        start += T
    db = build_feature_database(chunks, scope.sae(layer).d_sae, meta={"layer": layer, "point": f"resid_post.{layer}"})
    db.annotate(int(db.top_features(1)[0]), label="Keyword <b>def</b>")
    return db


def test_analyze_colours_each_token_by_its_top_feature_and_lists_the_table():
    scope = _scope()
    session = AppSession(scope, layer=3)
    view = session.analyze(TEXT, n=3)
    feats = scope.features(TEXT)
    assert view.tokens == tuple(feats.tokens) and view.layer == 3
    for t in range(len(view.tokens)):
        top = feats.token_top(3, t, 3)
        assert view.table[t] == tuple(top)
        assert (view.features[t], view.values[t]) == (top[0] if top else (-1, 0.0))
    # Full colour is the largest value past position 0 (the attention sink is left out of statistics).
    assert view.scale == pytest.approx(max(view.values[1:]))


def test_view_by_one_feature_reads_its_dense_column():
    scope = _scope()
    session = AppSession(scope, layer=3)
    first = session.analyze(TEXT)
    f = first.features[5]
    view = session.view(f)
    column = scope.features(TEXT)[3].dense()[:, f]
    assert view.coloured_by == f
    assert view.values == pytest.approx(column.tolist())
    assert all((g == f) == (v > 0) for g, v in zip(view.features, view.values))


def test_token_features_are_the_tokens_active_features_and_bad_positions_say_the_range():
    scope = _scope()
    session = AppSession(scope, layer=2)
    session.analyze(TEXT)
    rows = session.token_features(4)
    assert [(r.feature, r.value) for r in rows] == scope.features(TEXT).token_top(2, 4)
    with pytest.raises(ValueError, match=r"0\.\.\d+ \(the prompt has \d+ tokens\)"):
        session.token_features(999)


def test_live_card_describes_the_prompt_and_carries_the_logit_lens():
    scope = _scope()
    session = AppSession(scope, layer=3)
    view = session.analyze(TEXT)
    f = view.features[4]
    card = session.card(f)
    values = scope.features(TEXT)[3].dense()[1:, f]
    assert card.meta["source"] == "this prompt"
    assert card.max == pytest.approx(float(values.max()))
    assert card.count == int((values > 0).sum())
    assert card.logit_top and card.view is not None
    with pytest.raises(ValueError, match="feature must be an int in 0..1023"):
        session.card(5000)


def test_database_card_search_and_labels_come_from_the_database():
    scope = _scope()
    db = _database(scope)
    session = AppSession(scope, db)
    assert session.layer == 3
    labelled = int(db.top_features(1)[0])
    card = session.card(labelled)
    assert card.label == "Keyword <b>def</b>" and card.count == int(db.count[labelled])
    hits = session.search("keyword")
    assert [h.feature for h in hits] == [labelled] and hits[0].label == "Keyword <b>def</b>"
    assert hits[0].value == pytest.approx(float(db.act_max[labelled]))
    assert session.search(str(labelled + 1))[0].feature == labelled + 1
    # At a layer the database does not describe, the card is computed from the prompt.
    session.analyze(TEXT, layer=2)
    assert session.card(session.view().features[3]).meta["source"] == "this prompt"


def test_a_database_of_another_layer_or_width_is_refused_with_the_fix():
    scope = _scope()
    db = _database(scope)
    db.meta["layer"] = 5
    with pytest.raises(ValueError, match=r"describes layer 5 but SAEs are loaded at layers \[2, 3\]"):
        AppSession(scope, db)


def test_compare_ranks_the_same_features_as_scope_compare():
    scope = _scope()
    session = AppSession(scope, layer=3)
    rows, fig = session.compare("def f(x):\n    return x", "The cat sat on the mat.", n=5)
    expected = scope.compare("def f(x):\n    return x", "The cat sat on the mat.", [3])[3].ranked(5)
    assert [d for d, _ in rows] == expected
    assert len(fig.data) == 2


def test_evaluation_table_from_an_evaluation_json(tmp_path):
    from qwen_scope.evals import LayerEval, SAEEvaluation

    ev = SAEEvaluation({"release": "nano"}, {3: LayerEval(3, 100, 99, 1024, 16, 0.9, 1.0, 16.0, 0.01, 0.0, 2.0,
                                                          {"sae": 2.1}, {"sae": 0.05}, {"sae": 0.4}, 0.8)})
    (tmp_path / "sae_eval.json").write_text(__import__("json").dumps(ev.to_dict()))
    session = AppSession(_scope(), evaluation=tmp_path)
    assert session.evaluation_table() == ev.table()
    assert AppSession(_scope()).evaluation_table() is None
    with pytest.raises(FileNotFoundError, match="qwen-scope eval sae --out DIR"):
        AppSession(_scope(), evaluation=tmp_path / "missing")
