"""Backward stage: the state gradient carried back over each sequence's chunks, with dv (FLA's ``chunk_bwd_dv_local``
and ``chunk_gated_delta_rule_bwd_dhu`` in one pass).

One CTA walks one sequence backwards for one value head and one bDV-wide slice of V, the state gradient dS' [K, bDV]
in fp32 registers for the whole walk (exact: nothing truncated, nothing rounded between chunks). It starts from
``dht`` (or zeros); per chunk, last to first, with X = ``kkt_solve``'s Ag (X = A diag(beta)):

    dh_c = dS'                                                      (written in the input dtype, for dqkwg)
    dv   = diag(exp(gamma_C - gamma)) K dS' + Pt dO,   Pt = scale (K Q^T) * Gamma^T   (upper triangle: j >= i)
    dS'  <- exp(gamma_C) dS' + (scale diag(exp(gamma)) Q)^T dO - K^T (diag(exp(gamma)) X^T dv)

The last term is ``w^T dv`` with ``w = X diag(exp(gamma)) K`` never formed. After the sequence's first chunk the
carried gradient is dh0. Pt and X^T dv go through shared memory in the input dtype (X is converted from fp16 on load).

Grid (V / bDV, Hv, N), 128 threads. ``seqs[n] = (start, end, first chunk)``.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.bwd_states import block_v
from flashqla_kernels.gated_delta_rule.hopper.chunk_bwd import C, LOG2E, load_gates, load_rows, store_rows


def build_bwd_dh(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, scale: float, has_dht: bool,
                 store_dh0: bool, store_grads: bool = True):
    """The dh kernel: grid (V / bDV, Hv, N), 128 threads; ``has_dht``: start from ``dht`` (else zeros);
    ``store_dh0``: write the gradient of the initial state; ``store_grads``: write dh and dv (off: only the walk's
    start gradient, the context-parallel first pass)."""
    group = Hv // Hk
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_dht = T.dynamic("num_dht")
    num_dh0 = T.dynamic("num_dh0")
    # dv's own row count: without store_grads it is a one-row placeholder
    num_dv = T.dynamic("num_dv")

    @T.prim_func
    def gdn_bwd_dh(
        q: T.Tensor((num_tokens, Hk, K), dtype),
        k: T.Tensor((num_tokens, Hk, K), dtype),
        do: T.Tensor((num_tokens, Hv, V), dtype),
        ag: T.Tensor((num_tokens, Hv, C), "float16"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        dht: T.Tensor((num_dht, Hv, K, V), "float32"),
        seqs: T.Tensor((num_seqs, 3), "int32"),
        dh: T.Tensor((num_chunks, Hv, K, V), dtype),
        dv: T.Tensor((num_dv, Hv, V), dtype),
        dh0: T.Tensor((num_dh0, Hv, K, V), "float32"),
    ):
        with T.Kernel(V // bDV, Hv, num_seqs, threads=128) as (bv, bh, bn):
            hk = bh // group
            v0 = bv * bDV
            bos = seqs[bn, 0]
            eos = seqs[bn, 1]
            c0 = seqs[bn, 2]
            nch = T.ceildiv(eos - bos, C)
            q_sh = T.alloc_shared((C, K), dtype)
            k_sh = T.alloc_shared((C, K), dtype)
            do_sh = T.alloc_shared((C, bDV), dtype)
            x_sh = T.alloc_shared((C, C), dtype)
            p_sh = T.alloc_shared((C, C), dtype)
            dh_sh = T.alloc_shared((K, bDV), dtype)
            dv_sh = T.alloc_shared((C, bDV), dtype)
            g_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")
            ds_f = T.alloc_fragment((K, bDV), "float32")
            dv_f = T.alloc_fragment((C, bDV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")

            if has_dht:
                T.copy(dht[bn, bh, :, v0:v0 + bDV], ds_f)
            else:
                T.clear(ds_f)
            for it in T.serial(nch):
                c = c0 + nch - 1 - it
                cs = bos + (nch - 1 - it) * C
                n = T.min(C, eos - cs)
                load_rows(q, q_sh, cs, n, hk, 0, K)
                load_rows(k, k_sh, cs, n, hk, 0, K)
                load_rows(do, do_sh, cs, n, bh, v0, bDV)
                load_rows(ag, x_sh, cs, n, bh, 0, C)
                load_gates(gamma, g_sh, eg_sh, er_sh, cs, n, bh)
                T.copy(ds_f, dh_sh)
                if store_grads:
                    T.copy(dh_sh, dh[c, bh, :, v0:v0 + bDV])
                # Pt[i, j] = scale k_i . q_j exp(gamma_j - gamma_i) for j >= i (masked before exp)
                T.gemm(k_sh, q_sh, p_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    p_sh[i, j] = T.if_then_else(
                        j >= i, p_f[i, j] * T.exp2((g_sh[j] - g_sh[i]) * LOG2E) * scale, 0.0)
                T.gemm(k_sh, dh_sh, dv_f, clear_accum=True)
                for i, j in T.Parallel(C, bDV):
                    dv_f[i, j] = dv_f[i, j] * er_sh[i]
                T.gemm(p_sh, do_sh, dv_f)
                if store_grads:
                    store_rows(dv_f, dv, cs, n, bh, v0, bDV)
                T.copy(dv_f, dv_sh)
                # X^T dv, scaled by -exp(gamma) into dv's tile: the w^T dv term as K^T (that)
                T.gemm(x_sh, dv_sh, dv_f, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, bDV):
                    dv_sh[i, j] = -eg_sh[i] * dv_f[i, j]
                for i, j in T.Parallel(C, K):
                    q_sh[i, j] = q_sh[i, j] * eg_sh[i] * scale
                for i, j in T.Parallel(K, bDV):
                    ds_f[i, j] = ds_f[i, j] * eg_sh[C - 1]
                T.gemm(q_sh, do_sh, ds_f, transpose_A=True)
                T.gemm(k_sh, dv_sh, ds_f, transpose_A=True)
            if store_dh0:
                T.copy(ds_f, dh0[bn, bh, :, v0:v0 + bDV])

    return gdn_bwd_dh


def bwd_dh(q, k, do, ag, gamma, dht, seqs, num_chunks: int, *, scale: float, store_dh0: bool,
           store_grads: bool = True):
    """The state gradient over the chunks of every walk (a sequence, or a segment of one), and dv.

    Args:
        q, k: [T, Hk, K] bf16/fp16 (normalised if the op normalises). do: [T, Hv, V] same dtype. ag: [T, Hv, 64]
        fp16. gamma: [T, Hv] fp32. dht: [N, Hv, K, V] fp32, the gradient of each walk's end state, or None (zeros).
        seqs: [N, 3] int32 (start, end, first chunk) of each walk. num_chunks: NC. scale: the output scale.
        store_dh0: return the gradient of each walk's start state. store_grads: write dh and dv (False: neither is
        returned).

    Returns:
        (dh [NC, Hv, K, V] in q's dtype, the gradient of the state leaving each chunk; dv [T, Hv, V] in q's dtype, the
        full gradient of v_new (every reader multiplies it in that dtype, so it is stored so: half the bytes of fp32,
        the same results); dh0 [N, Hv, K, V] fp32 or None). dh and dv are None without ``store_grads``.
    """
    Tn, Hk, K = k.shape
    Hv, V = do.shape[1], do.shape[2]
    N = seqs.shape[0]
    bDV = block_v(K, V)
    kernel = toolkit.compile_kernel(build_bwd_dh, Hk, Hv, K, V, bDV, toolkit.tl_dtype(q.dtype), float(scale),
                                    dht is not None, store_dh0, store_grads)
    if store_grads:
        dh = toolkit.empty((num_chunks, Hv, K, V), q.dtype, q.device)
        dv = toolkit.empty((Tn, Hv, V), q.dtype, q.device)
    else:  # the kernel's dh and dv arguments, not written
        dh = toolkit.unread((1, Hv, K, V), q.dtype, q.device)
        dv = toolkit.unread((1, Hv, V), q.dtype, q.device)
    dh0 = toolkit.empty((N, Hv, K, V), torch.float32, q.device) if store_dh0 else None
    if dht is None:
        dht = toolkit.unread((1, Hv, K, V), torch.float32, q.device)  # not read without has_dht
    if N > 0:
        kernel(q, k, do, ag, gamma, dht, seqs, dh, dv,
               dh0 if store_dh0 else toolkit.unread((1, Hv, K, V), torch.float32, q.device))
    return (dh, dv, dh0) if store_grads else (None, None, dh0)
