"""Few-seed SAE-feature classifier on the bundled nano model: selection, held-out quality, the rule, JSON, errors."""
from __future__ import annotations

import random
import re

import pytest
import torch

from qwen_scope import nano_corpus, nano_scope
from qwen_scope.applications import FeatureClassifier, RuleFeature

_CODE_LINE = re.compile(r"^\s*(def |class |return\b|import |from \S+ import|if |for |elif |else:|try:|except|with "
                        r"|raise |self\.|\w+(\.\w+)* = )")


def _chunks(text: str, n_lines: int = 4) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    return ["\n".join(lines[i:i + n_lines]) for i in range(0, len(lines) - n_lines + 1, n_lines)]


def _is_code(chunk: str) -> bool:
    """Every line is a Python statement or header, and no docstring or comment."""
    lines = chunk.splitlines()
    return ('"""' not in chunk and "#" not in chunk
            and all(_CODE_LINE.match(line) or line.rstrip().endswith((":", ")", ",", "]")) for line in lines))


def _is_prose(chunk: str) -> bool:
    """Over 85% letters (whitespace aside) and nothing code-like."""
    s = "".join(chunk.split())
    return sum(ch.isalpha() for ch in s) / len(s) > 0.85 and not re.search(r"(def |class |>>>|=|_)", chunk)


@pytest.fixture(scope="module")
def data():
    """English prose (docstring / pydoc chunks) vs Python code (source chunks): 40 four-line chunks each, shuffled."""
    code = [c for t in nano_corpus(sources=["source"]) for c in _chunks(t) if _is_code(c)]
    prose = [c for t in nano_corpus(sources=["docstrings", "pydoc_topic"]) for c in _chunks(t) if _is_prose(c)]
    rng = random.Random(0)
    return rng.sample(prose, 40), rng.sample(code, 40)


@pytest.fixture(scope="module")
def scope():
    return nano_scope()


@pytest.fixture(scope="module")
def clf(scope, data):
    prose, code = data
    return FeatureClassifier.fit(scope, prose[:8], code[:8], n_features=4)


def _doc_score(scope, text: str, layer: int, feature: int) -> float:
    """Largest activation of ``feature`` over positions 1.. of ``text``, from the dense codes."""
    dense = scope.features(text, [layer])[layer].dense()[1:, feature]
    return max([0.0] + dense.tolist())


def test_held_out_f1_with_eight_seeds_per_class(clf, data):
    prose, code = data
    texts, labels = prose[8:] + code[8:], [True] * 32 + [False] * 32
    ev = clf.evaluate(texts, labels)
    # Measured: F1 0.955 (tp 32, fp 3, fn 0, tn 29) with the rule L5#906, L5#9, L4#850, L5#627.
    assert ev["f1"] > 0.9 and ev["accuracy"] > 0.9
    assert ev["tp"] + ev["fp"] + ev["fn"] + ev["tn"] == 64
    assert ev["precision"] == pytest.approx(ev["tp"] / (ev["tp"] + ev["fp"]))
    assert ev["recall"] == pytest.approx(ev["tp"] / (ev["tp"] + ev["fn"]))
    assert all(r.rate_pos == 1.0 and r.rate_neg == 0.0 for r in clf.rules)


def test_selection_equals_a_brute_force_ranking_over_the_seeds(scope, data):
    prose, code = data
    pos, neg, layers, n, min_diff = code[:5], prose[:5], [3, 5], 6, 0.4
    fitted = FeatureClassifier.fit(scope, pos, neg, layers=layers, n_features=n, min_rate_diff=min_diff)
    expected = []
    for layer in layers:
        dense_p = [scope.features(t, [layer])[layer].dense()[1:] for t in pos]
        dense_n = [scope.features(t, [layer])[layer].dense()[1:] for t in neg]
        for f in range(1024):
            sp = [max([0.0] + d[:, f].tolist()) for d in dense_p]
            sn = [max([0.0] + d[:, f].tolist()) for d in dense_n]
            if max(sp + sn) == 0:
                continue
            best = None
            for t in [0.0] + sn:
                diff = sum(s > t for s in sp) / len(sp) - sum(s > t for s in sn) / len(sn)
                if best is None or diff > best[0] or (diff == best[0] and t > best[1]):
                    best = (diff, t)
            above = [s for s in sp if s > best[1]]
            thr = (best[1] + min(above)) / 2 if above else best[1]
            rp, rn = sum(s > thr for s in sp) / len(sp), sum(s > thr for s in sn) / len(sn)
            mean_gap = abs(sum(sp) / len(sp) - sum(sn) / len(sn))
            if rp - rn >= min_diff:
                expected.append((-(rp - rn), -mean_gap, layer, f, thr, rp, rn))
    expected.sort()
    expected = expected[:n]
    assert len(fitted.rules) == n
    assert [(r.layer, r.feature) for r in fitted.rules] == [(e[2], e[3]) for e in expected]
    for r, e in zip(fitted.rules, expected):
        assert r.threshold == pytest.approx(e[4], abs=1e-5)
        assert (r.rate_pos, r.rate_neg) == (e[5], e[6])


def test_predict_and_scores_equal_the_rule_applied_by_hand(clf, scope, data):
    prose, code = data
    texts = [prose[20], code[20], prose[30], code[30], "x", "def f(x):\n    return x + 1"]
    by_hand = torch.tensor([[_doc_score(scope, t, r.layer, r.feature) for r in clf.rules] for t in texts])
    torch.testing.assert_close(clf.scores(texts), by_hand)
    fired = [any(s > r.threshold for s, r in zip(row, clf.rules)) for row in by_hand.tolist()]
    assert clf.predict(texts).tolist() == fired
    assert clf.votes(texts).tolist() == [sum(s > r.threshold for s, r in zip(row, clf.rules))
                                         for row in by_hand.tolist()]
    # A one-token text has no position after the attention sink: every score is 0, nothing fires.
    assert by_hand[4].abs().sum() == 0 and not fired[4]
    assert clf.predict(texts[0]).tolist() == fired[:1]


def test_json_round_trip_keeps_the_rule_and_its_predictions(clf, scope, data):
    prose, code = data
    again = FeatureClassifier.from_json(clf.to_json(), scope)
    assert again.rules == clf.rules and again.template == clf.template
    texts = prose[10:14] + code[10:14]
    assert torch.equal(again.predict(texts), clf.predict(texts))
    with pytest.raises(ValueError, match="not a feature classifier"):
        FeatureClassifier.from_json('{"format": "other"}', scope)


def test_explain_lists_every_rule_feature(clf):
    text = clf.explain()
    assert "ANY of these 4 features" in text
    for r in clf.rules:
        assert re.search(rf"\b{r.layer}\s+{r.feature}\s+{r.threshold:.3f}\s+{r.rate_pos:.2f}\s+{r.rate_neg:.2f}", text)


def test_clear_errors_for_bad_seeds_layers_and_labels(clf, scope, data):
    prose, code = data
    with pytest.raises(ValueError, match="positives is empty"):
        FeatureClassifier.fit(scope, [], code[:2])
    with pytest.raises(ValueError, match="negatives is empty"):
        FeatureClassifier.fit(scope, prose[:2], [])
    with pytest.raises(TypeError, match="list of texts"):
        FeatureClassifier.fit(scope, "one text", code[:2])
    with pytest.raises(ValueError, match=r"no SAE at layer\(s\) \[7\].*layers \[0, 1, 2, 3, 4, 5\]"):
        FeatureClassifier.fit(scope, prose[:2], code[:2], layers=[5, 7])
    with pytest.raises(ValueError, match="no feature at layers"):
        FeatureClassifier.fit(scope, prose[:2], prose[:2], layers=[0])
    with pytest.raises(ValueError, match="n_features must be >= 1"):
        FeatureClassifier.fit(scope, prose[:2], code[:2], n_features=0)
    with pytest.raises(ValueError, match="2 texts but 3 labels"):
        clf.evaluate(prose[:2], [True, False, True])
    with pytest.raises(ValueError, match="no SAE at layer"):
        FeatureClassifier(nano_scope(layers=[0]), clf.rules)
    with pytest.raises(ValueError, match="at least one rule"):
        FeatureClassifier(scope, [])
    assert isinstance(clf.rules[0], RuleFeature)
