"""Evaluations you can trust a feature or a steering result by: SAEs spliced into the model, steering measured
against controls, and feature explanations scored by detection.

    from qwen_scope.evals import evaluate_saes, evaluate_steering, explain_features
    evaluate_saes(scope, nano_corpus(16)).table()                      # FVE, L0, CE recovered, KL per layer
    evaluate_steering(scope, ["Example:\\n\\n"], [add(5, 992, 4.0)])    # KL per step, controls, perplexity
    explain_features(db, [992], TransformersChat("Qwen/Qwen3-0.6B"), scope=scope)
"""
from qwen_scope.evals.corpus import corpus_rows, token_batches
from qwen_scope.evals.explain import Explanation, auroc, explain_features, explain_prompt, judge_prompt
from qwen_scope.evals.explainers import OpenAIChat, TransformersChat
from qwen_scope.evals.results import LayerEval, SAEEvaluation
from qwen_scope.evals.spliced import MODES, EvalConfig, evaluate_saes
from qwen_scope.evals.steer_eval import evaluate_steering, sweep_strength
from qwen_scope.evals.steer_results import ArmResult, StrengthSweep, SteeringEvaluation, suggest_strength

__all__ = ["ArmResult", "EvalConfig", "Explanation", "LayerEval", "MODES", "OpenAIChat", "SAEEvaluation",
           "SteeringEvaluation", "StrengthSweep", "TransformersChat", "auroc", "corpus_rows", "evaluate_saes",
           "evaluate_steering", "explain_features", "explain_prompt", "judge_prompt", "suggest_strength",
           "sweep_strength", "token_batches"]
