"""The families' zero-centred RMSNorms (decoder, final and q/k norms) on the one-pass kernel.

The replacement runs ``ops.rms_norm``'s kernel on CUDA sm_90 bf16/fp16/fp32 tensors of a multiple of 64 channels
(fp32: the residual stream of fp32 weights under bf16 autocast; under grad with its backward kernel) and transformers'
own forward otherwise (off Hopper), so off the kernel nothing changes. On the kernel the output is in
``ops.autocast_out_dtype(x)``: under autocast, fp32 rows come out in autocast's dtype, which every projection after a
decoder or final norm casts its input to (transformers' norm returns fp32 there and each projection casts it again;
an MoE block's experts in transformers' grouped_mm implementation, which autocast does not reach, cast their input
to their fp32 weights' dtype, so they see the norm rounded to bf16). The per-head q/k norms read a projection's
output, already in autocast's dtype, so theirs stays their input's.
"""
from __future__ import annotations

from flashqla_kernels.decoder import ops
from flashqla_kernels.patching import families, registry

__all__ = ["ROLE", "GROUP", "NORM_NAMES", "make_forward", "norm_eps", "is_zero_centred_norm"]

ROLE, GROUP = "norm", "norms"
NORM_NAMES = families.class_names(ROLE)  # checked on every layer call: built once


def norm_eps(norm) -> float:
    """A norm module's epsilon (``eps`` or ``variance_epsilon``; 1e-6 where it has neither)."""
    return float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))


def is_zero_centred_norm(module) -> bool:
    """Whether ``module`` is one of the families' zero-centred RMSNorms (by class name)."""
    return type(module).__name__ in NORM_NAMES


def make_forward(original, backend: str | None):
    """The RMSNorm forward replacing ``original``: the kernel where it runs, else transformers'."""
    def forward(self, hidden_states):
        if backend != "torch" and ops.glue_kernel_reason(hidden_states, grad_ok=True, dtypes=ops.ROW_DTYPES) is None and hidden_states.shape[-1] % 64 == 0:
            return ops.rms_norm(hidden_states, self.weight, self.eps, out_dtype=ops.autocast_out_dtype(hidden_states),
                                backend=backend)
        return original(self, hidden_states)

    forward.__doc__ = f"flashqla_kernels RMSNorm (backend={backend!r}): the kernel on sm_90, else transformers'."
    return registry.mark(forward, backend, original)
