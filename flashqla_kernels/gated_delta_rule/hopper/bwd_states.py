"""Backward stage: the forward's per-chunk states and v_new, recomputed (the forward keeps neither).

One CTA walks one sequence for one value head and one bDV-wide slice of V, the state S [K, bDV] in fp32 registers,
exactly ``chunk_fwd``'s state path without the output (and without its warp specialisation: this pass is a small
part of the backward). Per chunk, with X = ``kkt_solve``'s Ag:

    h_c = S                                   (written in the input dtype: the backward's GEMMs read it so)
    W   = V - diag(exp(gamma)) K S            (fp16, the operand X multiplies, as in the forward)
    v_new = X W                               (written in the input dtype)
    S  <- exp(gamma_C) S + K^T diag(exp(gamma_C - gamma)) v_new

Grid (V / bDV, Hv, N), 128 threads. ``seqs[n] = (start, end, first chunk)``; a sequence of length 0 writes nothing.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.chunk_bwd import C, load_gates, load_rows, store_rows


def block_v(K: int, V: int) -> int:
    """V slice per CTA of the sequential backward stages (states, dh): 64, or 32 at K = 256 (the fp32 state and its
    gradient stay in registers). Measured on an H100 at 16/32 8192x4: 32-wide slices run the two walks in 5.8 ms
    against 3.6 ms at 64, because each chunk's loads, index math and barriers cost the same whatever the width."""
    return min(V, 32 if K > 128 else 64)


def build_bwd_states(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, has_h0: bool):
    """The states kernel: grid (V / bDV, Hv, N), 128 threads; ``has_h0``: start from ``h0`` (else zeros)."""
    group = Hv // Hk
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_h0 = T.dynamic("num_h0")

    @T.prim_func
    def gdn_bwd_states(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        ag: T.Tensor((num_tokens, Hv, C), "float16"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        h0: T.Tensor((num_h0, Hv, K, V), "float32"),
        seqs: T.Tensor((num_seqs, 3), "int32"),
        h: T.Tensor((num_chunks, Hv, K, V), dtype),
        v_new: T.Tensor((num_tokens, Hv, V), dtype),
    ):
        with T.Kernel(V // bDV, Hv, num_seqs, threads=128) as (bv, bh, bn):
            hk = bh // group
            v0 = bv * bDV
            bos = seqs[bn, 0]
            eos = seqs[bn, 1]
            c0 = seqs[bn, 2]
            k_sh = T.alloc_shared((C, K), dtype)
            v_sh = T.alloc_shared((C, bDV), dtype)
            a_sh = T.alloc_shared((C, C), "float16")
            s_sh = T.alloc_shared((K, bDV), dtype)
            w_sh = T.alloc_shared((C, bDV), "float16")
            vn_sh = T.alloc_shared((C, bDV), dtype)
            g_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")
            s_f = T.alloc_fragment((K, bDV), "float32")
            u_f = T.alloc_fragment((C, bDV), "float32")

            if has_h0:
                T.copy(h0[bn, bh, :, v0:v0 + bDV], s_f)
            else:
                T.clear(s_f)
            for it in T.serial(T.ceildiv(eos - bos, C)):
                cs = bos + it * C
                n = T.min(C, eos - cs)
                load_rows(k, k_sh, cs, n, hk, 0, K)
                load_rows(v, v_sh, cs, n, bh, v0, bDV)
                load_rows(ag, a_sh, cs, n, bh, 0, C)
                load_gates(gamma, g_sh, eg_sh, er_sh, cs, n, bh)
                T.copy(s_f, s_sh)
                T.copy(s_sh, h[c0 + it, bh, :, v0:v0 + bDV])
                T.gemm(k_sh, s_sh, u_f, clear_accum=True)
                for i, j in T.Parallel(C, bDV):
                    w_sh[i, j] = v_sh[i, j] - eg_sh[i] * u_f[i, j]
                T.gemm(a_sh, w_sh, u_f, clear_accum=True)
                store_rows(u_f, v_new, cs, n, bh, v0, bDV)
                for i, j in T.Parallel(C, bDV):
                    vn_sh[i, j] = u_f[i, j] * er_sh[i]
                for i, j in T.Parallel(K, bDV):
                    s_f[i, j] = s_f[i, j] * eg_sh[C - 1]
                T.gemm(k_sh, vn_sh, s_f, transpose_A=True)

    return gdn_bwd_states


def bwd_states(k: torch.Tensor, v: torch.Tensor, ag: torch.Tensor, gamma: torch.Tensor, h0: torch.Tensor | None,
               seqs: torch.Tensor, num_chunks: int):
    """Recompute the state entering every chunk and v_new.

    Args:
        k: [T, Hk, K] bf16/fp16 (normalised if the op normalises). v: [T, Hv, V] same dtype. ag: [T, Hv, 64] fp16
        (``kkt_solve``'s). gamma: [T, Hv] fp32. h0: [N, Hv, K, V] fp32 or None. seqs: [N, 3] int32 (start, end,
        first chunk). num_chunks: NC, the chunks over all sequences.

    Returns:
        (h [NC, Hv, K, V] in k's dtype, the state entering each chunk; v_new [T, Hv, V] in k's dtype).
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    bDV = block_v(K, V)
    kernel = toolkit.compile_kernel(build_bwd_states, Hk, Hv, K, V, bDV, toolkit.tl_dtype(k.dtype), h0 is not None)
    h = toolkit.empty((num_chunks, Hv, K, V), k.dtype, k.device)
    v_new = toolkit.empty((Tn, Hv, V), k.dtype, k.device)
    if h0 is None:
        h0 = toolkit.unread((1, Hv, K, V), torch.float32, k.device)  # not read without has_h0
    if seqs.shape[0] > 0:
        kernel(k, v, ag, gamma, h0, seqs, h, v_new)
    return h, v_new
