"""TileLang kernels for sm_90a, one stage per file (a builder and its launcher).

Stages: ``prep`` (gate cumsum + gate-free UT inverse), ``segment_states`` and ``state_scan`` (exact intra-card
context parallelism for few long sequences), ``fused_fwd`` (state recurrence and output in one kernel).
``forward`` wires them; ``plan`` builds the chunk/segment tables. Importing this package does not import tilelang:
the stage modules load on the first kernel call.

Kernel variants (``variants``: warp-specialised fused stage, grouped prep) choose the stage kernels; the launcher
exported here runs ``variants.DEFAULT_VARIANT`` unless FLASHQLA_KERNELS_VARIANT names another (``base`` = the first
verified path, ``forward.chunk_gated_delta_rule_fwd``).
"""
from flashqla_kernels.gated_delta_rule.hopper.forward import unsupported_reason
from flashqla_kernels.gated_delta_rule.hopper.variants import chunk_gated_delta_rule_fwd

__all__ = ["chunk_gated_delta_rule_fwd", "unsupported_reason"]
