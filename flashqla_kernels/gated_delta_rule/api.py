"""The public op: FLA/FlashQLA-compatible ``chunk_gated_delta_rule`` and the ``recurrent_gated_delta_rule`` decode
step, dispatched between the TileLang Hopper kernels and the torch path by verifiers that return reasons.

Dispatch (``backend=None``): the TileLang kernels when every verifier passes (CUDA tensors on sm_90, dtypes and head
dims the kernels support, no input requiring grad), else the torch path. ``backend="torch"`` always runs the torch
path; ``backend="tilelang"`` runs the kernels or raises one ``ValueError`` naming the reason. Inputs that require grad
fall back to the differentiable torch path with a one-time warning (no backward kernel yet).
``explain_backend(...)`` returns the decision and every reason as text.

The Hopper module is imported lazily, only for CUDA tensors: importing this module touches neither CUDA nor tilelang.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass

import torch

from flashqla_kernels.gated_delta_rule.checks import check_inputs, resolve_scale
from flashqla_kernels.gated_delta_rule.torch_path import (
    chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_torch,
)

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "explain_backend", "BACKENDS", "Decision"]

BACKENDS = ("torch", "tilelang")
_HOPPER_MODULE = "flashqla_kernels.gated_delta_rule.hopper"
_warned_grad = False


def _needs_grad(*xs: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def _tilelang_reason(q, k, v, g, beta, initial_state, cu_seqlens) -> str | None:
    """Why the TileLang kernels cannot run these inputs (grad aside), or None."""
    if not q.is_cuda:
        return f"tensors are on {q.device}; the TileLang kernels run on CUDA tensors (sm_90) only"
    if q.shape[1] == 0:
        return "T = 0: there is nothing to compute"
    try:
        hopper = importlib.import_module(_HOPPER_MODULE)
    except Exception as err:  # the kernels are optional: a broken tilelang install must not break the op
        return f"{_HOPPER_MODULE} failed to import ({type(err).__name__}: {err})"
    if not hasattr(hopper, "unsupported_reason") or not hasattr(hopper, "chunk_gated_delta_rule_fwd"):
        return f"{_HOPPER_MODULE} lacks chunk_gated_delta_rule_fwd / unsupported_reason"
    return hopper.unsupported_reason(q, k, v, g, beta, initial_state, cu_seqlens)


@dataclass(frozen=True)
class Decision:
    """The dispatcher's choice: ``backend`` ("torch" / "tilelang"), one line per reason, and whether the torch path
    was chosen only because an input requires grad."""

    backend: str
    reasons: tuple[str, ...]
    grad_fallback: bool = False


def _decide(op: str, backend: str | None, q, k, v, g, beta, initial_state, cu_seqlens) -> Decision:
    """Pick the backend. Raises ValueError for an unknown backend or a forced one that cannot run."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of None, 'torch', 'tilelang'; got {backend!r}")
    if backend == "torch":
        return Decision("torch", ("torch: requested with backend='torch'",))
    if op == "recurrent":
        reason = "there is no TileLang decode kernel yet; the decode step runs on the torch path"
    else:
        reason = _tilelang_reason(q, k, v, g, beta, initial_state, cu_seqlens)
    if reason is not None:
        if backend == "tilelang":
            raise ValueError(f"backend='tilelang' cannot run {op}_gated_delta_rule on these inputs: {reason}. "
                             "Pass backend=None to fall back to the torch path automatically.")
        return Decision("torch", (f"tilelang: not used: {reason}", "torch: runs everything the op supports"))
    if _needs_grad(q, k, v, g, beta, initial_state):
        if backend == "tilelang":
            raise ValueError(f"backend='tilelang' cannot run {op}_gated_delta_rule on these inputs: an input requires "
                             "grad and the TileLang kernels are forward-only (no backward kernel yet). Run under "
                             "torch.no_grad() / detach the inputs, or pass backend=None for the differentiable torch "
                             "path.")
        return Decision("torch", ("tilelang: not used: an input requires grad and there is no backward kernel yet",
                                  "torch: differentiable fallback"), grad_fallback=True)
    return Decision("tilelang", ("tilelang: all verifiers passed",))


def _warn_grad_once() -> None:
    global _warned_grad
    if not _warned_grad:
        _warned_grad = True
        warnings.warn("flashqla_kernels: inputs require grad and the TileLang kernels are forward-only; running the "
                      "differentiable torch path instead (slower). Wrap inference in torch.no_grad() to use the "
                      "kernels. This warning is shown once.", UserWarning, stacklevel=3)


def explain_backend(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend=None, op: str = "chunk") -> str:
    """Which backend ``chunk_gated_delta_rule`` (``op="chunk"``) or ``recurrent_gated_delta_rule``
    (``op="recurrent"``) would use for these arguments, and why. Same arguments as the op.

    Returns:
        Multi-line text: ``"backend: torch"`` then one line per backend considered.

    Example:
        >>> print(explain_backend(q, k, v, g, beta))
        backend: torch
          tilelang: not used: tensors are on cpu; the TileLang kernels run on CUDA tensors (sm_90) only
          torch: runs everything the op supports
    """
    if op not in ("chunk", "recurrent"):
        raise ValueError(f"op must be 'chunk' or 'recurrent'; got {op!r}")
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    try:
        decision = _decide(op, backend, q, k, v, g, beta, initial_state, cu_seqlens)
    except ValueError as err:
        return f"error: {err}"
    return "\n".join([f"backend: {decision.backend}", *("  " + line for line in decision.reasons)])


def _tilelang_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    cu_seqlens):
    hopper = importlib.import_module(_HOPPER_MODULE)
    return hopper.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=resolve_scale(scale, k.shape[-1]), initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens)


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
        (o [B, T, Hv, V] in q.dtype, final_state [N, Hv, K, V] fp32 (fp64 for fp64 inputs) or None).

    Example:
        >>> o, state = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
        ...                                   output_final_state=True)
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    decision = _decide("chunk", backend, q, k, v, g, beta, initial_state, cu_seqlens)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    if decision.backend == "tilelang":
        return _tilelang_chunk(*args)
    if decision.grad_fallback:
        _warn_grad_once()
    return chunk_gated_delta_rule_torch(*args)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend=None):
    """Token-by-token gated delta rule: the decode step of generation (T = 1), fine for short T.

    Same conventions, Args and Returns as ``chunk_gated_delta_rule``; runs the torch path on every device
    (``backend="tilelang"`` raises: there is no TileLang decode kernel yet).

    Example:
        >>> o, state = recurrent_gated_delta_rule(q_t, k_t, v_t, g_t, beta_t, initial_state=state,
        ...                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    _decide("recurrent", backend, q, k, v, g, beta, initial_state, cu_seqlens)
    return recurrent_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
                                            use_qk_l2norm_in_kernel, cu_seqlens)
