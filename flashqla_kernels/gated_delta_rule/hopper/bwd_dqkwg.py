"""Backward stage: dq, dk (output and state-update parts), dw and the per-token gamma gradient, per chunk (FLA's
``chunk_bwd_dqkwg``).

With S = h_c (the state entering the chunk), dS' = dh_c (the gradient of the state leaving it), dv the full gradient
of v_new, over V in 64-wide blocks:

    dP = dO v_new^T,   dq = dO S^T,   dk = v_new dS'^T,   dw = dv S^T,   <S, dS'> = trace(S dS'^T)
    then  dPg = scale dP * Gamma (lower triangle),  dq <- scale diag(exp(gamma)) dq + dPg K,
          dk <- diag(exp(gamma_C - gamma)) dk + dPg^T Q,   dw <- -dw
    dgamma_i = dq_i.q_i - dk_i.k_i;  the chunk's last token adds exp(gamma_C) <S, dS'> + sum_j k_j.dk_state_j

Two kernels; ``KERNEL`` picks what the launcher runs where both apply (K <= 128):

- ``build_bwd_dqkwg_group`` ("group", the default, K <= 128): one warp-specialised 512-thread CTA per (chunk, key
  head) walking the group's value heads in order. dO, v_new and dv are read once per value head (all of K in one
  CTA), a producer's TMA rings land them while three warpgroups run the dq, dk and dw GEMMs, and dq and dk are
  summed over the value heads on chip: dq leaves finished (the l2norm backward applied), dk's part as one fp32
  [T, Hk, K] that the grouped WY stage finishes (``bwd_wy.bwd_wy_group``), so no GVA pass runs.
- ``build_bwd_dqkwg`` ("blocked", and every K = 256): the GEMMs over V are repeated per 64-wide K block (as FLA
  does), which keeps every accumulator at 16 registers a thread for any K; dq and dk per value head, summed by the
  GVA pass. dgamma's sums over K are per block, written to ``dgp[block]`` and added in block order by the WY stage
  (no atomics). Grid (K / 64, chunks, Hv), 256 threads, loads waited on.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.chunk_bwd import (
    ACC_PAD, C, LOG2E, TILE, l2norm_bwd_rows, load_gates, load_rows, store_rows,
)
from flashqla_kernels.gated_delta_rule.hopper.chunk_fwd import set_nreg

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


# The grouped kernel (``chunk_fwd``'s warp-specialised layout): one CTA per (chunk, key head) with all of K, walking
# the group's value heads in order, so dq and dk are summed over the group on chip: dq leaves finished (the l2norm
# backward applied, in q's dtype) and dk's part as one fp32 [T, Hk, K], where the blocked kernel writes two fp32
# [T, Hv, K] tensors for the GVA pass to read back. The ring runs over (value head, V block) steps; the gates and
# dPg are double-buffered per value head (gate_ready / gate_free, bar_ds / ds_free), so a value head's V blocks
# land while the previous head's epilogue runs.
#
#   WG0 q side   per value head dq_h = scale diag(e) dO S^T + dPg K (dPg -> smem for WG1), its row dots with q
#                (dgp[0]), and the running sum over heads in shared memory (fp32); at the end the l2norm backward
#   WG1 k side   per value head dk_h = diag(r) v_new dS'^T + dPg^T Q and the state terms of the last token (dgp[1]),
#                the running sum in registers
#   WG2 w side   dw = -dv S^T per value head
#   WG3 producer warp 0: dO, v_new, dv; warp 1: S, dS' (2-deep rings over the steps); warp 2: q, k once, then each
#                value head's gates (2-deep)
GROUP_THREADS = 512
# setmaxnreg budgets (sum 512; ptxas spills none at K = 128): WG1 holds dk and its running sum, the producer the
# ragged chunk's masked loads
GROUP_NREG_Q, GROUP_NREG_K, GROUP_NREG_W, GROUP_NREG_PRODUCER = 136, 176, 104, 96
KERNELS = ("blocked", "group")
# what the launcher runs where K <= 128 (``grouped``); tests and ``benchmarks/gdn_backward.py --ab`` switch it
KERNEL = "group"


def build_bwd_dqkwg_group(Hk: int, Hv: int, K: int, V: int, dtype: str, scale: float, l2norm: bool):
    """The grouped dqkwg kernel: grid (chunks, Hk), 512 threads, K <= 128 (``bwd_dqkwg_group``)."""
    if K > 2 * TILE:
        raise ValueError(f"the grouped dqkwg holds all of K in registers: K <= {2 * TILE}, got {K}")
    group = Hv // Hk
    nV = V // TILE
    steps = group * nV
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_x = T.dynamic("num_x")

    @T.prim_func
    def gdn_bwd_dqkwg_group(
        q: T.Tensor((num_tokens, Hk, K), dtype),
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v_new: T.Tensor((num_tokens, Hv, V), dtype),
        do: T.Tensor((num_tokens, Hv, V), dtype),
        dv: T.Tensor((num_tokens, Hv, V), dtype),
        h: T.Tensor((num_chunks, Hv, K, V), dtype),
        dh: T.Tensor((num_chunks, Hv, K, V), dtype),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        xq: T.Tensor((num_x, Hk, K), dtype),
        rq: T.Tensor((num_x, Hk), "float32"),
        dq: T.Tensor((num_tokens, Hk, K), dtype),
        dk: T.Tensor((num_tokens, Hk, K), "float32"),
        dw: T.Tensor((num_tokens, Hv, K), dtype),
        dgp: T.Tensor((2, num_tokens, Hv), "float32"),
    ):
        with T.Kernel(num_chunks, Hk, threads=GROUP_THREADS) as (bc, hk):
            cs = T.alloc_var("int32")
            n = T.alloc_var("int32")
            cs = chunks[bc, 0]
            n = chunks[bc, 1] - chunks[bc, 0]
            tx = T.get_thread_binding()

            q_sh = T.alloc_shared((C, K), dtype)
            k_sh = T.alloc_shared((C, K), dtype)
            do_sh = T.alloc_shared((2, C, TILE), dtype)
            vn_sh = T.alloc_shared((2, C, TILE), dtype)
            dv_sh = T.alloc_shared((2, C, TILE), dtype)
            h_sh = T.alloc_shared((2, K, TILE), dtype)
            dh_sh = T.alloc_shared((2, K, TILE), dtype)
            ds_sh = T.alloc_shared((2, C, C), dtype)
            dqa_sh = T.alloc_shared((C, K + ACC_PAD), "float32")
            g_sh = T.alloc_shared((2, C), "float32", scope="shared")
            eg_sh = T.alloc_shared((2, C), "float32", scope="shared")
            er_sh = T.alloc_shared((2, C), "float32", scope="shared")
            tr_sh = T.alloc_shared((2, K), "float32", scope="shared")
            st_sh = T.alloc_shared((2, C), "float32", scope="shared")

            dq_f = T.alloc_fragment((C, K), "float32")
            dp_f = T.alloc_fragment((C, C), "float32")
            dk_f = T.alloc_fragment((C, K), "float32")
            dka_f = T.alloc_fragment((C, K), "float32")
            dw_f = T.alloc_fragment((C, K), "float32")
            red_q = T.alloc_fragment((C,), "float32")
            red_k = T.alloc_fragment((C,), "float32")
            acc = T.alloc_local((1,), "float32")
            tot = T.alloc_local((1,), "float32")

            ready = T.alloc_barrier(arrive_count=[64] * 2)
            free = T.alloc_barrier(arrive_count=[384] * 2)
            bar_in = T.alloc_barrier(arrive_count=32)
            gate_ready = T.alloc_barrier(arrive_count=[32] * 2)
            gate_free = T.alloc_barrier(arrive_count=[256] * 2)
            bar_ds = T.alloc_barrier(arrive_count=[128] * 2)
            ds_free = T.alloc_barrier(arrive_count=[128] * 2)
            bar_st = T.alloc_barrier(arrive_count=128)

            if tx < 128:
                set_nreg(GROUP_NREG_Q)
                T.barrier_wait(bar_in, 0)
                for hh in T.serial(group):
                    T.clear(dq_f)
                    T.clear(dp_f)
                    for vb in T.serial(nV):
                        t = hh * nV + vb
                        T.barrier_wait(ready[t % 2], (t // 2) % 2)
                        T.gemm(do_sh[t % 2, :, :], h_sh[t % 2, :, :], dq_f, transpose_B=True)
                        T.gemm(do_sh[t % 2, :, :], vn_sh[t % 2, :, :], dp_f, transpose_B=True)
                        T.barrier_arrive(free[t % 2])
                    T.barrier_wait(gate_ready[hh % 2], (hh // 2) % 2)
                    # the slot's previous dPg (two heads back) has been read by WG1
                    T.barrier_wait(ds_free[hh % 2], (hh // 2 + 1) % 2)
                    for i, j in T.Parallel(C, C):
                        ds_sh[hh % 2, i, j] = T.if_then_else(
                            j <= i, dp_f[i, j] * T.exp2((g_sh[hh % 2, i] - g_sh[hh % 2, j]) * LOG2E) * scale, 0.0)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_ds[hh % 2])
                    T.barrier_wait(bar_ds[hh % 2], (hh // 2) % 2)
                    for i, j in T.Parallel(C, K):
                        dq_f[i, j] = dq_f[i, j] * eg_sh[hh % 2, i] * scale
                    T.barrier_arrive(gate_free[hh % 2])
                    T.gemm(ds_sh[hh % 2, :, :], k_sh, dq_f)
                    # the running sum over value heads, each thread on its own elements
                    if hh == 0:
                        for i, j in T.Parallel(C, K):
                            dqa_sh[i, j] = dq_f[i, j]
                    else:
                        for i, j in T.Parallel(C, K):
                            dqa_sh[i, j] += dq_f[i, j]
                    for i, j in T.Parallel(C, K):
                        dq_f[i, j] = dq_f[i, j] * q_sh[i, j]
                    T.reduce_sum(dq_f, red_q, dim=1)
                    for i in T.Parallel(C):
                        if i < n:
                            dgp[0, cs + i, hk * group + hh] = red_q[i]
                if l2norm:
                    l2norm_bwd_rows(dqa_sh, dq_f, red_q, xq, rq, cs, n, hk, K)
                else:
                    for i, j in T.Parallel(C, K):
                        dq_f[i, j] = dqa_sh[i, j]
                if n == C:
                    T.copy(dq_f, dq[cs:cs + C, hk, :])
                else:
                    store_rows(dq_f, dq, cs, n, hk, 0, K)

            elif tx < 256:
                set_nreg(GROUP_NREG_K)
                T.clear(dka_f)
                T.barrier_wait(bar_in, 0)
                for hh in T.serial(group):
                    T.clear(dk_f)
                    acc[0] = 0.0
                    for vb in T.serial(nV):
                        t = hh * nV + vb
                        T.barrier_wait(ready[t % 2], (t // 2) % 2)
                        T.gemm(vn_sh[t % 2, :, :], dh_sh[t % 2, :, :], dk_f, transpose_B=True)
                        # the diagonal of S dS'^T, one row of K a thread
                        if tx - 128 < K:
                            for j in T.serial(TILE):
                                acc[0] += T.cast(h_sh[t % 2, tx - 128, j], "float32") * T.cast(
                                    dh_sh[t % 2, tx - 128, j], "float32")
                        T.barrier_arrive(free[t % 2])
                    T.barrier_wait(gate_ready[hh % 2], (hh // 2) % 2)
                    for i, j in T.Parallel(C, K):
                        dk_f[i, j] = dk_f[i, j] * er_sh[hh % 2, i]
                    for i, j in T.Parallel(C, K):
                        dka_f[i, j] += dk_f[i, j]
                    # the state part's k-dots, summed into the last token's dgamma
                    for i, j in T.Parallel(C, K):
                        dk_f[i, j] = dk_f[i, j] * k_sh[i, j]
                    T.reduce_sum(dk_f, red_k, dim=1)
                    for i in T.Parallel(C):
                        st_sh[hh % 2, i] = red_k[i]
                    if tx - 128 < K:
                        tr_sh[hh % 2, tx - 128] = acc[0]
                    T.barrier_arrive(bar_st)
                    T.barrier_wait(bar_st, hh % 2)
                    # every thread sums in the same fixed order (rows past a ragged end are 0: their v_new is)
                    tot[0] = 0.0
                    for i in T.serial(C):
                        tot[0] += st_sh[hh % 2, i]
                    for i in T.serial(K):
                        tot[0] += eg_sh[hh % 2, C - 1] * tr_sh[hh % 2, i]
                    T.barrier_arrive(gate_free[hh % 2])
                    T.barrier_wait(bar_ds[hh % 2], (hh // 2) % 2)
                    T.gemm(ds_sh[hh % 2, :, :], q_sh, dk_f, transpose_A=True, clear_accum=True)
                    T.barrier_arrive(ds_free[hh % 2])
                    for i, j in T.Parallel(C, K):
                        dka_f[i, j] += dk_f[i, j]
                    for i, j in T.Parallel(C, K):
                        dk_f[i, j] = dk_f[i, j] * k_sh[i, j]
                    T.reduce_sum(dk_f, red_k, dim=1)
                    for i in T.Parallel(C):
                        if i < n:
                            dgp[1, cs + i, hk * group + hh] = T.if_then_else(i == n - 1, tot[0], 0.0) - (
                                st_sh[hh % 2, i] + red_k[i])
                if n == C:
                    T.copy(dka_f, dk[cs:cs + C, hk, :])
                else:
                    store_rows(dka_f, dk, cs, n, hk, 0, K)

            elif tx < 384:
                set_nreg(GROUP_NREG_W)
                for hh in T.serial(group):
                    T.clear(dw_f)
                    for vb in T.serial(nV):
                        t = hh * nV + vb
                        T.barrier_wait(ready[t % 2], (t // 2) % 2)
                        T.gemm(dv_sh[t % 2, :, :], h_sh[t % 2, :, :], dw_f, transpose_B=True)
                        T.barrier_arrive(free[t % 2])
                    for i, j in T.Parallel(C, K):
                        dw_f[i, j] = -dw_f[i, j]
                    if n == C:
                        T.copy(dw_f, dw[cs:cs + C, hk * group + hh, :])
                    else:
                        store_rows(dw_f, dw, cs, n, hk * group + hh, 0, K)

            else:
                set_nreg(GROUP_NREG_PRODUCER)
                if tx < 384 + 32:
                    for t in T.serial(steps):
                        bh = hk * group + t // nV
                        v0 = (t % nV) * TILE
                        T.barrier_wait(free[t % 2], (t // 2 + 1) % 2)
                        if n == C:
                            T.tma_copy(do[cs:cs + C, bh, v0:v0 + TILE], do_sh[t % 2, :, :], barrier=ready[t % 2])
                            T.tma_copy(v_new[cs:cs + C, bh, v0:v0 + TILE], vn_sh[t % 2, :, :],
                                       barrier=ready[t % 2])
                            T.tma_copy(dv[cs:cs + C, bh, v0:v0 + TILE], dv_sh[t % 2, :, :], barrier=ready[t % 2])
                        else:
                            # rows past the ragged chunk's end are 0: they add nothing to any product
                            for i, j in T.Parallel(C, TILE):
                                do_sh[t % 2, i, j] = T.if_then_else(
                                    i < n, do[cs + T.min(i, n - 1), bh, v0 + j], T.cast(0, dtype))
                                vn_sh[t % 2, i, j] = T.if_then_else(
                                    i < n, v_new[cs + T.min(i, n - 1), bh, v0 + j], T.cast(0, dtype))
                                dv_sh[t % 2, i, j] = T.if_then_else(
                                    i < n, dv[cs + T.min(i, n - 1), bh, v0 + j], T.cast(0, dtype))
                            T.fence_proxy_async()
                        T.barrier_arrive(ready[t % 2])
                elif tx < 384 + 64:
                    for t in T.serial(steps):
                        bh = hk * group + t // nV
                        v0 = (t % nV) * TILE
                        T.barrier_wait(free[t % 2], (t // 2 + 1) % 2)
                        T.tma_copy(h[bc, bh, :, v0:v0 + TILE], h_sh[t % 2, :, :], barrier=ready[t % 2])
                        T.tma_copy(dh[bc, bh, :, v0:v0 + TILE], dh_sh[t % 2, :, :], barrier=ready[t % 2])
                        T.barrier_arrive(ready[t % 2])
                elif tx < 384 + 96:
                    if n == C:
                        T.tma_copy(q[cs:cs + C, hk, :], q_sh, barrier=bar_in)
                        T.tma_copy(k[cs:cs + C, hk, :], k_sh, barrier=bar_in)
                    else:
                        for i, j in T.Parallel(C, K):
                            q_sh[i, j] = T.if_then_else(i < n, q[cs + T.min(i, n - 1), hk, j], T.cast(0, dtype))
                            k_sh[i, j] = T.if_then_else(i < n, k[cs + T.min(i, n - 1), hk, j], T.cast(0, dtype))
                        T.fence_proxy_async()
                    T.barrier_arrive(bar_in)
                    for hh in T.serial(group):
                        bh = hk * group + hh
                        T.barrier_wait(gate_free[hh % 2], (hh // 2 + 1) % 2)
                        # padded rows repeat the last valid gate (every padded gate <= 1), as load_gates does
                        for i in T.Parallel(C):
                            g_sh[hh % 2, i] = gamma[cs + T.min(i, n - 1), bh]
                            eg_sh[hh % 2, i] = T.exp2(gamma[cs + T.min(i, n - 1), bh] * LOG2E)
                            er_sh[hh % 2, i] = T.exp2(
                                (gamma[cs + n - 1, bh] - gamma[cs + T.min(i, n - 1), bh]) * LOG2E)
                        T.barrier_arrive(gate_ready[hh % 2])

    return gdn_bwd_dqkwg_group


# Every hand-off between threads of this kernel goes through an mbarrier (ring, gates, dPg, the state terms), and each
# thread reads back only the shared elements it wrote itself (dq's running sum). TileLang's sync planner would add
# bar.sync instructions inside the warpgroups' branches that share one named-barrier id across warpgroups: warps of
# two warpgroups then release each other, fall out of step before a warpgroup-wide wgmma, and the kernel hangs.
build_bwd_dqkwg_group.pass_configs = {"tl.disable_thread_storage_sync": True}


def bwd_dqkwg(q, k, v_new, do, dv, h, dh, gamma, chunks, *, scale: float):
    """dq, dk (without the WY part), dw and the partial dgamma of every chunk.

    Args:
        q, k: [T, Hk, K] bf16/fp16 (normalised if the op normalises). v_new, do: [T, Hv, V] same dtype. dv: [T, Hv, V]
        same dtype (``bwd_dh``'s). h, dh: [NC, Hv, K, V] (``chunk_fwd.chunk_states``' and ``bwd_dh``'s).
        gamma: [T, Hv] fp32. chunks: [NC, 2] int32. scale: the output scale.

    Returns:
        (dq, dk [T, Hv, K] fp32 per value head, dw [T, Hv, K] in q's dtype; dgp [K / 64, T, Hv] fp32, dgamma's
        partial sums per K block, which the WY stage adds in order).
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


def grouped(K: int, V: int) -> bool:
    """Whether the launcher runs the grouped kernels (``KERNEL`` is "group" and K, V <= 128: the grouped WY kernel
    holds both whole)."""
    if KERNEL not in KERNELS:
        raise ValueError(f"bwd_dqkwg.KERNEL must be one of {KERNELS}; got {KERNEL!r}")
    return KERNEL == "group" and K <= 2 * TILE and V <= 2 * TILE


def bwd_dqkwg_group(q, k, v_new, do, dv, h, dh, gamma, chunks, *, scale: float, xq=None, rq=None):
    """dq summed over each key head's value heads (finished), dk's dqkwg part summed so, dw and the partial
    dgamma of every chunk, on the grouped kernel (``build_bwd_dqkwg_group``, K <= 128).

    Args:
        q, k, v_new, do, dv, h, dh, gamma, chunks, scale: as ``bwd_dqkwg``'s. xq: [T, Hk, K] the raw q with
        rq [T, Hk] fp32 its l2norm factor (``chunk_bwd.l2norm_fwd``'s), when the op normalises q; else None.

    Returns:
        (dq [T, Hk, K] in q's dtype, the l2norm backward applied when xq is given; dk [T, Hk, K] fp32 without the
        WY part (``chunk_bwd.gva_bwd`` adds it); dw [T, Hv, K] in q's dtype; dgp [2, T, Hv] fp32, dgamma's partial
        sums, which the WY stage adds in order). Rows outside every chunk are not written.
    """
    Tn, Hk, K = k.shape
    Hv, V = do.shape[1], do.shape[2]
    if K > 2 * TILE:
        raise ValueError(f"the grouped dqkwg takes K <= {2 * TILE}; got {K} (use bwd_dqkwg)")
    l2norm = xq is not None
    kernel = toolkit.compile_kernel(build_bwd_dqkwg_group, Hk, Hv, K, V, toolkit.tl_dtype(q.dtype), float(scale),
                                    l2norm)
    if not l2norm:
        xq, rq = toolkit.unread((1, Hk, K), q.dtype, q.device), toolkit.unread((1, Hk), torch.float32, q.device)
    dq = toolkit.empty((Tn, Hk, K), q.dtype, q.device)
    dk = toolkit.empty((Tn, Hk, K), torch.float32, q.device)
    dw = toolkit.empty((Tn, Hv, K), q.dtype, q.device)
    dgp = toolkit.empty((2, Tn, Hv), torch.float32, q.device)
    if chunks.shape[0] > 0:
        kernel(q, k, v_new, do, dv, h, dh, gamma, chunks, xq, rq, dq, dk, dw, dgp)
    return dq, dk, dw, dgp
