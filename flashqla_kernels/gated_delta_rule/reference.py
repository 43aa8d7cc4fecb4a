"""Float64-capable reference of the gated delta rule: token recurrence, chunked form, and per-stage references.

Everything here computes in the promoted dtype of its inputs (at least float32): pass float64 tensors for a ground
truth. Loops are explicit and slow on purpose; use these to test, never to run a model.

Per value head h (q/k head h // (Hv/Hk)), state S in R^{K x V}, for every token t of a sequence:

    S   <- exp(g_t) * S                     forget first
    u_t  = beta_t * (v_t - S^T k_t)         delta-rule error
    S   <- S + k_t u_t^T
    o_t  = scale * S^T q_t                  scale defaults to K^-0.5, applied after the optional q/k l2norm

Stages of the chunked form (chunk size C = 64, chunks restart at every sequence start), each with a reference below
that the fused kernels can be tested against stage by stage:

    chunk_local_cumsum_ref   gamma = cumsum of g within each chunk                      [B, T, Hv]
    kkt_inverse_ref          A0 = (I + StrictLower(diag(beta) K K^T))^-1 (gate-free, FlashQLA), or the gated
                             A = Gamma * A0 (FLA) when g_cumsum is given; row per token  [B, T, Hv, C]
    recompute_w_u_ref        w = A diag(beta) exp(gamma) K, u = A diag(beta) V          [B, T, Hv, K], [B, T, Hv, V]
    chunk_states_ref         h (state entering each chunk), v_new = u - w S, final state [B, NT, Hv, K, V], ...
    chunk_output_ref         o = scale (exp(gamma) Q S + (Q K^T * Gamma) v_new)         [B, T, Hv, V]
    chunk_transition_ref     S_next = M S + b per chunk (for context-parallel schemes)    [B, NT, Hv, K, K], [.., K, V]
    chunk_step_gate_factored_ref  one chunk in FlashQLA's gate-factored form (never forms w, u)

Chunk index layout (NT): dense inputs number chunks per batch row (NT = ceil(T / C)); varlen inputs (B = 1) number
them over all sequences in order (NT = sum_n ceil(len_n / C)), as FLA does.
"""
from __future__ import annotations

import torch

from flashqla_kernels.gated_delta_rule.checks import check_inputs, resolve_scale, sequence_spans

CHUNK_SIZE = 64

__all__ = [
    "CHUNK_SIZE", "l2norm", "recurrent_gated_delta_rule_ref", "chunk_gated_delta_rule_ref",
    "chunk_local_cumsum_ref", "kkt_inverse_ref", "recompute_w_u_ref", "chunk_states_ref", "chunk_output_ref",
    "chunk_transition_ref", "chunk_step_gate_factored_ref", "chunk_spans", "compute_dtype", "expand_heads",
    "num_chunks", "decay_matrix",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm over the last dim: ``x * rsqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for x in xs:
        if x is not None:
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def expand_heads(x: torch.Tensor, Hv: int) -> torch.Tensor:
    """[B, T, Hk, D] -> [B, T, Hv, D]: value head h reads key head h // (Hv / Hk) (repeat_interleave, not tile)."""
    return x if x.shape[2] == Hv else x.repeat_interleave(Hv // x.shape[2], dim=2)


def chunk_spans(B: int, T: int, cu_seqlens: torch.Tensor | None = None,
                chunk_size: int = CHUNK_SIZE) -> list[tuple[int, int, int, int, int]]:
    """Every chunk as (batch row b, sequence n, chunk index i in the NT layout, start, end); end - start <= C."""
    spans, counter = [], [0] * B
    for n, (b, bos, eos) in enumerate(sequence_spans(B, T, cu_seqlens)):
        for s in range(bos, eos, chunk_size):
            spans.append((b, n, counter[b], s, min(s + chunk_size, eos)))
            counter[b] += 1
    return spans


def num_chunks(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int) -> int:
    spans = chunk_spans(B, T, cu_seqlens, chunk_size)
    return max((i + 1 for _, _, i, _, _ in spans), default=0)


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel):
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    Hv = v.shape[2]
    q, k = (expand_heads(x.to(dtype), Hv) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q, k, v.to(dtype), g.to(dtype), beta.to(dtype), resolve_scale(scale, k.shape[-1]), dtype


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The token-by-token recurrence: the ground truth.

    Args:
        q, k: [B, T, Hk, K]. v: [B, T, Hv, V]. g (log decay, <= 0), beta: [B, T, Hv].
        scale: output scale, default K^-0.5 (after l2norm). initial_state: [N, Hv, K, V] or None (zeros).
        output_final_state: return the state after each sequence. use_qk_l2norm_in_kernel: l2-normalise q, k (eps 1e-6).
        cu_seqlens: [N+1] offsets of packed sequences (B must be 1), or None for N = B dense sequences.

    Returns:
        (o [B, T, Hv, V], final_state [N, Hv, K, V] or None), both in the compute dtype (promoted, >= float32).

    Example:
        >>> o, s = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(), beta.double(),
        ...                                       output_final_state=True)
    """
    N = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    q, k, v, g, beta, scale, dtype = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    B, T, Hv, K = k.shape
    V = v.shape[-1]
    # a padded tail after cu_seqlens[-1] is in no sequence: its outputs stay 0
    o = v.new_zeros(B, T, Hv, V)
    finals = []
    for n, (b, bos, eos) in enumerate(sequence_spans(B, T, cu_seqlens)):
        S = initial_state[n].to(dtype) if initial_state is not None else v.new_zeros(Hv, K, V)
        for t in range(bos, eos):
            S = S * g[b, t].exp()[:, None, None]
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o, (torch.stack(finals) if output_final_state else None)


def chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The chunked form (C = 64, FLA's algebra), composed from the stage references below.

    Same Args / Returns as ``recurrent_gated_delta_rule_ref``; agrees with it to ~1e-13 in float64.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    q, k, v, g, beta, scale, dtype = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    gamma = chunk_local_cumsum_ref(g, cu_seqlens)
    A = kkt_inverse_ref(k, beta, gamma, cu_seqlens)
    w, u = recompute_w_u_ref(k, v, beta, A, gamma, cu_seqlens)
    h0 = initial_state.to(dtype) if initial_state is not None else None
    h, v_new, final = chunk_states_ref(k, w, u, gamma, h0, cu_seqlens)
    o = chunk_output_ref(q, k, v_new, h, gamma, scale, cu_seqlens)
    return o, (final if output_final_state else None)


def chunk_local_cumsum_ref(g: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """gamma [B, T, Hv]: cumulative sum of g within each chunk (natural log units, not FLA's log2 units)."""
    gamma = torch.zeros_like(g)
    for b, _, _, s, e in chunk_spans(g.shape[0], g.shape[1], cu_seqlens, chunk_size):
        gamma[b, s:e] = g[b, s:e].cumsum(0)
    return gamma


def decay_matrix(gc: torch.Tensor, strict: bool) -> torch.Tensor:
    """Gamma [Hv, L, L] with Gamma_ij = exp(gamma_i - gamma_j) for i >= j (i > j if strict), else 0. gc: [L, Hv]."""
    L = gc.shape[0]
    diff = gc.T[:, :, None] - gc.T[:, None, :]
    keep = torch.ones(L, L, dtype=torch.bool, device=gc.device).tril(-1 if strict else 0)
    # Mask before exp so the upper triangle (positive exponents) never overflows.
    return diff.masked_fill(~keep, float("-inf")).exp()


def kkt_inverse_ref(k, beta, g_cumsum=None, cu_seqlens=None, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """The UT-transform inverse per chunk, one row per token.

    Args:
        k: [B, T, Hk or Hv, K] (already l2-normalised if the op normalises). beta: [B, T, Hv].
        g_cumsum: [B, T, Hv] chunk-local cumsum, or None for the gate-free A0 (FlashQLA's ``kkt_solve``).

    Returns:
        A [B, T, Hv, C]: ``A[b, t, h, j]`` is row (t - chunk start), column j of
        ``(I + StrictLower(diag(beta) (K K^T * Gamma)))^-1`` (Gamma = 1 without gates); columns past a tail
        chunk's length are 0. Identity: gated A = Gamma * A0 (Gamma including the diagonal).
    """
    B, T, Hv = beta.shape
    k = expand_heads(k, Hv)
    A = k.new_zeros(B, T, Hv, chunk_size)
    for b, _, _, s, e in chunk_spans(B, T, cu_seqlens, chunk_size):
        kc, L = k[b, s:e], e - s
        M = torch.einsum("ihk,jhk->hij", kc, kc) * beta[b, s:e].T[:, :, None]
        M = M * (decay_matrix(g_cumsum[b, s:e], strict=True) if g_cumsum is not None else 1.0)
        eye = torch.eye(L, dtype=k.dtype, device=k.device).expand(Hv, L, L)
        inv = torch.linalg.solve_triangular(eye + M.tril(-1), eye, upper=False, unitriangular=True)
        A[b, s:e, :, :L] = inv.transpose(0, 1)
    return A


def recompute_w_u_ref(k, v, beta, A, g_cumsum, cu_seqlens=None, chunk_size: int = CHUNK_SIZE):
    """FLA's ``recompute_w_u``: w = A diag(beta) diag(exp(gamma)) K, u = A diag(beta) V per chunk (A gated).

    Returns:
        (w [B, T, Hv, K], u [B, T, Hv, V]).
    """
    B, T, Hv = beta.shape
    k = expand_heads(k, Hv)
    w, u = torch.zeros_like(k), torch.zeros_like(v)
    for b, _, _, s, e in chunk_spans(B, T, cu_seqlens, chunk_size):
        Ac = A[b, s:e, :, : e - s].transpose(0, 1)  # [Hv, L, L]
        bc = beta[b, s:e]
        w[b, s:e] = torch.einsum("hij,jh,jhk->ihk", Ac, bc * g_cumsum[b, s:e].exp(), k[b, s:e])
        u[b, s:e] = torch.einsum("hij,jh,jhv->ihv", Ac, bc, v[b, s:e])
    return w, u


def chunk_states_ref(k, w, u, g_cumsum, initial_state=None, cu_seqlens=None, chunk_size: int = CHUNK_SIZE):
    """FLA's ``chunk_gated_delta_rule_fwd_h``: the state recurrence over chunks.

    Per chunk: ``v_new = u - w S``; ``S <- exp(gamma_C) S + (exp(gamma_C - gamma) K)^T v_new``.

    Returns:
        (h [B, NT, Hv, K, V] the state *entering* each chunk, v_new [B, T, Hv, V], final_state [N, Hv, K, V]).
    """
    B, T, Hv, V = u.shape
    k = expand_heads(k, Hv)
    K = k.shape[-1]
    h = k.new_zeros(B, num_chunks(B, T, cu_seqlens, chunk_size), Hv, K, V)
    v_new = torch.zeros_like(u)
    seqs = sequence_spans(B, T, cu_seqlens)
    states = [initial_state[n] if initial_state is not None else k.new_zeros(Hv, K, V) for n in range(len(seqs))]
    for b, n, i, s, e in chunk_spans(B, T, cu_seqlens, chunk_size):
        S, gc = states[n], g_cumsum[b, s:e]
        h[b, i] = S
        vn = u[b, s:e] - torch.einsum("ihk,hkv->ihv", w[b, s:e], S)
        v_new[b, s:e] = vn
        decay_to_end = (gc[-1:] - gc).exp()  # [L, Hv]
        states[n] = gc[-1].exp()[:, None, None] * S + torch.einsum("ihk,ih,ihv->hkv", k[b, s:e], decay_to_end, vn)
    final = torch.stack(states) if states else k.new_zeros(0, Hv, K, V)
    return h, v_new, final


def chunk_output_ref(q, k, v_new, h, g_cumsum, scale, cu_seqlens=None, chunk_size: int = CHUNK_SIZE):
    """FLA's ``chunk_fwd_o``: ``o = scale (exp(gamma) Q S + (Q K^T * Gamma) v_new)``, Gamma with its diagonal.

    Args:
        q, k: [B, T, Hk or Hv, K] (l2-normalised, not scaled). v_new: [B, T, Hv, V]. h: [B, NT, Hv, K, V].

    Returns:
        o [B, T, Hv, V].
    """
    B, T, Hv, V = v_new.shape
    q, k = expand_heads(q, Hv), expand_heads(k, Hv)
    o = torch.zeros_like(v_new)
    for b, _, i, s, e in chunk_spans(B, T, cu_seqlens, chunk_size):
        gc = g_cumsum[b, s:e]
        inter = gc.exp()[:, :, None] * torch.einsum("ihk,hkv->ihv", q[b, s:e], h[b, i])
        P = torch.einsum("ihk,jhk->hij", q[b, s:e], k[b, s:e]) * decay_matrix(gc, strict=False)
        o[b, s:e] = scale * (inter + torch.einsum("hij,jhv->ihv", P, v_new[b, s:e]))
    return o


def chunk_transition_ref(k, beta, g_cumsum, v, cu_seqlens=None, chunk_size: int = CHUNK_SIZE):
    """The affine map of every chunk: ``S_next = M S + b`` (the basis of exact context parallelism).

    ``M = exp(gamma_C) I - (exp(gamma_C - gamma) K)^T w`` and ``b = (exp(gamma_C - gamma) K)^T u`` with w, u from
    the gated A. Composing chunks: ``M_2 M_1`` (later chunks on the left).

    Returns:
        (M [B, NT, Hv, K, K], b [B, NT, Hv, K, V]).
    """
    B, T, Hv = beta.shape
    k = expand_heads(k, Hv)
    K, V = k.shape[-1], v.shape[-1]
    A = kkt_inverse_ref(k, beta, g_cumsum, cu_seqlens, chunk_size)
    w, u = recompute_w_u_ref(k, v, beta, A, g_cumsum, cu_seqlens, chunk_size)
    NT = num_chunks(B, T, cu_seqlens, chunk_size)
    M, bias = k.new_zeros(B, NT, Hv, K, K), k.new_zeros(B, NT, Hv, K, V)
    eye = torch.eye(K, dtype=k.dtype, device=k.device)
    for b, _, i, s, e in chunk_spans(B, T, cu_seqlens, chunk_size):
        gc = g_cumsum[b, s:e]
        kd = k[b, s:e] * (gc[-1:] - gc).exp()[:, :, None]
        M[b, i] = gc[-1].exp()[:, None, None] * eye - torch.einsum("ihk,ihj->hkj", kd, w[b, s:e])
        bias[b, i] = torch.einsum("ihk,ihv->hkv", kd, u[b, s:e])
    return M, bias


def chunk_step_gate_factored_ref(q, k, v, beta, gamma, S, scale):
    """One chunk in FlashQLA's gate-factored form; never forms w or u.

    ``Ag = Gamma * A0 * beta_col``, ``V_new = Ag (V - exp(gamma) K S)``,
    ``O = scale (exp(gamma) Q S + (Gamma * Q K^T) V_new)``, ``S' = exp(gamma_C) S + K^T (exp(gamma_C - gamma) V_new)``.

    Args:
        q, k: [L, Hv, K] (GVA-expanded, l2-normalised). v: [L, Hv, V]. beta, gamma (chunk-local cumsum): [L, Hv].
        S: [Hv, K, V] state entering the chunk. scale: float.

    Returns:
        (o [L, Hv, V], v_new [L, Hv, V], S_next [Hv, K, V]).
    """
    L, Hv, _ = k.shape
    eye = torch.eye(L, dtype=k.dtype, device=k.device).expand(Hv, L, L)
    KKt = torch.einsum("ihk,jhk->hij", k, k)
    A0 = torch.linalg.solve_triangular(eye + (KKt * beta.T[:, :, None]).tril(-1), eye, upper=False,
                                       unitriangular=True)
    Gamma = decay_matrix(gamma, strict=False)
    Ag = Gamma * A0 * beta.T[:, None, :]
    W = v - gamma.exp()[:, :, None] * torch.einsum("ihk,hkv->ihv", k, S)
    v_new = torch.einsum("hij,jhv->ihv", Ag, W)
    P = torch.einsum("ihk,jhk->hij", q, k) * Gamma
    o = scale * (gamma.exp()[:, :, None] * torch.einsum("ihk,hkv->ihv", q, S) + torch.einsum("hij,jhv->ihv", P, v_new))
    S_next = gamma[-1].exp()[:, None, None] * S + torch.einsum(
        "ihk,ihv->hkv", k, (gamma[-1:] - gamma).exp()[:, :, None] * v_new)
    return o, v_new, S_next
