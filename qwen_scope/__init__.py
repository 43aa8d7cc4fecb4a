"""qwen-scope: the user's verbs — load a Qwen model with Qwen-Scope SAEs, read features, steer, collect, explore."""

__version__ = "0.1.0"

from qwen_scope.store import ActivationStore  # noqa: E402
from qwen_scope.scope import Scope  # noqa: E402
from qwen_scope.features import FeatureStat, LayerFeatures, TextFeatures, text_features  # noqa: E402
from qwen_scope.steering import (FeatureEdit, Generation, SteeringResult, Sweep, ablate, add, clamp,  # noqa: E402
                                steer, steering, sweep)
from qwen_scope.compare import Comparison, FeatureDiff, LayerComparison, compare  # noqa: E402

__all__ = ["ActivationStore", "Scope", "FeatureStat", "LayerFeatures", "TextFeatures", "text_features",
           "FeatureEdit", "Generation", "SteeringResult", "Sweep", "ablate", "add", "clamp", "steer", "steering", "sweep",
           "Comparison", "FeatureDiff", "LayerComparison", "compare"]
