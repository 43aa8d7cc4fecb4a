"""qwen-scope: the user's verbs — load a Qwen model with Qwen-Scope SAEs, read features, steer, collect, explore.

The root holds the verbs a user starts from (``__all__``, pinned by ``tests/qwen_scope/test_public_api.py``); what
they return and the finer tools stay in their submodules: ``qwen_scope.explore`` (figures, views, export),
``qwen_scope.steering`` / ``features`` / ``compare`` (result types), ``qwen_scope.applications``,
``qwen_scope.demo``, ``qwen_scope.nano``.

    scope = nano_scope()                                        # or Scope.from_pretrained(model_id, release, layers)
    scope.features("def close(self):").top(3)
    scope.steer("Once upon a time", [add(3, 42, 20.0)]).side_by_side()
"""

__version__ = "0.1.0"

from qwen_scope.sources import quiet_notebook_progress  # noqa: E402

# Before any of our modules imports transformers: in a notebook without ipywidgets its tqdm import would print
# tqdm's advice to install ipywidgets (the text bars it falls back to are fine).
quiet_notebook_progress()

from qwen_scope.store import ActivationStore  # noqa: E402
# The verb shadows the submodule attribute on purpose: `qwen_scope.collect(...)` is the documented call.
from qwen_scope.collect import collect, load_corpus  # noqa: E402
from qwen_scope.scope import Scope  # noqa: E402
from qwen_scope.steering import ablate, add, clamp, steering, sweep  # noqa: E402
from qwen_scope.compare import compare  # noqa: E402
from qwen_scope.explore import (FeatureDatabase, build_feature_database, feature_card, store_chunks,  # noqa: E402
                                write_dashboard)
from qwen_scope.nano import nano_corpus, nano_scope  # noqa: E402
from qwen_scope.applications import FeatureClassifier, FeatureFootprint, FeaturePenalty  # noqa: E402

__all__ = [
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
]
