"""Feature comparison: per-layer activation rates of two texts, ranked by their difference (the demo's view)."""
from __future__ import annotations

import pytest
import torch

from hooks import capture
from qwen_scope.compare import compare
from qwen_scope.scope import Scope
from tests.qwen_scope.scope_helpers import tiny_scope

A, B = "The cat sat on the mat.", "The dog ran far away!"


def _codes(scope, layer, text, raw=False):
    with torch.no_grad(), capture(scope.model, [f"resid_post.{layer}"]) as cap:
        scope.model(input_ids=scope.tokenize(text), use_cache=False)
    x = cap[f"resid_post.{layer}"][0]
    return scope.sae(layer).pre_acts(x) if raw else scope.sae(layer).encode(x)


@pytest.mark.parametrize("raw", [False, True])
def test_rates_and_means_match_the_codes_of_both_texts(raw):
    scope = tiny_scope("qwen3_5", layers=(1, 2))
    cmp = compare(scope, A, B, layers=[1, 2], raw=raw)
    for layer in (1, 2):
        za, zb = _codes(scope, layer, A, raw)[1:], _codes(scope, layer, B, raw)[1:]
        lc = cmp[layer]
        assert (lc.n_a, lc.n_b) == (len(A) - 1, len(B) - 1)
        torch.testing.assert_close(lc.rate_a, (za > 0).float().mean(0))
        torch.testing.assert_close(lc.rate_b, (zb > 0).float().mean(0))
        torch.testing.assert_close(lc.mean_a, za.mean(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lc.mean_b, zb.mean(0), atol=1e-5, rtol=1e-5)


def test_ranking_is_by_absolute_rate_difference_and_sides_split_it():
    scope = tiny_scope("qwen3", layers=(2,))
    lc = compare(scope, A, B, layers=2)[2]
    ranked = lc.ranked(30)
    diffs = [abs(d.diff) for d in ranked]
    assert diffs == sorted(diffs, reverse=True) and diffs[0] > 0
    expected_top = float((lc.rate_a - lc.rate_b).abs().max())
    assert diffs[0] == pytest.approx(expected_top)
    assert all(d.diff >= 0 for d in lc.ranked(5, side="a")[:1])
    assert lc.ranked(1, side="b")[0].diff == pytest.approx(float((lc.rate_a - lc.rate_b).min()))
    assert "feature" in compare(scope, A, B, layers=2).table(3)


def test_identical_texts_have_no_difference():
    scope = tiny_scope("qwen3_5", layers=(1,))
    lc = compare(scope, A, A, layers=1)[1]
    assert torch.equal(lc.rate_a, lc.rate_b)
    assert all(d.diff == 0 for d in lc.ranked(10))


def test_position_filters_change_the_kept_counts():
    scope = tiny_scope("qwen3_5", layers=(1,))
    assert compare(scope, A, B, skip_first=False)[1].n_a == len(A)
    prefix = compare(scope, A, B, remove_common_prefix=True)[1]
    assert (prefix.n_a, prefix.n_b) == (len(A) - 4, len(B) - 4)  # "The " is shared (one byte per token)
    common = compare(scope, A, B, remove_common_tokens=True, skip_first=False)[1]
    assert common.n_a == sum(ch not in set(B) for ch in A)
    with pytest.raises(ValueError, match="no positions left"):
        compare(scope, "ab", "ab", remove_common_tokens=True)


def test_lists_of_texts_pool_their_positions():
    scope = tiny_scope("qwen3_5", layers=(1,))
    pooled = compare(scope, [A, B], "xyz", layers=1)[1]
    za, zb = _codes(scope, 1, A)[1:], _codes(scope, 1, B)[1:]
    assert pooled.n_a == len(A) + len(B) - 2
    torch.testing.assert_close(pooled.rate_a, (torch.cat([za, zb]) > 0).float().mean(0))


def test_compare_without_sae_layers_says_so():
    scope = tiny_scope(layers=(1,))
    bare = Scope(scope.model, scope.tokenizer)
    with pytest.raises(ValueError, match="no layers to compare.*load_saes"):
        bare.compare("ab", "cd")
    with pytest.raises(ValueError, match="no layers to compare"):
        scope.compare("ab", "cd", layers=[])
