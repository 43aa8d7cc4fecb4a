"""The decoder's glue stages under grad: each forward kernel paired with its backward kernel in a
``torch.autograd.Function``, so a training step (fine-tuning with feature penalties, attribution by gradients) runs
the fused layer instead of the torch formulation's dozens of fp32 elementwise kernels and their saved tensors.

| stage | saved for the backward | backward kernel (``hopper``) |
|---|---|---|
| ``conv_qkv_gates`` (no conv state) | qkv, the conv weight and bias, a, b | ``conv_qkv_bwd``: u = conv(x) recomputed, the l2norm's and SiLU's backward, dx by the transposed conv, dw / dbias as per-CTA partial sums; the gates' backward ([B, T, Hv], a few small torch ops) |
| ``gated_norm`` | o, z, the weight | ``gated_rms_norm_bwd`` |
| ``rms_norm`` / ``add_rms_norm`` | the norm's input (the sum) | ``rms_norm_bwd`` (the residual path's gradient added in the same pass; dy read in the norm's ``out_dtype``) |
| ``silu_mul`` | gate, up | ``silu_mul_bwd`` |

Weight gradients are fp32 sums of per-CTA partial rows in a fixed order (the same bits every run), returned in the
weight's dtype. ``flashqla_kernels.decoder.ops`` calls these when an input requires grad; call them directly only
with inputs the kernels take (CUDA sm_90, bf16 / fp16 activations; fp32 rows too for the RMSNorms, whose norm may be
written in bf16 / fp16 from them: ``out_dtype``, autocast's dtype for the projections after it; the gradient then
comes back in that dtype, and x's gradient leaves in x's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashqla_kernels.decoder import hopper

__all__ = ["conv_qkv_gates", "gated_norm", "rms_norm", "add_rms_norm", "silu_mul", "gates_bwd"]


def gates_bwd(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              dg: torch.Tensor | None, dbeta: torch.Tensor | None):
    """The backward of ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)`` ([B, T, Hv]; fp32 math, fp64
    for fp64).

    Returns:
        (da in a's dtype or None, db in b's dtype or None, dA_log [Hv] or None, ddt_bias [Hv] or None), each None
        where its gradient is (no dg, or no dbeta).
    """
    da = db = dA = ddt = None
    dt = torch.float64 if a.dtype == torch.float64 else torch.float32
    if dg is not None:
        x = a.to(dt) + dt_bias.to(dt)
        decay = -A_log.to(dt).exp()
        dgf = dg.to(dt)
        g = decay * F.softplus(x)
        dx = dgf * decay * torch.sigmoid(x)
        da = dx.to(a.dtype)
        dA = (dgf * g).sum(tuple(range(dgf.dim() - 1))).to(A_log.dtype)
        ddt = dx.sum(tuple(range(dx.dim() - 1))).to(dt_bias.dtype)
    if dbeta is not None:
        beta = torch.sigmoid(b.to(dt))
        db = (dbeta.to(dt) * beta * (1.0 - beta)).to(b.dtype)
    return da, db, dA, ddt


def _zeros_if_none(grad, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


class _ConvQKVGates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, weight, bias, a, b, A_log, dt_bias, Hk, K, Hv, V):
        q, k, v, g, beta = hopper.conv_qkv_gates_fwd(qkv, weight, bias, a, b, A_log, dt_bias, Hk=Hk, K=K, Hv=Hv, V=V)
        ctx.save_for_backward(qkv, weight, bias, a, b, A_log, dt_bias)
        ctx.heads = (Hk, K, Hv)
        return q, k, v, g, beta

    @staticmethod
    def backward(ctx, dq, dk, dv, dg, dbeta):
        qkv, weight, bias, a, b, A_log, dt_bias = ctx.saved_tensors
        Hk, K, Hv = ctx.heads
        need = ctx.needs_input_grad
        dqkv = dw = dbias = None
        if need[0] or need[1] or need[2]:
            B, T = qkv.shape[:2]
            dq = _zeros_if_none(dq, qkv.new_empty((B, T, Hk, K)))
            dk = _zeros_if_none(dk, qkv.new_empty((B, T, Hk, K)))
            dv = _zeros_if_none(dv, qkv.new_empty((B, T, Hv, K)))
            dqkv, dw, dbias = hopper.conv_qkv_bwd(qkv, weight, bias, dq, dk, dv, Hk=Hk, K=K, Hv=Hv)
            dw = dw.to(weight.dtype)
            dbias = dbias.to(bias.dtype) if dbias is not None else None
        da, db, dA, ddt = gates_bwd(a, b, A_log, dt_bias, dg, dbeta)
        return (dqkv if need[0] else None, dw if need[1] else None, dbias if need[2] else None,
                da if need[3] else None, db if need[4] else None, dA if need[5] else None,
                ddt if need[6] else None, None, None, None, None)


def conv_qkv_gates(qkv, weight, bias, a, b, A_log, dt_bias, *, Hk: int, K: int, Hv: int, V: int):
    """``ops.conv_qkv_gates`` (no conv state) with its backward on the kernels. Same Args / Returns."""
    return _ConvQKVGates.apply(qkv, weight, bias, a, b, A_log, dt_bias, Hk, K, Hv, V)


class _GatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, z, weight, eps):
        ctx.save_for_backward(o, z, weight)
        ctx.eps = eps
        return hopper.gated_rms_norm_fwd(o, z, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        o, z, weight = ctx.saved_tensors
        do, dz, dw = hopper.gated_rms_norm_bwd(o, z, weight, ctx.eps, dy)
        return do, dz.to(z.dtype), dw.to(weight.dtype), None


def gated_norm(o, z, weight, eps: float):
    """``ops.gated_norm`` with its backward on the kernels."""
    return _GatedNorm.apply(o, z, weight, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return hopper.rms_norm_fwd(x, weight, eps, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, dy):
        # dy comes in y's dtype (autograd casts it so), which the backward kernel reads as is
        x, weight = ctx.saved_tensors
        dx, dw = hopper.rms_norm_bwd(x, weight, ctx.eps, dy)
        return dx, dw.to(weight.dtype), None, None


def rms_norm(x, weight, eps: float, *, out_dtype: torch.dtype | None = None):
    """``ops.rms_norm`` with its backward on the kernels (y in ``out_dtype``, None: x's; dx in x's dtype)."""
    return _RMSNorm.apply(x, weight, eps, out_dtype)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, weight, eps, out_dtype):
        s, y = hopper.add_rms_norm_fwd(a, b, weight, eps, out_dtype=out_dtype)
        ctx.save_for_backward(s, weight)
        ctx.eps, ctx.b_dtype = eps, b.dtype
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight = ctx.saved_tensors
        if dy is None:  # only the sum was used
            return ds, ds.to(ctx.b_dtype), None, None, None
        dsum, dw = hopper.rms_norm_bwd(s, weight, ctx.eps, dy, ds)
        # the sum's gradient is each addend's (as the backward of torch's own add returns it), in the addend's dtype
        return dsum, dsum.to(ctx.b_dtype), dw.to(weight.dtype), None, None


def add_rms_norm(a, b, weight, eps: float, *, out_dtype: torch.dtype | None = None):
    """``ops.add_rms_norm`` with its backward on the kernels: (s in a's dtype, rms_norm(s) in ``out_dtype``, None:
    a's)."""
    return _AddRMSNorm.apply(a, b, weight, eps, out_dtype)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return hopper.silu_mul_fwd(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return hopper.silu_mul_bwd(gate, up, dout)


def silu_mul(gate, up):
    """``ops.silu_mul`` with its backward on the kernels."""
    return _SiluMul.apply(gate, up)
