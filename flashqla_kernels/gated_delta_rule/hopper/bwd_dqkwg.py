"""Backward stage: dq, dk (output and state-update parts), dw and the per-token gamma gradient, per chunk (FLA's
``chunk_bwd_dqkwg``).

One CTA per (64-wide block of K, chunk, value head). With S = h_c (the state entering the chunk), dS' = dh_c (the
gradient of the state leaving it), dv the full gradient of v_new, over V in 64-wide blocks:

    dP = dO v_new^T,   dq = dO S^T,   dk = v_new dS'^T,   dw = dv S^T,   <S, dS'> = trace(S dS'^T)
    then  dPg = scale dP * Gamma (lower triangle),  dq <- scale diag(exp(gamma)) dq + dPg K,
          dk <- diag(exp(gamma_C - gamma)) dk + dPg^T Q,   dw <- -dw
    dgamma_i = dq_i.q_i - dk_i.k_i;  the chunk's last token adds exp(gamma_C) <S, dS'> + sum_j k_j.dk_state_j

The GEMMs over V are repeated per K block (as FLA does): the K blocks keep every accumulator at 16 registers a
thread for any K. dgamma's sums over K are per block, written to ``dgp[block]`` and added in block order by the WY
stage (no atomics). Grid (K / 64, chunks, Hv), 256 threads.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.chunk_bwd import C, LOG2E, TILE, load_gates, load_rows, store_rows

THREADS = 256


def build_bwd_dqkwg(Hk: int, Hv: int, K: int, V: int, dtype: str, scale: float):
    """The dqkwg kernel: grid (K / 64, chunks, Hv), 256 threads."""
    group = Hv // Hk
    nK = K // TILE
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_bwd_dqkwg(
        q: T.Tensor((num_tokens, Hk, K), dtype),
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v_new: T.Tensor((num_tokens, Hv, V), dtype),
        do: T.Tensor((num_tokens, Hv, V), dtype),
        dv: T.Tensor((num_tokens, Hv, V), dtype),
        h: T.Tensor((num_chunks, Hv, K, V), dtype),
        dh: T.Tensor((num_chunks, Hv, K, V), dtype),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        dq: T.Tensor((num_tokens, Hv, K), "float32"),
        dk: T.Tensor((num_tokens, Hv, K), "float32"),
        dw: T.Tensor((num_tokens, Hv, K), dtype),
        dgp: T.Tensor((nK, num_tokens, Hv), "float32"),
    ):
        with T.Kernel(nK, num_chunks, Hv, threads=THREADS) as (bk, bc, bh):
            hk = bh // group
            k0 = bk * TILE
            cs = chunks[bc, 0]
            n = chunks[bc, 1] - cs
            tx = T.get_thread_binding()
            do_sh = T.alloc_shared((C, TILE), dtype)
            vn_sh = T.alloc_shared((C, TILE), dtype)
            dv_sh = T.alloc_shared((C, TILE), dtype)
            h_sh = T.alloc_shared((TILE, TILE), dtype)
            dh_sh = T.alloc_shared((TILE, TILE), dtype)
            q_sh = T.alloc_shared((C, TILE), dtype)
            k_sh = T.alloc_shared((C, TILE), dtype)
            ds_sh = T.alloc_shared((C, C), dtype)
            g_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")
            # per row: the state part's k-dot, the diagonal of S dS'^T, the row's dgamma; then the last token's sum
            st_sh = T.alloc_shared((C,), "float32")
            tr_sh = T.alloc_shared((TILE,), "float32")
            row_sh = T.alloc_shared((C,), "float32")
            tot_sh = T.alloc_shared((1,), "float32")
            tot = T.alloc_local((1,), "float32")
            ds_f = T.alloc_fragment((C, C), "float32")
            dq_f = T.alloc_fragment((C, TILE), "float32")
            dk_f = T.alloc_fragment((C, TILE), "float32")
            dw_f = T.alloc_fragment((C, TILE), "float32")
            hh_f = T.alloc_fragment((TILE, TILE), "float32")
            t_f = T.alloc_fragment((C, TILE), "float32")
            red = T.alloc_fragment((C,), "float32")

            T.clear(ds_f)
            T.clear(dq_f)
            T.clear(dk_f)
            T.clear(dw_f)
            T.clear(hh_f)
            for vb in T.serial(V // TILE):
                v0 = vb * TILE
                load_rows(do, do_sh, cs, n, bh, v0, TILE)
                load_rows(v_new, vn_sh, cs, n, bh, v0, TILE)
                load_rows(dv, dv_sh, cs, n, bh, v0, TILE)
                T.copy(h[bc, bh, k0:k0 + TILE, v0:v0 + TILE], h_sh)
                T.copy(dh[bc, bh, k0:k0 + TILE, v0:v0 + TILE], dh_sh)
                T.gemm(do_sh, vn_sh, ds_f, transpose_B=True)
                T.gemm(do_sh, h_sh, dq_f, transpose_B=True)
                T.gemm(vn_sh, dh_sh, dk_f, transpose_B=True)
                T.gemm(dv_sh, h_sh, dw_f, transpose_B=True)
                T.gemm(h_sh, dh_sh, hh_f, transpose_B=True)

            load_rows(q, q_sh, cs, n, hk, k0, TILE)
            load_rows(k, k_sh, cs, n, hk, k0, TILE)
            load_gates(gamma, g_sh, eg_sh, er_sh, cs, n, bh)
            for i, j in T.Parallel(C, C):
                ds_sh[i, j] = T.if_then_else(j <= i, ds_f[i, j] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E) * scale, 0.0)
            for i, j in T.Parallel(C, TILE):
                dq_f[i, j] = dq_f[i, j] * eg_sh[i] * scale
                dk_f[i, j] = dk_f[i, j] * er_sh[i]
            T.gemm(ds_sh, k_sh, dq_f)
            # the state part of dk: its k-dots go to the last token's dgamma
            for i, j in T.Parallel(C, TILE):
                t_f[i, j] = dk_f[i, j] * k_sh[i, j]
            T.reduce_sum(t_f, red, dim=1)
            for i in T.Parallel(C):
                st_sh[i] = red[i]
            for i, j in T.Parallel(TILE, TILE):
                if i == j:
                    tr_sh[i] = hh_f[i, j]
            T.gemm(ds_sh, q_sh, dk_f, transpose_A=True)
            for i, j in T.Parallel(C, TILE):
                t_f[i, j] = dq_f[i, j] * q_sh[i, j] - dk_f[i, j] * k_sh[i, j]
            T.reduce_sum(t_f, red, dim=1)
            for i in T.Parallel(C):
                row_sh[i] = red[i]
            store_rows(dq_f, dq, cs, n, bh, k0, TILE)
            store_rows(dk_f, dk, cs, n, bh, k0, TILE)
            for i, j in T.Parallel(C, TILE):
                dw_f[i, j] = -dw_f[i, j]
            store_rows(dw_f, dw, cs, n, bh, k0, TILE)
            T.sync_threads()
            if tx == 0:
                # one thread, fixed order
                tot[0] = 0.0
                for i in T.serial(C):
                    tot[0] += st_sh[i] + eg_sh[C - 1] * tr_sh[i]
                tot_sh[0] = tot[0]
            T.sync_threads()
            for i in T.Parallel(C):
                if i < n:
                    dgp[bk, cs + i, bh] = row_sh[i] + T.if_then_else(i == n - 1, tot_sh[0], 0.0)

    return gdn_bwd_dqkwg


def bwd_dqkwg(q, k, v_new, do, dv, h, dh, gamma, chunks, *, scale: float):
    """dq, dk (without the WY part), dw and the partial dgamma of every chunk.

    Args:
        q, k: [T, Hk, K] bf16/fp16 (normalised if the op normalises). v_new, do: [T, Hv, V] same dtype. dv: [T, Hv, V]
        same dtype (``bwd_dh``'s). h, dh: [NC, Hv, K, V] (``chunk_fwd.chunk_states``' and ``bwd_dh``'s).
        gamma: [T, Hv] fp32. chunks: [NC, 2] int32. scale: the output scale.

    Returns:
        (dq, dk [T, Hv, K] fp32 per value head, dw [T, Hv, K] in q's dtype; dgp [K / 64, T, Hv] fp32, dgamma's partial sums per K block).
    """
    Tn, Hk, K = k.shape
    Hv, V = do.shape[1], do.shape[2]
    kernel = toolkit.compile_kernel(build_bwd_dqkwg, Hk, Hv, K, V, toolkit.tl_dtype(q.dtype), float(scale))
    dq, dk = (toolkit.empty((Tn, Hv, K), torch.float32, q.device) for _ in range(2))
    # dw only feeds the WY stage's GEMMs, which read it in the input dtype: stored so
    dw = toolkit.empty((Tn, Hv, K), q.dtype, q.device)
    dgp = toolkit.empty((K // TILE, Tn, Hv), torch.float32, q.device)
    if chunks.shape[0] > 0:
        kernel(q, k, v_new, do, dv, h, dh, gamma, chunks, dq, dk, dw, dgp)
    return dq, dk, dw, dgp
