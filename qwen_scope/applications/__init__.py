"""Applications built on the toolkit's verbs (the Qwen-Scope report's uses): few-seed feature classification at
corpus scale (batched scores, held-out tuning, a linear-probe baseline), feature footprints and benchmark redundancy,
long-tail data synthesis, and SAE-guided training signals (SASFT's loss, RL rewards) with a fine-tuning loop that
measures them on held-out text."""
from qwen_scope.applications.classify import FeatureClassifier, RuleFeature, binary_metrics
from qwen_scope.applications.coverage import CoverPick, FeatureFootprint, greedy_cover, redundancy_matrix
from qwen_scope.applications.finetune import FinetuneConfig, FinetuneResult, finetune
from qwen_scope.applications.guided import FeaturePenalty
from qwen_scope.applications.redundancy import (Benchmark, RankingCheck, coverage_subsample, load_benchmark_texts,
                                                overlap_figure, ranking_check, spearman)
from qwen_scope.applications.sasft import (ContrastFeature, class_targets, contrast_features, repetition_rate,
                                           response_mask, reward_function, split_by_repetition, token_rewards)
from qwen_scope.applications.scoring import document_scores, iter_document_scores, store_document_scores
from qwen_scope.applications.synthesis import (Efficiency, FeaturePrompt, SynthesisRun, TextGenerator,
                                               coverage_figure, efficiency, feature_prompts, sample_coverage,
                                               synthesize)
from qwen_scope.applications.tuning import MeanDiffProbe, RuleTuning, best_threshold, pr_curve, pr_figure, tune_rule

__all__ = [
    # classification
    "FeatureClassifier", "RuleFeature", "binary_metrics", "tune_rule", "RuleTuning", "MeanDiffProbe",
    "best_threshold", "pr_curve", "pr_figure",
    # document scores
    "document_scores", "iter_document_scores", "store_document_scores",
    # footprints and benchmarks
    "FeatureFootprint", "redundancy_matrix", "greedy_cover", "CoverPick", "Benchmark", "load_benchmark_texts",
    "overlap_figure", "coverage_subsample", "spearman", "RankingCheck", "ranking_check",
    # synthesis
    "FeaturePrompt", "feature_prompts", "TextGenerator", "synthesize", "sample_coverage", "SynthesisRun",
    "Efficiency", "efficiency", "coverage_figure",
    # training
    "FeaturePenalty", "ContrastFeature", "contrast_features", "class_targets", "response_mask", "token_rewards",
    "reward_function", "repetition_rate", "split_by_repetition", "finetune", "FinetuneConfig", "FinetuneResult",
]
