"""The public surface of ``qwen_scope`` is small and pinned: adding or removing a name is a deliberate change."""
from __future__ import annotations

import qwen_scope

PUBLIC = {
    # model + SAEs, features, steering, comparison
    "Scope", "TextFeatures", "LayerFeatures", "FeatureStat", "text_features",
    "FeatureEdit", "Generation", "SteeringResult", "Sweep", "add", "clamp", "ablate", "steer", "steering", "sweep",
    "Comparison", "LayerComparison", "FeatureDiff", "compare",
    # collection and the store
    "collect", "load_corpus", "CollectSummary", "ActivationStore",
    # exploration
    "FeatureDatabase", "FeatureCard", "build_feature_database", "store_chunks", "feature_card", "feature_json",
    "feature_views", "write_dashboard", "prompt_heatmap", "token_features_figure", "comparison_figure",
    "layer_range_figure",
    # the bundled nano model and the demo
    "load_nano", "nano_scope", "nano_corpus", "DemoConfig", "run_demo",
}


def test_all_is_exactly_the_pinned_public_surface():
    assert set(qwen_scope.__all__) == PUBLIC
    assert len(qwen_scope.__all__) == len(PUBLIC), "duplicate names in __all__"


def test_every_public_name_resolves_and_is_documented():
    for name in qwen_scope.__all__:
        obj = getattr(qwen_scope, name)
        assert (obj.__doc__ or "").strip(), f"qwen_scope.{name} has no docstring"


def test_collect_is_the_verb():
    assert callable(qwen_scope.collect) and qwen_scope.collect.__name__ == "collect"
