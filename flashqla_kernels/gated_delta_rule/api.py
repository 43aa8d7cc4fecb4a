"""The public op: FLA/FlashQLA-compatible ``chunk_gated_delta_rule`` and the ``recurrent_gated_delta_rule`` decode
step, dispatched between the TileLang Hopper kernels and the torch path by ``flashqla_kernels.dispatch``.

Dispatch (``backend=None``): the TileLang kernels when every verifier passes (CUDA tensors on an sm_90 GPU, the
dtypes, head dims and shapes the kernels take, T > 0), else the torch path. ``backend="torch"`` always runs the torch
path; ``backend="tilelang"`` runs the kernels or raises one ``ValueError`` naming the reason.
``explain_backend(...)`` returns the decision and every reason as text.

Gradients: the chunk op's kernels have a Hopper backward, so under grad (and under ``torch.compile``) the kernel path
runs through the differentiable custom op ``flashqla_kernels::chunk_gated_delta_rule`` (``hopper.custom_op``); an
eager call without grad calls the forward launcher directly. The recurrent kernel is forward-only: a recurrent call
whose inputs require grad falls back to the differentiable torch path with a one-time warning.

The Hopper launcher is imported inside the functions that need it: importing this module touches neither CUDA nor
tilelang (nor does importing the launcher: its stage modules load tilelang on the first kernel call).
"""
from __future__ import annotations

import functools
import warnings

import torch

from flashqla_kernels import dispatch
from flashqla_kernels.gated_delta_rule.checks import check_inputs, resolve_scale
from flashqla_kernels.gated_delta_rule.torch_path import (
    chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_torch,
)

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "explain_backend"]

OPS = {"chunk": "chunk_gated_delta_rule", "recurrent": "recurrent_gated_delta_rule"}
RECURRENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_warned_grad = False


def _verifiers(op: str, q, k, v, g, beta, initial_state, cu_seqlens) -> tuple:
    """The kernels' verifiers for ``op`` ("chunk" or "recurrent"), in the order the dispatcher runs them."""
    if op == "recurrent":
        return (lambda: dispatch.hopper_reason(q, k, v, g, beta, initial_state),
                lambda: _recurrent_dtype_reason(q, k, v),
                lambda: "T = 0: there is nothing to compute" if q.shape[1] == 0 else None,
                lambda: _recurrent_shape_reason(k.shape[-1], v.shape[-1]))

    def kernel_reason():
        return _hopper()[1].unsupported_reason(q, k, v, g, beta, initial_state, cu_seqlens)

    return (lambda: dispatch.hopper_reason(q, k, v, g, beta, initial_state),
            lambda: "T = 0: there is nothing to compute" if q.shape[1] == 0 else None,
            kernel_reason)


def _recurrent_dtype_reason(q, k, v) -> str | None:
    if any(x.dtype not in RECURRENT_DTYPES for x in (q, k, v)):
        return (f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: the recurrent kernel takes bfloat16, float16 or "
                "float32 (float64 runs the torch path)")
    return None


def _recurrent_shape_reason(K: int, V: int) -> str | None:
    from flashqla_kernels.gated_delta_rule.hopper import recurrent

    return recurrent.shape_reason(K, V)


def _grad_tensors(op: str, q, k, v, g, beta, initial_state) -> tuple:
    # the tensors whose requiring grad sends a call to the torch path: none for the chunk op (it has a backward)
    return () if op == "chunk" else (q, k, v, g, beta, initial_state)


def _decide(op: str, backend, q, k, v, g, beta, initial_state, cu_seqlens) -> dispatch.Decision:
    return dispatch.decide(OPS[op], backend, *_verifiers(op, q, k, v, g, beta, initial_state, cu_seqlens),
                           grad=_grad_tensors(op, q, k, v, g, beta, initial_state))


def _warn_grad_once() -> None:
    global _warned_grad
    if not _warned_grad:
        _warned_grad = True
        warnings.warn("flashqla_kernels: inputs require grad and the recurrent TileLang kernel is forward-only; "
                      "running the differentiable torch path instead (slower). Use chunk_gated_delta_rule for "
                      "training, or wrap decoding in torch.no_grad(). This warning is shown once.", UserWarning,
                      stacklevel=3)


def explain_backend(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend=None, op: str = "chunk") -> str:
    """Which backend ``chunk_gated_delta_rule`` (``op="chunk"``) or ``recurrent_gated_delta_rule``
    (``op="recurrent"``) would use for these arguments, and why. Same arguments as the op.

    Returns:
        Multi-line text: ``"<op>: backend <name>"`` then one line per backend considered, or
        ``"<op>: error: ..."`` where the call would raise.

    Example:
        >>> print(explain_backend(q, k, v, g, beta))
        chunk_gated_delta_rule: backend torch
          tilelang: not used: tensors are on cpu; the TileLang kernels run on CUDA tensors of an sm_90 GPU only
          torch: runs every input the op accepts
    """
    if op not in OPS:
        raise ValueError(f"op must be 'chunk' or 'recurrent'; got {op!r}")
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return dispatch.explain(OPS[op], backend, *_verifiers(op, q, k, v, g, beta, initial_state, cu_seqlens),
                            grad=_grad_tensors(op, q, k, v, g, beta, initial_state))


def _needs_autograd(*tensors) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _tilelang_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    cu_seqlens):
    custom_op, forward = _hopper()
    kwargs = dict(scale=resolve_scale(scale, k.shape[-1]), initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens)
    if _needs_autograd(q, k, v, g, beta, initial_state) or torch.compiler.is_compiling():
        return custom_op.chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    # the dispatcher has run the launcher's own checks (forward.unsupported_reason)
    return forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kwargs, checked=True)


@functools.cache
def _hopper():
    # imported on the first kernel call, then kept: an import statement costs microseconds of host time a call
    from flashqla_kernels.gated_delta_rule.hopper import custom_op, forward

    return custom_op, forward


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend=None):
    """Gated delta rule forward over whole sequences (prefill), FLA/FlashQLA-compatible.

    Per value head h (reading q/k head h // (Hv/Hk)): ``S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T;
    o_t = scale S^T q_t``.

    Args:
        q, k: [B, T, Hk, K] (bf16/fp16/fp32/fp64, any strides). v: [B, T, Hv, V], Hv a multiple of Hk.
        g: [B, T, Hv] per-token log decay (<= 0, fp32 recommended; not cumsummed). beta: [B, T, Hv].
        scale: output scale; default K^-0.5, applied after the optional l2norm.
        initial_state: [N, Hv, K, V] (fp32) or None for zeros. output_final_state: also return the final state.
        use_qk_l2norm_in_kernel: l2-normalise q and k (eps 1e-6) first, as Qwen3.5 / Qwen3-Next do.
        cu_seqlens: [N+1] int offsets of sequences packed along T (B must be 1), or None for N = B sequences.
        backend: None (automatic), "torch" or "tilelang"; see ``explain_backend``.

    Returns:
        (o [B, T, Hv, V] in q.dtype, final_state [N, Hv, K, V] fp32 (fp64 for fp64 inputs) or None). Both are
        differentiable in q, k, v, g, beta and initial_state on either backend (the kernels' Hopper backward, or
        autograd through the torch path).

    Example:
        >>> o, state = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
        ...                                   output_final_state=True)
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    decision = _decide("chunk", backend, q, k, v, g, beta, initial_state, cu_seqlens)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    if decision.kernel:
        return _tilelang_chunk(*args)
    return chunk_gated_delta_rule_torch(*args)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend=None):
    """Token-by-token gated delta rule: the decode step of generation (T = 1), fine for short T.

    Same conventions, Args and Returns as ``chunk_gated_delta_rule``. On an sm_90 GPU it runs the fused TileLang
    recurrent kernel (``hopper.recurrent``: the state in registers, read once and written once per sequence, the
    l2norm folded in; bf16 / fp16 / fp32 inputs), else the torch path.

    Example:
        >>> o, state = recurrent_gated_delta_rule(q_t, k_t, v_t, g_t, beta_t, initial_state=state,
        ...                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    decision = _decide("recurrent", backend, q, k, v, g, beta, initial_state, cu_seqlens)
    if decision.kernel:
        from flashqla_kernels.gated_delta_rule.hopper import recurrent

        dt = q.dtype
        return recurrent.fused_recurrent(
            q.to(dt).contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous(), g.float().contiguous(),
            beta.float().contiguous(), resolve_scale(scale, k.shape[-1]),
            None if initial_state is None else initial_state.float().contiguous(), output_final_state,
            use_qk_l2norm_in_kernel, None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous())
    if decision.grad_fallback:
        _warn_grad_once()
    return recurrent_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
                                            use_qk_l2norm_in_kernel, cu_seqlens)
