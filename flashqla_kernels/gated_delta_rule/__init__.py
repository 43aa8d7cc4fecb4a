"""Gated delta rule: float64 reference, torch path, Hopper kernels and the public API.

Importing this package touches neither CUDA nor tilelang (the Hopper kernels load on the first kernel call).
"""
from flashqla_kernels.gated_delta_rule.api import chunk_gated_delta_rule, explain_backend, recurrent_gated_delta_rule
from flashqla_kernels.gated_delta_rule.reference import (
    chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref,
)
from flashqla_kernels.gated_delta_rule.torch_path import (
    chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_torch,
)

__all__ = [
    "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "explain_backend",
    "chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref",
    "chunk_gated_delta_rule_torch", "recurrent_gated_delta_rule_torch",
]
