"""TileLang kernels for sm_90a, one stage per file (a builder and its launcher).

Stages: ``prep`` (gate cumsum + gate-free UT inverse), ``segment_states`` and ``state_scan`` (exact intra-card
context parallelism for few long sequences), ``fused_fwd`` (state recurrence and output in one kernel).
``forward`` wires them; ``plan`` builds the chunk/segment tables. Importing this package does not import tilelang:
the stage modules load on the first kernel call.

Kernel variants (``variants``: warp-specialised fused stage, grouped prep) run beside the verified default when asked
for: ``variants.chunk_gated_delta_rule_fwd(..., variant="ws+prep2")``, or FLASHQLA_KERNELS_VARIANT set before this
package is imported (then the launcher below is the variant one); unset, the launcher is ``forward``'s.
"""
import os as _os

from flashqla_kernels.gated_delta_rule.hopper.forward import chunk_gated_delta_rule_fwd, unsupported_reason

if _os.environ.get("FLASHQLA_KERNELS_VARIANT", "default") not in ("", "default"):
    from flashqla_kernels.gated_delta_rule.hopper.variants import chunk_gated_delta_rule_fwd  # noqa: F811

__all__ = ["chunk_gated_delta_rule_fwd", "unsupported_reason"]
