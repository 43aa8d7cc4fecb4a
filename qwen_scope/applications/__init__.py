"""Applications built on the toolkit's verbs (the Qwen-Scope report's uses): few-seed feature classification, and
feature footprints for coverage, benchmark redundancy and finding the long tail a dataset misses."""
from qwen_scope.applications.classify import FeatureClassifier, RuleFeature, document_scores
from qwen_scope.applications.coverage import CoverPick, FeatureFootprint, greedy_cover, redundancy_matrix

__all__ = ["FeatureClassifier", "RuleFeature", "document_scores", "FeatureFootprint", "redundancy_matrix",
           "greedy_cover", "CoverPick"]
