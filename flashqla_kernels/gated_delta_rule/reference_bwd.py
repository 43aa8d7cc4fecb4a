"""Float64-capable reference of the chunked gated delta rule's backward, one function per stage.

The backward of ``chunk_gated_delta_rule_ref`` written out by hand (no autograd), in the chunked form of the forward
(C = 64, chunks restart at every sequence start), so that each backward kernel stage can be tested against its own
reference. Per chunk, with S the state entering it, dS' the gradient of the state leaving it, dO the output's
gradient, Gamma_ij = exp(gamma_i - gamma_j) for i >= j (else 0) and P = scale (Q K^T * Gamma):

    chunk_bwd_recompute_ref     gamma, A, w, u, h, v_new from the forward's stage references
    chunk_bwd_dv_local_ref      dv_local = P^T dO                                                [B, T, Hv, V]
    chunk_bwd_dh_ref            dv = dv_local + exp(gamma_C - gamma) K dS', and back over the chunks
                                dS = exp(gamma_C) dS' + scale Q^T exp(gamma) dO - w^T dv
    chunk_bwd_dqkwg_ref         dq = scale exp(gamma) dO S^T + (scale dO v_new^T * Gamma) K
                                dk = (scale dO v_new^T * Gamma)^T Q + exp(gamma_C - gamma) v_new dS'^T, dw = -dv S^T
                                dgamma = rowsum(dq q) - rowsum(dk k); the last token adds exp(gamma_C) <S, dS'>
                                and sum(dk_state k), dk_state being dk's second term
    chunk_bwd_wy_ref            through w = A diag(beta exp(gamma)) K, u = A diag(beta) V, A = (I + StrictLower(M))^-1:
                                dM = StrictLower(-A^T (dw (beta exp(gamma) K)^T + du (beta V)^T) A^T)
                                -> dk, dv, dbeta, dgamma
    chunk_local_cumsum_bwd_ref  dg = reverse cumsum of dgamma within each chunk
    chunk_bwd_step_ref          all of one chunk's gradients from S and dS' alone, and dS: the step of a fused walk
    gva_reduce_ref              dq, dk per value head summed over each key head's group        [B, T, Hk, K]
    l2norm_bwd_ref              dx = r (dy - (y . dy) y), y = r x, r = rsqrt(sum(x^2) + eps)

Layouts follow ``reference.py``: stages take q/k l2-normalised and unscaled, with Hk or Hv heads (expanded inside),
and return per value head; chunk index layout NT as there (per batch row dense, over all sequences varlen). Tokens
after cu_seqlens[-1] (a padded tail) belong to no chunk: every gradient there is exactly 0.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from flashqla_kernels.gated_delta_rule.checks import check_inputs, resolve_scale, sequence_spans
from flashqla_kernels.gated_delta_rule.reference import (
    CHUNK_SIZE, compute_dtype, decay_matrix, expand_heads, num_chunks, chunk_local_cumsum_ref, chunk_spans,
    chunk_states_ref, kkt_inverse_ref, l2norm, recompute_w_u_ref,
)

__all__ = [
    "ChunkForwardSaved", "chunk_gated_delta_rule_bwd_ref", "chunk_bwd_recompute_ref", "chunk_bwd_dv_local_ref",
    "chunk_bwd_dh_ref", "chunk_bwd_dqkwg_ref", "chunk_bwd_wy_ref", "chunk_local_cumsum_bwd_ref", "gva_reduce_ref",
    "l2norm_bwd_ref", "chunk_bwd_step_ref",
]


class ChunkForwardSaved(NamedTuple):
    """What the backward recomputes from the forward (FLA saves q, k, v, gamma, beta, A, h0 and recomputes the rest)."""

    gamma: torch.Tensor  # [B, T, Hv]
    A: torch.Tensor  # [B, T, Hv, C] gated
    w: torch.Tensor  # [B, T, Hv, K]
    u: torch.Tensor  # [B, T, Hv, V]
    h: torch.Tensor  # [B, NT, Hv, K, V] state entering each chunk
    v_new: torch.Tensor  # [B, T, Hv, V]


def chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The backward of ``chunk_gated_delta_rule_ref``, composed from the stage references below.

    Args:
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens: as the forward (raw g, not
            cumsummed; q/k before the optional l2norm). do: [B, T, Hv, V] gradient of o.
        dht: [N, Hv, K, V] gradient of the final state, or None (zeros).

    Returns:
        (dq [B, T, Hk, K], dk [B, T, Hk, K], dv [B, T, Hv, V], dg [B, T, Hv] for the raw g, dbeta [B, T, Hv],
        dh0 [N, Hv, K, V] or None without initial_state), in the compute dtype (promoted, >= float32). Equal to
        autograd of ``recurrent_gated_delta_rule_ref`` of ``<o, do> + <final_state, dht>`` (~1e-13 in float64).

    Example:
        >>> dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht,
        ...                                                              initial_state=h0, use_qk_l2norm_in_kernel=True)
    """
    N = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    _check_grads(k, v, do, dht, N)
    dtype = compute_dtype(q, k, v, g, beta, initial_state, do, dht)
    Hk, Hv = k.shape[2], v.shape[2]
    q_raw, k_raw = q.to(dtype), k.to(dtype)
    qn, kn = (l2norm(q_raw), l2norm(k_raw)) if use_qk_l2norm_in_kernel else (q_raw, k_raw)
    qn, kn = expand_heads(qn, Hv), expand_heads(kn, Hv)
    v, g, beta, do = v.to(dtype), g.to(dtype), beta.to(dtype), do.to(dtype)
    scale = resolve_scale(scale, k.shape[-1])
    h0 = initial_state.to(dtype) if initial_state is not None else None
    dht = dht.to(dtype) if dht is not None else None

    fwd = chunk_bwd_recompute_ref(kn, v, g, beta, h0, cu_seqlens)
    dv_local = chunk_bwd_dv_local_ref(qn, kn, do, fwd.gamma, scale, cu_seqlens)
    dh, dv_new, dh0 = chunk_bwd_dh_ref(qn, kn, fwd.w, do, dv_local, fwd.gamma, scale, dht, cu_seqlens)
    dq, dk, dw, dgamma = chunk_bwd_dqkwg_ref(qn, kn, fwd.v_new, fwd.w, fwd.h, dh, do, dv_new, fwd.gamma, scale,
                                             cu_seqlens)
    dk_wy, dv, dbeta, dgamma_wy = chunk_bwd_wy_ref(kn, v, beta, fwd.A, fwd.gamma, dw, dv_new, cu_seqlens)
    dg = chunk_local_cumsum_bwd_ref(dgamma + dgamma_wy, cu_seqlens)
    dq, dk = gva_reduce_ref(dq, Hk), gva_reduce_ref(dk + dk_wy, Hk)
    if use_qk_l2norm_in_kernel:
        dq, dk = l2norm_bwd_ref(q_raw, dq), l2norm_bwd_ref(k_raw, dk)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None)


def _check_grads(k, v, do, dht, N):
    B, T, _, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    if not isinstance(do, torch.Tensor) or tuple(do.shape) != (B, T, Hv, V):
        raise ValueError(f"do must be the gradient of o, [B, T, Hv, V] = [{B},{T},{Hv},{V}]; got "
                         f"{list(do.shape) if isinstance(do, torch.Tensor) else type(do).__name__}")
    if dht is not None and tuple(dht.shape) != (N, Hv, K, V):
        raise ValueError(f"dht must be the gradient of the final state, [N, Hv, K, V] = [{N},{Hv},{K},{V}]; got "
                         f"{list(dht.shape)} (pass None for zeros)")


def chunk_bwd_recompute_ref(k, v, g, beta, initial_state=None, cu_seqlens=None,
                            chunk_size: int = CHUNK_SIZE) -> ChunkForwardSaved:
    """The forward's intermediates the backward reads, from the forward stage references.

    Args:
        k: [B, T, Hk or Hv, K] (l2-normalised if the op normalises). v: [B, T, Hv, V]. g (raw), beta: [B, T, Hv].
        initial_state: [N, Hv, K, V] or None.

    Returns:
        ``ChunkForwardSaved(gamma, A, w, u, h, v_new)``: gamma [B, T, Hv], gated A [B, T, Hv, C], w [B, T, Hv, K],
        u and v_new [B, T, Hv, V], h [B, NT, Hv, K, V] the state entering each chunk.
    """
    gamma = chunk_local_cumsum_ref(g, cu_seqlens, chunk_size)
    A = kkt_inverse_ref(k, beta, gamma, cu_seqlens, chunk_size)
    w, u = recompute_w_u_ref(k, v, beta, A, gamma, cu_seqlens, chunk_size)
    h, v_new, _ = chunk_states_ref(k, w, u, gamma, initial_state, cu_seqlens, chunk_size)
    return ChunkForwardSaved(gamma, A, w, u, h, v_new)


def chunk_bwd_dv_local_ref(q, k, do, g_cumsum, scale, cu_seqlens=None, chunk_size: int = CHUNK_SIZE):
    """FLA's ``chunk_bwd_dv_local``: the intra-chunk part of dv_new, ``dv_local = scale (Q K^T * Gamma)^T dO``.

    Args:
        q, k: [B, T, Hk or Hv, K]. do: [B, T, Hv, V]. g_cumsum: [B, T, Hv]. scale: float.

    Returns:
        dv_local [B, T, Hv, V] (upper triangle of each chunk: token j gathers dO of tokens i >= j).
    """
    B, T, Hv, _ = do.shape
    q, k = expand_heads(q, Hv), expand_heads(k, Hv)
    dv = torch.zeros_like(do)
    for b, _, _, s, e in chunk_spans(B, T, cu_seqlens, chunk_size):
        P = torch.einsum("ihk,jhk->hij", q[b, s:e], k[b, s:e]) * decay_matrix(g_cumsum[b, s:e], strict=False)
        dv[b, s:e] = scale * torch.einsum("hij,ihv->jhv", P, do[b, s:e])
    return dv


def chunk_bwd_dh_ref(q, k, w, do, dv_local, g_cumsum, scale, dht=None, cu_seqlens=None,
                     chunk_size: int = CHUNK_SIZE):
    """FLA's ``chunk_gated_delta_rule_bwd_dhu``: the state gradient carried backwards over the chunks of each sequence.

    Starting from dS' = dht (or 0) at a sequence's last chunk and going back to its first, per chunk:
    ``dv = dv_local + exp(gamma_C - gamma) K dS'``, then ``dS = exp(gamma_C) dS' + scale Q^T exp(gamma) dO - w^T dv``
    becomes dS' of the chunk before. Sequences never exchange gradients.

    Args:
        q, k: [B, T, Hk or Hv, K]. w: [B, T, Hv, K]. do, dv_local: [B, T, Hv, V]. g_cumsum: [B, T, Hv].
        dht: [N, Hv, K, V] or None (zeros).

    Returns:
        (dh [B, NT, Hv, K, V] the gradient of the state *leaving* each chunk (FLA's dh; pairs with h, the state
        entering it), dv [B, T, Hv, V] the full gradient of v_new (and of u), dh0 [N, Hv, K, V]).
    """
    B, T, Hv, V = do.shape
    q, k = expand_heads(q, Hv), expand_heads(k, Hv)
    K = k.shape[-1]
    dh = k.new_zeros(B, num_chunks(B, T, cu_seqlens, chunk_size), Hv, K, V)
    dv = torch.zeros_like(dv_local)
    N = len(sequence_spans(B, T, cu_seqlens))
    grads = [dht[n] if dht is not None else k.new_zeros(Hv, K, V) for n in range(N)]
    # chunk_spans lists each sequence's chunks in order, so reversed() walks every sequence from its end
    for b, n, i, s, e in reversed(chunk_spans(B, T, cu_seqlens, chunk_size)):
        dS, gc = grads[n], g_cumsum[b, s:e]
        dh[b, i] = dS
        decay_to_end = (gc[-1:] - gc).exp()  # [L, Hv]
        dvc = dv_local[b, s:e] + decay_to_end[:, :, None] * torch.einsum("ihk,hkv->ihv", k[b, s:e], dS)
        dv[b, s:e] = dvc
        grads[n] = (gc[-1].exp()[:, None, None] * dS
                    + scale * torch.einsum("ihk,ih,ihv->hkv", q[b, s:e], gc.exp(), do[b, s:e])
                    - torch.einsum("ihk,ihv->hkv", w[b, s:e], dvc))
    dh0 = torch.stack(grads) if grads else k.new_zeros(0, Hv, K, V)
    return dh, dv, dh0


def chunk_bwd_dqkwg_ref(q, k, v_new, w, h, dh, do, dv, g_cumsum, scale, cu_seqlens=None,
                        chunk_size: int = CHUNK_SIZE):
    """FLA's ``chunk_bwd_dqkwg``: dq, dk (output and state-update parts), dw and the gamma-gradient per token.

    Per chunk (S = h entering, dS' = dh leaving, dP = scale dO v_new^T * Gamma):
    ``dq = scale exp(gamma) dO S^T + dP K``, ``dk = dP^T Q + exp(gamma_C - gamma) v_new dS'^T``, ``dw = -dv S^T``,
    ``dgamma_i = dq_i . q_i - dk_i . k_i``, and the chunk's last token also gets
    ``exp(gamma_C) <S, dS'> + sum_j exp(gamma_C - gamma_j) k_j^T dS' v_new_j``.

    Args:
        q, k: [B, T, Hk or Hv, K]. v_new, do, dv (from ``chunk_bwd_dh_ref``): [B, T, Hv, V]. w: [B, T, Hv, K].
        h, dh: [B, NT, Hv, K, V]. g_cumsum: [B, T, Hv]. scale: float.

    Returns:
        (dq [B, T, Hv, K], dk [B, T, Hv, K], dw [B, T, Hv, K], dgamma [B, T, Hv]); per value head, before the GVA
        reduction; dk and dgamma lack the UT/WY parts (``chunk_bwd_wy_ref``).
    """
    B, T, Hv, _ = do.shape
    q, k = expand_heads(q, Hv), expand_heads(k, Hv)
    dq, dk, dw = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(w)
    dgamma = torch.zeros_like(g_cumsum)
    for b, _, i, s, e in chunk_spans(B, T, cu_seqlens, chunk_size):
        qc, kc, vn, gc, S, dS = q[b, s:e], k[b, s:e], v_new[b, s:e], g_cumsum[b, s:e], h[b, i], dh[b, i]
        dP = scale * torch.einsum("ihv,jhv->hij", do[b, s:e], vn) * decay_matrix(gc, strict=False)
        dk_state = (gc[-1:] - gc).exp()[:, :, None] * torch.einsum("jhv,hkv->jhk", vn, dS)
        dqc = (scale * gc.exp()[:, :, None] * torch.einsum("ihv,hkv->ihk", do[b, s:e], S)
               + torch.einsum("hij,jhk->ihk", dP, kc))
        dkc = torch.einsum("hij,ihk->jhk", dP, qc) + dk_state
        dq[b, s:e], dk[b, s:e] = dqc, dkc
        dw[b, s:e] = -torch.einsum("ihv,hkv->ihk", dv[b, s:e], S)
        dgc = (dqc * qc).sum(-1) - (dkc * kc).sum(-1)
        dgc[-1] += gc[-1].exp() * (S * dS).sum((-2, -1)) + (dk_state * kc).sum((0, -1))
        dgamma[b, s:e] = dgc
    return dq, dk, dw, dgamma


def chunk_bwd_wy_ref(k, v, beta, A, g_cumsum, dw, du, cu_seqlens=None, chunk_size: int = CHUNK_SIZE):
    """FLA's ``prepare_wy_repr_bwd``: the backward through ``recompute_w_u_ref`` and the gated ``kkt_inverse_ref``.

    With ``w = A diag(beta exp(gamma)) K``, ``u = A diag(beta) V``, ``A = (I + StrictLower(M))^-1`` and
    ``M_ij = beta_i (k_i . k_j) Gamma_ij``: ``dA = dw (beta exp(gamma) K)^T + du (beta V)^T``,
    ``dM = StrictLower(-A^T dA A^T)``; k gets ``beta exp(gamma) A^T dw`` and both sides of ``dM * beta_row * Gamma``,
    v gets ``beta A^T du``, beta and gamma the matching sums (gamma: ``rowsum(dM * M) - colsum(dM * M)`` plus
    ``(A^T dw) . (beta exp(gamma) k)``).

    Args:
        k: [B, T, Hk or Hv, K]. v: [B, T, Hv, V]. beta, g_cumsum: [B, T, Hv]. A: [B, T, Hv, C] gated.
        dw: [B, T, Hv, K]. du: [B, T, Hv, V] (the dv of ``chunk_bwd_dh_ref``).

    Returns:
        (dk [B, T, Hv, K], dv [B, T, Hv, V], dbeta [B, T, Hv], dgamma [B, T, Hv]).
    """
    B, T, Hv = beta.shape
    k = expand_heads(k, Hv)
    dk, dv, dbeta, dgamma = torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(beta), torch.zeros_like(beta)
    for b, _, _, s, e in chunk_spans(B, T, cu_seqlens, chunk_size):
        Ac = A[b, s:e, :, : e - s].transpose(0, 1)  # [Hv, L, L]
        kc, vc, bc, gc, dwc, duc = k[b, s:e], v[b, s:e], beta[b, s:e], g_cumsum[b, s:e], dw[b, s:e], du[b, s:e]
        kbg = kc * (bc * gc.exp())[:, :, None]
        dA = torch.einsum("ihk,jhk->hij", dwc, kbg) + torch.einsum("ihv,jhv->hij", duc, vc * bc[:, :, None])
        dkbg = torch.einsum("hij,ihk->jhk", Ac, dwc)
        dvb = torch.einsum("hij,ihv->jhv", Ac, duc)
        # the inverse: A = X^-1 gives dX = -A^T dA A^T; only X's strict lower triangle depends on the inputs
        dM = -(Ac.mT @ dA @ Ac.mT).tril(-1)
        Gamma = decay_matrix(gc, strict=True)
        KKg = torch.einsum("ihk,jhk->hij", kc, kc) * Gamma
        dKK = dM * bc.T[:, :, None] * Gamma
        E = dM * bc.T[:, :, None] * KKg  # dM * M
        dk[b, s:e] = (dkbg * (bc * gc.exp())[:, :, None] + torch.einsum("hij,jhk->ihk", dKK, kc)
                      + torch.einsum("hij,ihk->jhk", dKK, kc))
        dv[b, s:e] = dvb * bc[:, :, None]
        dbeta[b, s:e] = (dkbg * kc).sum(-1) * gc.exp() + (dvb * vc).sum(-1) + (dM * KKg).sum(-1).T
        dgamma[b, s:e] = (dkbg * kbg).sum(-1) + (E.sum(-1) - E.sum(-2)).T
    return dk, dv, dbeta, dgamma


def chunk_local_cumsum_bwd_ref(dgamma: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                               chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """dg [B, T, Hv]: the reverse cumsum of dgamma within each chunk, ``dg_t = sum_{s >= t in t's chunk} dgamma_s``."""
    dg = torch.zeros_like(dgamma)
    for b, _, _, s, e in chunk_spans(dgamma.shape[0], dgamma.shape[1], cu_seqlens, chunk_size):
        dg[b, s:e] = dgamma[b, s:e].flip(0).cumsum(0).flip(0)
    return dg


def chunk_bwd_step_ref(q, k, v, gamma, beta, S, dS_out, do, scale):
    """One chunk of one value head, the whole backward: the step a fused backward walk takes per chunk, going back.

    Everything a chunk's gradients need from outside the chunk is the state entering it (S, the forward's h) and the
    gradient of the state leaving it (dS'); the walk hands dS, the gradient of the state entering, to the chunk
    before. So one walk per (sequence or segment, value head) can form every gradient on chip, with nothing but S
    read and dq, dk, dv, dg, dbeta written (the staged kernels write dh, dv_new and dw to memory and read them back).

    Args:
        q, k: [n, K], n <= 64 (l2-normalised where the op normalises; unscaled). v, do: [n, V]. gamma: [n] the
        chunk-local cumsum of g. beta: [n]. S: [K, V] the state entering the chunk. dS_out: [K, V] the gradient of the
        state leaving it. scale: the output scale.

    Returns:
        (dq [n, K], dk [n, K], dv [n, V], dg [n] for the raw g, dbeta [n], dS [K, V]) for this value head: dq and dk
        before the GVA sum and the l2norm backward.
    """
    x = [t[None, :, None] for t in (q, k, v, gamma, beta, do)]
    q1, k1, v1, gamma1, beta1, do1 = x
    A = kkt_inverse_ref(k1, beta1, gamma1)
    w, u = recompute_w_u_ref(k1, v1, beta1, A, gamma1)
    h, v_new, _ = chunk_states_ref(k1, w, u, gamma1, S[None, None])
    dv_local = chunk_bwd_dv_local_ref(q1, k1, do1, gamma1, scale)
    dh, dv_new, dS = chunk_bwd_dh_ref(q1, k1, w, do1, dv_local, gamma1, scale, dS_out[None, None])
    dq, dk, dw, dgamma = chunk_bwd_dqkwg_ref(q1, k1, v_new, w, h, dh, do1, dv_new, gamma1, scale)
    dk_wy, dv, dbeta, dgamma_wy = chunk_bwd_wy_ref(k1, v1, beta1, A, gamma1, dw, dv_new)
    dg = chunk_local_cumsum_bwd_ref(dgamma + dgamma_wy)
    return dq[0, :, 0], (dk + dk_wy)[0, :, 0], dv[0, :, 0], dg[0, :, 0], dbeta[0, :, 0], dS[0, 0]


def gva_reduce_ref(dx: torch.Tensor, Hk: int) -> torch.Tensor:
    """[B, T, Hv, D] -> [B, T, Hk, D]: sums the value heads h of each key head h // (Hv / Hk) (repeat_interleave's
    backward)."""
    B, T, Hv, D = dx.shape
    return dx if Hv == Hk else dx.reshape(B, T, Hk, Hv // Hk, D).sum(3)


def l2norm_bwd_ref(x: torch.Tensor, dy: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The backward of ``reference.l2norm`` over the last dim: ``dx = r (dy - (y . dy) y)``, ``y = r x``,
    ``r = rsqrt(sum(x^2) + eps)``; x is the input before normalisation, same shape as dy."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * r
    return r * (dy - (y * dy).sum(-1, keepdim=True) * y)
