"""Steering evaluation on the nano model's features of its RESULTS.md: no effect at strength 0, KL and the feature's
activation growing with strength, controls that run and match what they promise, one clear error per bad edit."""
from __future__ import annotations

import math

import pytest
import torch

from qwen_scope import add, clamp
from qwen_scope.evals import SteeringEvaluation, evaluate_steering, suggest_strength, sweep_strength
from qwen_scope.evals.steer_eval import _matched_features
from qwen_scope.nano import nano_scope

DOCTEST = "Example:\n\n"  # layer 5 #992: the first ">" of a ">>>" prompt
DEFAULTS = ["def f(x", "    return"]  # layer 4 #348: "=" of a keyword default


@pytest.fixture(scope="module")
def scope():
    torch.set_num_threads(1)
    return nano_scope([4, 5])


def test_strength_zero_changes_nothing(scope):
    ev = evaluate_steering(scope, DOCTEST, add(5, 992, 0.0), max_new_tokens=6, controls=False)
    assert ev.target.kl == 0.0 and set(ev.target.kl_per_step) == {0.0}
    assert ev.target.feature_activation == ev.target.base_feature_activation
    assert ev.target.perplexity == pytest.approx(ev.base_perplexity)
    assert ev.result.steered.text == ev.result.baseline.text


@pytest.mark.parametrize("prompts, layer, feature", [([DOCTEST], 5, 992), (DEFAULTS, 4, 348)])
def test_kl_and_activation_grow_with_strength(scope, prompts, layer, feature):
    sw = sweep_strength(scope, prompts, layer, feature, [0, 2, 4, 8], max_new_tokens=8)
    assert sw.kl[0] == 0.0 and sw.effect[0] == 0.0
    assert all(a < b for a, b in zip(sw.kl, sw.kl[1:])), sw.kl
    assert all(a < b for a, b in zip(sw.effect, sw.effect[1:])), sw.effect
    assert sw.suggested in sw.strengths
    assert len(sw.figure().data) == 3 and "suggested" in sw.table()


def test_controls_run_and_match_norm_and_density(scope):
    ev = evaluate_steering(scope, [DOCTEST, "def f(x):\n"], add(5, 992, 4.0), max_new_tokens=6, n_controls=2)
    assert isinstance(ev, SteeringEvaluation) and len(ev.random_directions) == 2 and len(ev.random_features) == 2
    assert [a.feature for a in ev.random_directions] == [992, 992]
    assert 992 not in [a.feature for a in ev.random_features]
    for arm in ev.arms:
        assert len(arm.kl_per_step) == 6 and arm.kl > 0 and math.isfinite(arm.perplexity)
        assert len(arm.top_logit_deltas) == 8 and len(arm.texts) == 2
    # The feature's own direction moves the feature; a random direction of the same norm barely does.
    assert ev.target.activation_gain > 1.0 > abs(ev.random_directions[0].activation_gain)
    assert ev.target.kl > max(a.kl for a in ev.random_directions)
    assert ev.target.top_logit_deltas[0][0] == ">"
    assert "random direction 1" in ev.summary() and len(ev.figure().data) == 5


def test_random_features_are_nearest_in_log_density():
    density = torch.tensor([0.0, 0.01, 0.011, 0.2, 0.0098, 0.5, 0.012, 0.3])
    picked = _matched_features(density, 1, 1, torch.Generator().manual_seed(0))
    assert len(picked) == 1 and picked[0] in (2, 4, 6, 3)
    assert set(_matched_features(density, 1, 7, torch.Generator().manual_seed(0))) == {2, 3, 4, 5, 6, 7}


def test_scope_steer_evaluates_on_request(scope):
    ev = scope.steer(DOCTEST, [clamp(5, 992, 3.0)], evaluate=True, max_new_tokens=4, controls=False)
    assert ev.result.steered.text == scope.steer(DOCTEST, [clamp(5, 992, 3.0)], max_new_tokens=4).steered.text
    # Read back by the SAE from the clamped residual: near the clamp value, not exactly it (TopK re-encodes).
    assert 1.0 < ev.target.feature_activation < 4.0 and ev.target.base_feature_activation < 1.0


def test_the_suggestion_is_where_the_coherent_effect_saturates():
    assert suggest_strength([0, 2, 4, 8], [0, 1.0, 1.95, 2.0], [3, 3, 3.5, 9], 3.0) == 4
    assert suggest_strength([0, 2, 4, 8], [0, 1.0, 1.95, 2.0], [3, 3, 3.5, 5], 3.0) == 4
    assert suggest_strength([0, -2, -4], [0, -1.0, -3.0], [3, 3, 3], 3.0) == -4
    assert suggest_strength([0, 2], [0, 0], [3, 3], 3.0) is None
    with pytest.raises(ValueError, match="saturation"):
        suggest_strength([1], [1], [1], 1.0, saturation=0)


def test_bad_edits_are_one_clear_error(scope):
    with pytest.raises(ValueError, match="one edit"):
        evaluate_steering(scope, DOCTEST, [add(5, 992, 1.0), add(4, 348, 1.0)])
    with pytest.raises(ValueError, match="layer 9, outside .* 0..5"):
        evaluate_steering(scope, DOCTEST, add(9, 992, 1.0))
    with pytest.raises(ValueError, match="feature 5000 out of range"):
        evaluate_steering(scope, DOCTEST, add(5, 5000, 1.0))
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluate_steering(scope, [], add(5, 992, 1.0))
