"""Review findings in the verbs: one-token texts, top_k validation, unknown steering presets."""
from __future__ import annotations

import pytest

from qwen_scope.steering import add
from tests.qwen_scope.scope_helpers import tiny_scope


@pytest.fixture(scope="module")
def scope():
    return tiny_scope(layers=(1,))


def test_table_of_a_one_token_text_does_not_claim_position_0_was_excluded(scope):
    feats = scope.features("a", layers=1)
    assert feats[1].first == 0
    assert "excluded" not in feats.table(1).splitlines()[0]
    longer = scope.features("ab", layers=1)
    assert longer[1].first == 1 and "(position 0 excluded)" in longer.table(1).splitlines()[0]


def test_negative_top_k_is_refused_instead_of_dropping_the_last_feature(scope):
    with pytest.raises(ValueError, match="top_k must be >= 0.*got -1"):
        scope.features("abc", layers=1, top_k=-1)
    assert scope.features("abc", layers=1, top_k=3)[1].values.shape == (3, 3)


def test_add_with_an_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match=r"'huge' is not a preset.*'light': 5\.0"):
        add(1, 3, "huge")
    assert add(1, 3, "strong").value == 100.0


def test_compare_without_sae_layers_says_so(scope):
    from qwen_scope.scope import Scope

    bare = Scope(scope.model, scope.tokenizer)
    with pytest.raises(ValueError, match="no layers to compare.*load_saes"):
        bare.compare("ab", "cd")
    with pytest.raises(ValueError, match="no layers to compare"):
        scope.compare("ab", "cd", layers=[])


def test_sweep_generates_once_per_strength_plus_one_baseline(scope, monkeypatch):
    calls = []
    generate = scope.model.generate
    monkeypatch.setattr(scope.model, "generate", lambda *a, **k: calls.append(1) or generate(*a, **k))
    from qwen_scope.steering import sweep

    result = sweep(scope, "ab", 1, 3, [0.0, 50.0], max_new_tokens=2, baseline=True)
    assert len(calls) == 3 and len(result.runs) == 2
    assert result.runs[0].token_ids.tolist() == result.baseline.token_ids.tolist()


def test_missing_layer_past_the_last_block_is_not_told_to_load_it(scope):
    n = scope.adapter.n_layers
    with pytest.raises(KeyError, match=rf"no SAE at layer {n}; loaded layers are \[1\]\. .*blocks 0\.\.{n - 1} only"):
        scope.sae(n)
    with pytest.raises(KeyError, match=r"no SAE at layer 0.*load_saes\(release, \[0\]\)"):
        scope.sae(0)


def test_top_include_first_false_leaves_position_0_out_even_when_computed_with_skip_first_false(scope):
    kept = scope.features("abcd", layers=1, skip_first=False)
    skipped = scope.features("abcd", layers=1, skip_first=True)
    assert kept.top(1, 50, include_first=False) == skipped.top(1, 50)
    assert all(s.count <= 3 for s in kept.top(1, 50, include_first=False))
    assert kept.top(1, 50) == skipped.top(1, 50, include_first=True)
    assert max(s.count for s in kept.top(1, 50)) == 4
