"""qwen-scope: the user's verbs — load a Qwen model with Qwen-Scope SAEs, read features, steer, collect, explore."""

__version__ = "0.1.0"

from qwen_scope.store import ActivationStore  # noqa: E402
# The verb shadows the submodule attribute on purpose: `qwen_scope.collect(...)` is the documented call.
from qwen_scope.collect import CollectSummary, collect, load_corpus  # noqa: E402
from qwen_scope.scope import Scope  # noqa: E402
from qwen_scope.features import FeatureStat, LayerFeatures, TextFeatures, text_features  # noqa: E402
from qwen_scope.steering import (FeatureEdit, Generation, SteeringResult, Sweep, ablate, add, clamp,  # noqa: E402
                                steer, steering, sweep)
from qwen_scope.compare import Comparison, FeatureDiff, LayerComparison, compare  # noqa: E402
from qwen_scope.explore import (FeatureCard, FeatureDatabase, build_feature_database,  # noqa: E402
                                comparison_figure, feature_card, feature_json, feature_views, layer_range_figure,
                                prompt_heatmap, store_chunks, token_features_figure, write_dashboard)

__all__ = ["ActivationStore", "CollectSummary", "collect", "load_corpus", "Scope", "FeatureStat", "LayerFeatures", "TextFeatures", "text_features",
           "FeatureEdit", "Generation", "SteeringResult", "Sweep", "ablate", "add", "clamp", "steer", "steering", "sweep",
           "Comparison", "FeatureDiff", "LayerComparison", "compare"]
__all__ += ["FeatureCard", "FeatureDatabase", "build_feature_database", "comparison_figure", "feature_card",
            "feature_json", "feature_views", "layer_range_figure", "prompt_heatmap", "store_chunks",
            "token_features_figure", "write_dashboard"]
from qwen_scope.nano import load_nano, nano_corpus, nano_scope  # noqa: E402
from qwen_scope.demo import DemoConfig, run_demo  # noqa: E402

__all__ += ["load_nano", "nano_corpus", "nano_scope", "DemoConfig", "run_demo"]
