"""The public surface of ``qwen_scope`` is small and pinned: adding or removing a name is a deliberate change."""
from __future__ import annotations

import sys

import qwen_scope
import qwen_scope.collect
import qwen_scope.compare
import qwen_scope.demo
import qwen_scope.explore
import qwen_scope.features
import qwen_scope.nano
import qwen_scope.steering

PUBLIC = {
    # a model with its SAEs, and the bundled nano one
    "Scope", "nano_scope", "nano_corpus",
    # steering edits and runs (features and comparison are also Scope methods)
    "add", "clamp", "ablate", "steering", "sweep", "compare",
    # collection and the store
    "collect", "load_corpus", "ActivationStore",
    # exploration
    "store_chunks", "build_feature_database", "FeatureDatabase", "feature_card", "write_dashboard",
    # applications
    "FeatureClassifier", "FeatureFootprint", "FeaturePenalty",
}
# What the verbs return and the finer tools: importable from their submodules, not from the root.
SUBMODULE_ONLY = {
    "qwen_scope.explore": ("prompt_heatmap", "comparison_figure", "token_features_figure", "layer_range_figure",
                           "feature_views", "feature_json", "FeatureCard"),
    "qwen_scope.features": ("text_features", "TextFeatures", "LayerFeatures", "FeatureStat"),
    "qwen_scope.steering": ("steer", "FeatureEdit", "Generation", "SteeringResult", "Sweep"),
    "qwen_scope.compare": ("Comparison", "LayerComparison", "FeatureDiff"),
    "qwen_scope.collect": ("CollectSummary",),
    "qwen_scope.nano": ("load_nano",),
    "qwen_scope.demo": ("DemoConfig", "run_demo"),
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


def test_the_rest_stays_importable_from_its_submodule():
    # sys.modules: the root's verbs collect, compare and steering shadow their modules' attribute names
    for module, names in SUBMODULE_ONLY.items():
        for name in names:
            assert callable(getattr(sys.modules[module], name)), f"{module}.{name}"
            assert name not in qwen_scope.__all__ and not hasattr(qwen_scope, name), name
