"""The torch path: a vectorised chunked forward and a token-loop decode step, both differentiable, any device.

Used on CPU and on GPUs without the Hopper kernels, and whenever inputs require grad. It follows transformers'
``torch_chunk_gated_delta_rule`` (same algebra, chunk size 64) and adds GVA without copies of the caller's tensors
being required, varlen via ``cu_seqlens`` (sequences are gathered into a zero-padded batch: padded tokens have
k = v = 0, beta = 0, g = 0, so they neither write nor decay the state; a tail after ``cu_seqlens[-1]`` belongs to no
sequence and its outputs are 0), float64 support and non-contiguous inputs.

Compute dtype: float64 if any input is float64, else float32. Outputs: o in ``q.dtype``; the final state in the
compute dtype (float32 for bf16/fp16/fp32 inputs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashqla_kernels.gated_delta_rule.checks import check_inputs, resolve_scale
from flashqla_kernels.gated_delta_rule.reference import l2norm

__all__ = ["chunk_gated_delta_rule_torch", "recurrent_gated_delta_rule_torch"]

CHUNK_SIZE = 64


def _compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


class _Layout:
    """Maps [B, T, ...] inputs (dense or packed varlen) to a zero-padded [N, Lp, ...] batch and back."""

    def __init__(self, B: int, T: int, cu_seqlens: torch.Tensor | None, multiple: int, device: torch.device):
        self.B, self.T, self.varlen = B, T, cu_seqlens is not None
        if not self.varlen:
            self.Lp = -(-T // multiple) * multiple
            return
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        lens = cu[1:] - cu[:-1]
        self.N = lens.numel()
        max_len = int(lens.max()) if self.N else 0
        self.Lp = -(-max_len // multiple) * multiple
        pos = torch.arange(self.Lp, device=device)
        self.valid = pos[None, :] < lens[:, None]  # [N, Lp]
        self.src = (cu[:-1, None] + pos[None, :]).clamp(max=max(T - 1, 0))
        seq_of_token = torch.repeat_interleave(torch.arange(self.N, device=device), lens)
        # tokens after cu_seqlens[-1] are a padded tail: in no sequence, their outputs are 0
        self.n_valid = seq_of_token.numel()
        self.dst = seq_of_token * self.Lp + torch.arange(self.n_valid, device=device) - cu[:-1][seq_of_token]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, Lp, ...], zeros past each sequence's end."""
        if not self.varlen:
            pad = [0, 0] * (x.dim() - 2) + [0, self.Lp - self.T]
            return F.pad(x, pad)
        y = x[0][self.src]
        mask = self.valid.reshape(*self.valid.shape, *([1] * (x.dim() - 2)))
        return torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[N, Lp, ...] -> [B, T, ...]."""
        if not self.varlen:
            return y[:, : self.T]
        out = y.reshape(-1, *y.shape[2:])[self.dst]
        if self.n_valid < self.T:
            out = torch.cat([out, out.new_zeros(self.T - self.n_valid, *out.shape[1:])])
        return out[None]


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, multiple):
    """Cast, expand GVA heads, l2norm, scale, and pack to head-major [N, H, Lp, D] (g, beta: [N, H, Lp])."""
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    B, T, Hk, K = k.shape
    Hv = v.shape[2]
    layout = _Layout(B, T, cu_seqlens, multiple, q.device)
    q, k, v, g, beta = (layout.pack(x.to(dtype)) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * resolve_scale(scale, K)
    if Hk != Hv:
        q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))
    N = q.shape[0]
    S = (initial_state.to(dtype) if initial_state is not None
         else q.new_zeros(N, Hv, K, v.shape[-1]))
    return q, k, v, g, beta, S, layout


def _unit_lower_inverse(L: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], C a multiple of ``block``.

    Blocked forward substitution: 16x16 diagonal blocks by a triangular solve, then each block row i from
    ``A[i, :s] = -A_ii L[i, :s] A[:s, :s]`` with matmuls. On CPU this is ~10x faster than a batched
    ``solve_triangular`` with 64x128 right-hand sides, and it is differentiable.
    """
    C = L.shape[-1]
    eye = torch.eye(block, dtype=L.dtype, device=L.device)
    diag = torch.stack([L[..., s:s + block, s:s + block] for s in range(0, C, block)], dim=-3)
    inv_diag = torch.linalg.solve_triangular(eye + diag, eye.expand_as(diag), upper=False, unitriangular=True)
    rows: list[torch.Tensor] = []
    for i, s in enumerate(range(0, C, block)):
        A_ii = inv_diag[..., i, :, :]
        parts = [A_ii, A_ii.new_zeros(*A_ii.shape[:-1], C - s - block)]
        if i:
            leading = torch.cat(rows, dim=-2)[..., :s]
            parts.insert(0, -A_ii @ (L[..., s:s + block, :s] @ leading))
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=-2)


def chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                 use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Chunked gated delta rule in plain torch (differentiable, any device).

    Args:
        q, k: [B, T, Hk, K]. v: [B, T, Hv, V]. g (log decay), beta: [B, T, Hv]. scale: default K^-0.5.
        initial_state: [N, Hv, K, V] or None. output_final_state: return the final state.
        use_qk_l2norm_in_kernel: l2-normalise q and k (eps 1e-6) before scaling. cu_seqlens: [N+1] offsets (B = 1).

    Returns:
        (o [B, T, Hv, V] in q.dtype, final_state [N, Hv, K, V] (float32, or float64 for float64 inputs) or None).
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = q.dtype
    C = CHUNK_SIZE
    q, k, v, g, beta, S, layout = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                           cu_seqlens, C)
    N, H, Lp, K = k.shape
    V = v.shape[-1]
    NC = Lp // C
    q, k, v = (x.reshape(N, H, NC, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(N, H, NC, C), beta.reshape(N, H, NC, C)

    gamma = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: the upper triangle has positive exponents that would overflow.
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    A = _unit_lower_inverse(((k_beta @ k.transpose(-1, -2)) * decay).tril(-1))
    u = A @ (v * beta[..., None])
    w = A @ (k_beta * gamma.exp()[..., None])
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    outs = []
    for i in range(NC):
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append(q_decayed[:, :, i] @ S + intra[:, :, i] @ v_new)
        S = S * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(N, H, 0, C, V)
    o = layout.unpack(o.reshape(N, H, Lp, V).transpose(1, 2)).to(out_dtype)
    return o, (S if output_final_state else None)


def recurrent_gated_delta_rule_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Token-by-token gated delta rule in plain torch: the decode step (T = 1), fine for short T.

    Same Args / Returns as ``chunk_gated_delta_rule_torch``.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = q.dtype
    q, k, v, g, beta, S, layout = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                           cu_seqlens, 1)
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (S * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        S = S + k_t[..., None] * delta[..., None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(*v.shape)
    o = layout.unpack(o.transpose(1, 2)).to(out_dtype)
    return o, (S if output_final_state else None)
