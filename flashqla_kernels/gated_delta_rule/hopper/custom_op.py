"""The Hopper chunked gated delta rule as ``torch.library`` custom ops with autograd: the forward launcher
(``forward.chunk_gated_delta_rule_fwd``) as ``flashqla_kernels::chunk_gated_delta_rule``, the backward launcher
(``backward.chunk_gated_delta_rule_bwd``) as ``flashqla_kernels::chunk_gated_delta_rule_bwd``, joined by
``register_autograd``.

Why custom ops and not a bare ``autograd.Function``: ``torch.compile`` traces a custom op as one node (from its fake
implementation) instead of graph-breaking inside the launchers, and AOTAutograd places its backward in the compiled
backward graph.

Saved for the backward: the forward's inputs (q, k, v, g, beta, initial_state, cu_seqlens), from which the
backward would recompute the per-chunk states h and v_new (as FlashQLA does), and with ``SAVE_STATES`` on (the
default) those states themselves: the forward's chunk step writes them beside o (``chunk_fwd``'s ``save_states``) and
the backward skips its states pass (``backward``'s docstring). On the H200 that made forward + backward 1.25x faster
at 16/32 8192x1 and 1-2% faster on the 32K-token rows, with bit-identical gradients. gamma and Ag (``kkt_solve``'s
outputs, which the forward computes anyway) are kept with them, so the backward skips its kkt_solve too. Saving
costs memory until the backward: h is [chunks, Hv, K, V] in q's dtype, K V / 32 bytes a token and value head (1 KB
at K = V = 128; 268 MB for 32K tokens of 32 heads), v_new [T, Hv, V], gamma and Ag 132 bytes a token and value
head. Set ``SAVE_STATES = False`` where that memory matters more. Not twice differentiable.

The public op (``api.chunk_gated_delta_rule``) calls these under grad and under ``torch.compile``; an eager call
without grad calls the launcher directly (the dispatcher's Python costs more than the op on short inputs).
Importing this module registers the ops; it touches neither CUDA nor tilelang.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flashqla_kernels.gated_delta_rule.hopper import backward, forward
from flashqla_kernels.gated_delta_rule.hopper.plan import CHUNK

__all__ = ["chunk_gated_delta_rule", "SAVE_STATES"]

# save the per-chunk states in the forward under grad (faster backward) or recompute them (less memory)
SAVE_STATES = True


def _num_seqs(q: Tensor, cu_seqlens: Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.custom_op("flashqla_kernels::chunk_gated_delta_rule", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                cu_seqlens: Tensor | None, scale: float, output_final_state: bool,
                use_qk_l2norm_in_kernel: bool, save_states: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    o, ht, *states = forward.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, save_states=save_states,
        checked=True)
    # a custom op returns tensors only: no final state (no saved states) is an empty one
    if not save_states:
        states = [q.new_empty((0,)), q.new_empty((0,)), q.new_empty((0,), dtype=torch.float32),
                  q.new_empty((0,), dtype=torch.float16)]
    return o, (ht if ht is not None else q.new_empty((0,), dtype=torch.float32)), *states


def _saved_shapes(q, k, v, cu_seqlens) -> tuple[tuple, tuple, tuple, tuple]:
    B, Tn, Hv = q.shape[0], q.shape[1], v.shape[2]
    Kp, Vp = forward.padded_head_dim(k.shape[3]) or k.shape[3], forward.padded_head_dim(v.shape[3]) or v.shape[3]
    return ((forward.saved_chunks(B, Tn, _num_seqs(q, cu_seqlens)), Hv, Kp, Vp), (B * Tn, Hv, Vp), (B * Tn, Hv),
            (B * Tn, Hv, CHUNK))


@_forward_op.register_fake
def _forward_fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel,
                  save_states):
    Hv, K, V = v.shape[2], k.shape[3], v.shape[3]
    ht_shape = (_num_seqs(q, cu_seqlens), Hv, K, V) if output_final_state else (0,)
    h_shape, vn_shape, g_shape, ag_shape = (_saved_shapes(q, k, v, cu_seqlens) if save_states
                                            else ((0,), (0,), (0,), (0,)))
    return (v.new_empty(v.shape, dtype=q.dtype), q.new_empty(ht_shape, dtype=torch.float32), q.new_empty(h_shape),
            q.new_empty(vn_shape), q.new_empty(g_shape, dtype=torch.float32),
            q.new_empty(ag_shape, dtype=torch.float16))


@torch.library.custom_op("flashqla_kernels::chunk_gated_delta_rule_bwd", mutates_args=())
def _backward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, do: Tensor, dht: Tensor | None,
                 initial_state: Tensor | None, cu_seqlens: Tensor | None, h: Tensor | None, v_new: Tensor | None,
                 gamma: Tensor | None, ag: Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dg, dbeta, dh0 = backward.chunk_gated_delta_rule_bwd(
        q, k, v, g, beta, do, dht, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, states=None if h is None else (h, v_new, gamma, ag))
    return dq, dk, dv, dg, dbeta, (dh0 if dh0 is not None else q.new_empty((0,), dtype=torch.float32))


@_backward_op.register_fake
def _backward_fake(q, k, v, g, beta, do, dht, initial_state, cu_seqlens, h, v_new, gamma, ag, scale,
                   use_qk_l2norm_in_kernel):
    dh0_shape = tuple(initial_state.shape) if initial_state is not None else (0,)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), q.new_empty(dh0_shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, l2norm, save_states = inputs
    _, _, *states = output
    ctx.mark_non_differentiable(*states)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *(states if save_states else ()))
    ctx.scale, ctx.output_final_state, ctx.l2norm = scale, output_final_state, l2norm


def _backward(ctx, do, dht, _dh, _dv_new, _dgamma, _dag):
    q, k, v, g, beta, initial_state, cu_seqlens, *states = ctx.saved_tensors
    h, v_new, gamma, ag = states if states else (None, None, None, None)
    if do is None:  # only the final state was used
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dbeta, dh0 = _backward_op(q, k, v, g, beta, do, dht, initial_state, cu_seqlens, h, v_new,
                                              gamma, ag, ctx.scale, ctx.l2norm)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else None
    return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None


torch.library.register_autograd("flashqla_kernels::chunk_gated_delta_rule", _backward, setup_context=_setup_context)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The Hopper forward through the differentiable custom op.

    Args:
        As ``forward.chunk_gated_delta_rule_fwd`` (inputs the kernels take: the caller has checked them), scale
        resolved to a float.

    Returns:
        (o [B, T, Hv, V] in q's dtype, final state [N, Hv, K, V] fp32 or None); gradients flow to q, k, v, g, beta
        and initial_state through the Hopper backward.

    Example:
        >>> o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=128 ** -0.5, output_final_state=True)
        >>> torch.autograd.backward((o, ht), (do, dht))
    """
    save = SAVE_STATES and torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    o, ht, *_ = _forward_op(q, k, v, g, beta, initial_state, cu_seqlens, float(scale), bool(output_final_state),
                            bool(use_qk_l2norm_in_kernel), save)
    return o, (ht if output_final_state else None)
