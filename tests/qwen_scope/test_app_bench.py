"""The steering bench on the nano model: streamed generations equal ``Scope.steer``'s, edits parsed with their
errors, the sweep figure's values."""
from __future__ import annotations

import functools

import pytest

from qwen_scope.app.bench import SteeringBench, parse_features, sweep_figure
from qwen_scope.steering import add

PROMPT = "def close(self):\n    "


@functools.lru_cache(maxsize=None)
def _scope():
    from qwen_scope import nano_scope

    return nano_scope([3])


def test_parse_features_takes_bare_ids_at_the_layer_and_layer_feature_pairs():
    assert parse_features("42, 3:7 9", 5) == [(5, 42), (3, 7), (5, 9)]
    assert parse_features([42, "3:7"], 1) == [(1, 42), (3, 7)]
    with pytest.raises(ValueError, match="'x1' is not FEATURE or LAYER:FEATURE"):
        parse_features("42, x1", 3)


def test_edits_broadcast_one_strength_or_take_one_per_feature():
    bench = SteeringBench(_scope())
    assert bench.edits("5, 7", 8.0, positions="generated") == [add(3, 5, 8.0, positions="generated"),
                                                                add(3, 7, 8.0, positions="generated")]
    assert [e.value for e in bench.edits("5, 7", [2.0, -3.0])] == [2.0, -3.0]
    assert [e.mode for e in bench.edits("5", 4.0, mode="ablate")] == ["ablate"]
    with pytest.raises(ValueError, match="3 strengths for 2 features"):
        bench.edits("5, 7", [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="no feature to steer"):
        bench.edits(" ", 1.0)


def test_stream_grows_token_by_token_and_ends_equal_to_scope_steer():
    scope = _scope()
    edits = [add(3, 5, 8.0), add(3, 7, -4.0, positions="generated")]
    views = list(SteeringBench(scope).stream(PROMPT, edits, max_new_tokens=8))
    expected = scope.steer(PROMPT, edits, max_new_tokens=8)
    final = views[-1]
    assert final.done and final.generated_by == "engine" == expected.generated_by
    # One view per generated token while streaming, each side a prefix of the final one.
    partial = views[:-1]
    assert [len(v.steered.tokens) for v in partial] == list(range(1, 9))
    assert all(not v.done and v.steered.tokens == final.steered.tokens[:len(v.steered.tokens)] for v in partial)
    for got, want in ((final.result.baseline, expected.baseline), (final.result.steered, expected.steered)):
        assert got.token_ids.tolist() == want.token_ids.tolist()
        assert got.probs.tolist() == pytest.approx(want.probs.tolist())
    assert final.result.fired == expected.fired
    assert final.steered.probs == pytest.approx(expected.steered.probs.tolist())
    assert final.baseline.tokens == tuple(expected.baseline.tokens)


def test_stream_without_the_engine_is_one_finished_view_of_scope_steer():
    scope = _scope()
    edits = [add(3, 5, 8.0)]
    handle = scope.model.register_forward_hook(lambda *args: None)
    try:
        views = list(SteeringBench(scope).stream(PROMPT, edits, max_new_tokens=6))
    finally:
        handle.remove()
    assert len(views) == 1 and views[0].done and views[0].generated_by.startswith("transformers (module")
    assert views[0].result.steered.token_ids.tolist() == scope.steer(PROMPT, edits, max_new_tokens=6,
                                                                     engine="transformers").steered.token_ids.tolist()


def test_sweep_figure_counts_changed_tokens_against_the_baseline():
    scope = _scope()
    result, fig = SteeringBench(scope, lambda f, n: "label").sweep(PROMPT, 3, 5, [-8.0, 0.0, 8.0],
                                                                   max_new_tokens=6)
    assert result.strengths == (-8.0, 0.0, 8.0)
    changed, mean_p = fig.data[0].y, fig.data[1].y
    # Strength 0 adds nothing: the run is the baseline.
    assert changed[1] == 0.0
    base = result.baseline.token_ids.tolist()
    for i, run in enumerate(result.runs):
        ids = run.token_ids.tolist()
        assert changed[i] == pytest.approx(1 - sum(a == b for a, b in zip(ids, base)) / max(len(ids), len(base)))
        assert mean_p[i] == pytest.approx(float(run.probs.mean()))
    assert "feature #5 label" in fig.layout.title.text
    assert sweep_figure(result).layout.title.text.endswith("#5")
    with pytest.raises(ValueError, match="no strengths to sweep"):
        SteeringBench(scope).sweep(PROMPT, 3, 5, [])
