"""Applications built on the toolkit's verbs (the Qwen-Scope report's uses): few-seed feature classification."""
from qwen_scope.applications.classify import FeatureClassifier, RuleFeature, document_scores

__all__ = ["FeatureClassifier", "RuleFeature", "document_scores"]
