"""TileLang kernels for sm_90a, one stage per file (a builder and its launcher).

Stages: ``kkt_solve`` (gate cumsum + the gated UT inverse Ag), ``segment_states`` and ``state_scan`` (exact
intra-card context parallelism for few long sequences), ``chunk_fwd`` (state recurrence and output in one
warp-specialised kernel). ``forward`` wires them; ``plan`` builds the chunk/segment tables and picks the V slice and
the split. Importing this package does not import tilelang: the stage modules load on the first kernel call.
"""
from flashqla_kernels.gated_delta_rule.hopper.forward import chunk_gated_delta_rule_fwd, unsupported_reason

__all__ = ["chunk_gated_delta_rule_fwd", "unsupported_reason"]
