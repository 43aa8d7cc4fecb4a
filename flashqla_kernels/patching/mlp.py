"""The families' dense gate/up/down MLPs (the decoder MLP, and the MoE blocks' shared expert; the routed experts are
another module, left alone) with a fused SwiGLU.

The replacement computes ``down_proj(swiglu(x, gate_proj.weight, up_proj.weight))`` on CUDA sm_90 bf16/fp16 tensors
when ``act_fn`` is SiLU: one GEMM for both projections with ``silu(gate) * up`` in its epilogue (``FUSED_MLP_GEMM``),
or, where the projections are not plain hook-free bias-free ``nn.Linear`` modules, the projections' own calls and the
one-pass ``silu(gate) * up`` kernel (the only form under grad: the fused GEMM has no backward, the activation kernel
has); transformers' own forward otherwise.
"""
from __future__ import annotations

import torch

from flashqla_kernels.decoder import hopper, ops
from flashqla_kernels.decoder.gdn_layer import plain_linear_reason
from flashqla_kernels.patching import families, registry

__all__ = ["ROLE", "GROUP", "MLP_NAMES", "FUSED_MLP_GEMM", "make_forward", "kernel_reason", "fused_gemm_reason",
           "activation"]

ROLE = GROUP = "mlp"
MLP_NAMES = families.class_names(ROLE)  # checked on every decoder-layer call: built once
_SILU_TYPES = ("SiLU", "SiLUActivation")  # torch.nn.SiLU, transformers' ACT2FN["silu"]
# The MLP's gate and up projections as one GEMM with the SwiGLU in its epilogue (``ops.swiglu``) where the kernel
# runs and the projections are plain, hook-free, bias-free nn.Linear; off: two cuBLAS GEMMs and the silu_mul kernel.
# On the H200 2.46 ms against 2.67 for the 2B MLP's 32768 x 2048 -> 6144 (benchmarks/swiglu_gemm.py), and the whole
# 2B forward 192.9 K -> 198.8 K tokens/s (benchmarks/gdn_layer.py, ours+silu_mul against ours+swiglu).
FUSED_MLP_GEMM = True


def kernel_reason(mlp, x) -> str | None:
    """Why the MLP takes transformers' forward before any projection runs, or None."""
    act = mlp.act_fn
    if type(act).__name__ not in _SILU_TYPES:
        return f"act_fn {type(act).__name__} is not SiLU"
    if act._forward_hooks or act._forward_pre_hooks:
        return "act_fn has hooks, which the fused activation would skip"
    if mlp.gate_proj.out_features % 64:
        return f"intermediate size {mlp.gate_proj.out_features} is not a multiple of 64"
    # x may be fp32 (the residual stream under autocast): the projections' outputs decide the activation's kernel
    return ops.glue_kernel_reason(x, grad_ok=True, dtypes=ops.ROW_DTYPES)


def fused_gemm_reason(mlp, x=None) -> str | None:
    """Why the MLP's gate and up projections stay two ``nn.Linear`` calls (not the fused SwiGLU GEMM), or None.
    With ``x``, also whatever keeps the kernel off these tensors (trainable weights with grad on, weights in another
    dtype than x as under autocast, an intermediate size the kernel does not tile): the module calls then run as
    without the fused GEMM."""
    if not FUSED_MLP_GEMM:
        return "FUSED_MLP_GEMM is off"
    for name in ("gate_proj", "up_proj"):
        reason = plain_linear_reason(name, getattr(mlp, name))
        if reason is not None:
            return reason
    if x is None:
        return None
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight)
    if any(w.dtype != x.dtype for w in weights):
        return f"weights in {weights[0].dtype} for {x.dtype} activations"
    return ops.glue_kernel_reason(x, *weights) or hopper.swiglu_shape_reason(*weights[0].shape, x.dtype)


def activation(mlp, x, backend: str | None) -> torch.Tensor:
    """``act_fn(gate_proj(x)) * up_proj(x)``, the input of ``down_proj``, for an MLP whose ``kernel_reason`` is
    None: the SwiGLU GEMM, else the projections' module calls and the silu_mul kernel."""
    if fused_gemm_reason(mlp, x) is None:
        return ops.swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, backend=backend)
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    # the projections' outputs decide too (autocast dtype, trainable weights): transformers' expression then
    if ops.glue_kernel_reason(gate, up, grad_ok=True) is not None:
        return mlp.act_fn(gate) * up
    return ops.silu_mul(gate, up, backend=backend)


def make_forward(original, backend: str | None):
    """The MLP forward replacing ``original``: the fused activation where the kernels run, else transformers'."""
    def forward(self, x):
        if backend == "torch" or kernel_reason(self, x) is not None:
            return original(self, x)
        return self.down_proj(activation(self, x, backend))

    forward.__doc__ = f"flashqla_kernels MLP (backend={backend!r}): fused silu(gate) * up on sm_90, else transformers'."
    return registry.mark(forward, backend, original)
