"""Applications built on the toolkit's verbs (the Qwen-Scope report's uses): few-seed feature classification,
feature footprints for coverage, benchmark redundancy and the long tail a dataset misses, and an SAE-guided
training penalty."""
from qwen_scope.applications.classify import FeatureClassifier, RuleFeature, document_scores
from qwen_scope.applications.coverage import CoverPick, FeatureFootprint, greedy_cover, redundancy_matrix
from qwen_scope.applications.guided import FeaturePenalty

__all__ = ["FeatureClassifier", "RuleFeature", "document_scores", "FeatureFootprint", "redundancy_matrix",
           "greedy_cover", "CoverPick", "FeaturePenalty"]
