"""Backward stage: through the WY representation and the gated UT inverse (FLA's ``prepare_wy_repr_bwd``), then the
chunk-local reverse cumsum of the gamma gradient (FLA's ``chunk_local_cumsum(..., reverse=True)``).

One CTA per (chunk, value head). ``kkt_solve`` wrote only X = A diag(beta) (fp16); the gated inverse A itself
comes back with one 64 x 64 x 64 product: (I + L) A = I with L = diag(beta) StrictLower(K K^T * Gamma) gives
A = I - A L = I - X StrictLower(K K^T * Gamma) (exact; no division by beta). With ``w = X diag(e) K``,
``u = X V`` (e = exp(gamma)), du the gradient of u (= ``bwd_dh``'s dv) and dw ``bwd_dqkwg``'s:

    dA  = dw (diag(beta e) K)^T + du (diag(beta) V)^T            over 64-wide blocks of K and V
    dM  = StrictLower(-A^T dA A^T),   F = dM * KKg,  KKg = StrictLower(K K^T * Gamma),  E = diag(beta) F
    dk  = diag(beta e) A^T dw + dKK K + dKK^T K,   dKK = diag(beta) dM * Gamma
    dv  = diag(beta) A^T du
    dbeta  = e rowsum((A^T dw) * K) + rowsum((A^T du) * V) + rowsum(F)
    dgamma = beta e rowsum((A^T dw) * K) + rowsum(E) - colsum(E)

then ``dg_t = sum_{s >= t in the chunk} (dgamma_s + sum_b dgp[b, s])`` with ``bwd_dqkwg``'s partial sums added in
block order and the reverse cumsum one thread a token (fixed order: deterministic). GEMM operands are the input
dtype (A and the gradients, as FLA's), X and KKg fp16 (X arrives so). Grid (chunks, Hv), 256 threads.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.chunk_bwd import (
    ACC_PAD, C, LOG2E, TILE, l2norm_bwd_rows, load_gates, load_rows, store_rows,
)

THREADS = 256
# Reductions of a 64-row fragment that two warpgroups share (each holds half the columns): every thread holds
# ROW_BATCH rows and COL_BATCH columns. One batched all-reduce exchanges them all through shared memory behind one
# pair of barriers; one call per element costs a pair per element (the column sums alone were 40 barriers a head).
# The butterfly and its order are the same: the sums are bit-identical.
ROW_BATCH = 2
COL_BATCH = 8


@T.macro
def through_inverse(x_sh, kkg_sh, a_sh, t_sh, kk_f, da_f, a_f, g_sh, b_sh, rowf_sh, cole_sh, red_cc, red_col, rows):
    """One chunk and value head, from K K^T (``kk_f``) and dA (``da_f``): KKg (left in kk_f as dM * KKg, and
    fp16 in kkg_sh), A = I - X KKg on rows < ``rows`` (a_sh; the others 0), dM = StrictLower(-A^T (dA A^T)) in
    da_f, rowf = rowsum(dM * KKg) and cole = colsum(diag(beta) dM * KKg)."""
    for i, j in T.Parallel(C, C):
        kk_f[i, j] = T.if_then_else(j < i, kk_f[i, j] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E), 0.0)
        kkg_sh[i, j] = kk_f[i, j]
    T.gemm(x_sh, kkg_sh, a_f, clear_accum=True)
    for i, j in T.Parallel(C, C):
        a_sh[i, j] = T.if_then_else(i < rows, T.if_then_else(
            j <= i, T.if_then_else(i == j, 1.0, 0.0) - a_f[i, j], 0.0), 0.0)
    T.copy(da_f, t_sh)
    T.gemm(t_sh, a_sh, a_f, transpose_B=True, clear_accum=True)
    T.copy(a_f, t_sh)
    T.gemm(a_sh, t_sh, da_f, transpose_A=True, clear_accum=True)
    for i, j in T.Parallel(C, C):
        da_f[i, j] = T.if_then_else(j < i, -da_f[i, j], 0.0)
        kk_f[i, j] = da_f[i, j] * kk_f[i, j]
    T.reduce_sum(kk_f, red_cc, dim=1, batch=ROW_BATCH)
    for i in T.Parallel(C):
        rowf_sh[i] = red_cc[i]
    for i, j in T.Parallel(C, C):
        kk_f[i, j] = kk_f[i, j] * b_sh[i]
    T.reduce_sum(kk_f, red_col, dim=0, batch=COL_BATCH)
    for i in T.Parallel(C):
        cole_sh[i] = red_col[i]


@T.macro
def write_gate_grads(db_out, dgm_sh, dgp, parts, dbeta, dgamma, dg, cs, n, bh, tx, acc):
    """dbeta and dgamma of the chunk's rows (``db_out``, ``dgm_sh``), then dg: the reverse cumsum within the chunk of
    dgamma plus the dqkwg stage's ``parts`` partial sums, added in order (one thread a token), the cumsum a warp's
    shuffle scan (fixed order: deterministic)."""
    T.sync_threads()
    if tx < C:
        if tx < n:
            dbeta[cs + tx, bh] = db_out[tx]
            dgamma[cs + tx, bh] = dgm_sh[tx]
            acc[0] = dgm_sh[tx]
            for b in T.serial(parts):
                acc[0] += dgp[b, cs + tx, bh]
            db_out[tx] = acc[0]
        else:
            db_out[tx] = 0.0
    T.sync_threads()
    T.cumsum(db_out, dim=0, reverse=True)
    if tx < n:
        dg[cs + tx, bh] = db_out[tx]


def build_bwd_wy(Hk: int, Hv: int, K: int, V: int, dtype: str):
    """The WY kernel: grid (chunks, Hv), 256 threads."""
    group = Hv // Hk
    nK = K // TILE
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.macro
    def through_a(x, dx, hx, col0, cs, n, bh, x_sh, dx_sh, a_sh, r_f, t_f, red):
        # one 64-wide block of K (x = k, dx = dw) or V (v, du): r = A^T dx, red = rowsum(r * x)
        load_rows(x, x_sh, cs, n, hx, col0, TILE)
        load_rows(dx, dx_sh, cs, n, bh, col0, TILE)
        T.gemm(a_sh, dx_sh, r_f, transpose_A=True, clear_accum=True)
        for i, j in T.Parallel(C, TILE):
            t_f[i, j] = r_f[i, j] * x_sh[i, j]
        T.reduce_sum(t_f, red, dim=1, batch=ROW_BATCH)

    @T.prim_func
    def gdn_bwd_wy(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        ag: T.Tensor((num_tokens, Hv, C), "float16"),
        dw: T.Tensor((num_tokens, Hv, K), dtype),
        du: T.Tensor((num_tokens, Hv, V), dtype),
        dgp: T.Tensor((nK, num_tokens, Hv), "float32"),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        dk: T.Tensor((num_tokens, Hv, K), "float32"),
        dv: T.Tensor((num_tokens, Hv, V), dtype),
        dbeta: T.Tensor((num_tokens, Hv), "float32"),
        dgamma: T.Tensor((num_tokens, Hv), "float32"),
        dg: T.Tensor((num_tokens, Hv), "float32"),
    ):
        with T.Kernel(num_chunks, Hv, threads=THREADS) as (bc, bh):
            hk = bh // group
            cs = chunks[bc, 0]
            n = chunks[bc, 1] - cs
            tx = T.get_thread_binding()
            kb_sh = T.alloc_shared((C, TILE), dtype)  # a block of K or V
            xb_sh = T.alloc_shared((C, TILE), dtype)  # that block scaled by beta e (K) or beta (V)
            db_sh = T.alloc_shared((C, TILE), dtype)  # the same block of dw or du
            x_sh = T.alloc_shared((C, C), "float16")
            kkg_sh = T.alloc_shared((C, C), "float16")
            a_sh = T.alloc_shared((C, C), dtype)
            t_sh = T.alloc_shared((C, C), dtype)
            g_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            rowf_sh = T.alloc_shared((C,), "float32")
            cole_sh = T.alloc_shared((C,), "float32")
            db_out = T.alloc_shared((C,), "float32")
            dgm_sh = T.alloc_shared((C,), "float32")
            acc = T.alloc_local((1,), "float32")
            kk_f = T.alloc_fragment((C, C), "float32")
            da_f = T.alloc_fragment((C, C), "float32")
            a_f = T.alloc_fragment((C, C), "float32")
            r_f = T.alloc_fragment((C, TILE), "float32")
            t_f = T.alloc_fragment((C, TILE), "float32")
            red = T.alloc_fragment((C,), "float32")
            red_cc = T.alloc_fragment((C,), "float32")
            red_col = T.alloc_fragment((C,), "float32")
            # per-row sums of the w / u parts, in the fragment layout of their row reductions (no shared RMW)
            acc_b = T.alloc_fragment((C,), "float32")
            acc_g = T.alloc_fragment((C,), "float32")

            load_gates(gamma, g_sh, eg_sh, er_sh, cs, n, bh)
            for i in T.Parallel(C):
                b_sh[i] = T.if_then_else(i < n, beta[cs + T.min(i, n - 1), bh], 0.0)
            load_rows(ag, x_sh, cs, n, bh, 0, C)
            T.clear(kk_f)
            T.clear(da_f)
            for kb in T.serial(nK):
                load_rows(k, kb_sh, cs, n, hk, kb * TILE, TILE)
                load_rows(dw, db_sh, cs, n, bh, kb * TILE, TILE)
                for i, j in T.Parallel(C, TILE):
                    xb_sh[i, j] = kb_sh[i, j] * b_sh[i] * eg_sh[i]
                T.gemm(kb_sh, kb_sh, kk_f, transpose_B=True)
                T.gemm(db_sh, xb_sh, da_f, transpose_B=True)
            for vb in T.serial(V // TILE):
                load_rows(v, kb_sh, cs, n, bh, vb * TILE, TILE)
                load_rows(du, db_sh, cs, n, bh, vb * TILE, TILE)
                for i, j in T.Parallel(C, TILE):
                    xb_sh[i, j] = kb_sh[i, j] * b_sh[i]
                T.gemm(db_sh, xb_sh, da_f, transpose_B=True)

            through_inverse(x_sh, kkg_sh, a_sh, t_sh, kk_f, da_f, a_f, g_sh, b_sh, rowf_sh, cole_sh, red_cc, red_col, C)
            # dKK = diag(beta) dM * Gamma
            for i, j in T.Parallel(C, C):
                t_sh[i, j] = T.if_then_else(j < i, da_f[i, j] * b_sh[i] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E), 0.0)

            T.clear(acc_b)
            T.clear(acc_g)
            for kb in T.serial(nK):
                through_a(k, dw, hk, kb * TILE, cs, n, bh, kb_sh, db_sh, a_sh, r_f, t_f, red)
                for i in T.Parallel(C):
                    acc_b[i] += red[i] * eg_sh[i]
                    acc_g[i] += red[i] * eg_sh[i] * b_sh[i]
                for i, j in T.Parallel(C, TILE):
                    r_f[i, j] = r_f[i, j] * b_sh[i] * eg_sh[i]
                T.gemm(t_sh, kb_sh, r_f)
                T.gemm(t_sh, kb_sh, r_f, transpose_A=True)
                store_rows(r_f, dk, cs, n, bh, kb * TILE, TILE)
            for vb in T.serial(V // TILE):
                through_a(v, du, bh, vb * TILE, cs, n, bh, kb_sh, db_sh, a_sh, r_f, t_f, red)
                for i in T.Parallel(C):
                    acc_b[i] += red[i]
                for i, j in T.Parallel(C, TILE):
                    r_f[i, j] = r_f[i, j] * b_sh[i]
                store_rows(r_f, dv, cs, n, bh, vb * TILE, TILE)

            for i in T.Parallel(C):
                db_out[i] = acc_b[i] + rowf_sh[i]
                dgm_sh[i] = acc_g[i] + b_sh[i] * rowf_sh[i] - cole_sh[i]
            # with dqkwg's partial sums, K blocks in order
            write_gate_grads(db_out, dgm_sh, dgp, nK, dbeta, dgamma, dg, cs, n, bh, tx, acc)

    return gdn_bwd_wy


def build_bwd_wy_group(Hk: int, Hv: int, K: int, V: int, dtype: str, l2norm: bool):
    """The grouped WY kernel: grid (chunks, Hk), 256 threads (``bwd_wy_group``; K, V <= 128). It runs
    ``build_bwd_wy``'s steps for each value head of the key head in turn, with all of K and V in one tile: k is loaded
    once per CTA, dw, du, v and X once per value head, the next value head's tiles double-buffered by cp.async while
    this one's products run (``T.Pipelined``); the beta / exp(gamma) scalings are applied to the columns of dw K^T and
    du V^T in registers instead of to scaled copies of K and V. dk's WY part and D = the heads' sum of dKK stay in
    shared memory; D K + D^T K is formed once, the dqkwg part added and the l2norm backward applied, so dk leaves
    finished. The tiles are read whole: rows past a ragged chunk's end are the next sequence's (finite) and meet only
    zeros (A and dA masked to the chunk's rows, k's rows zeroed); the launcher zeroes dw's and du's rows of a padded
    tail, which no kernel writes."""
    if K > 2 * TILE or V > 2 * TILE:
        raise ValueError(f"the grouped WY kernel holds K and V whole: K, V <= {2 * TILE}, got {K}, {V}")
    group = Hv // Hk
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_x = T.dynamic("num_x")

    @T.prim_func
    def gdn_bwd_wy_group(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        ag: T.Tensor((num_tokens, Hv, C), "float16"),
        dw: T.Tensor((num_tokens, Hv, K), dtype),
        du: T.Tensor((num_tokens, Hv, V), dtype),
        dgp: T.Tensor((2, num_tokens, Hv), "float32"),
        dk_part: T.Tensor((num_tokens, Hk, K), "float32"),
        xk: T.Tensor((num_x, Hk, K), dtype),
        rk: T.Tensor((num_x, Hk), "float32"),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        dk: T.Tensor((num_tokens, Hk, K), dtype),
        dv: T.Tensor((num_tokens, Hv, V), dtype),
        dbeta: T.Tensor((num_tokens, Hv), "float32"),
        dgamma: T.Tensor((num_tokens, Hv), "float32"),
        dg: T.Tensor((num_tokens, Hv), "float32"),
    ):
        with T.Kernel(num_chunks, Hk, threads=THREADS) as (bc, hk):
            cs = chunks[bc, 0]
            n = chunks[bc, 1] - cs
            tx = T.get_thread_binding()
            k_sh = T.alloc_shared((C, K), dtype)
            dw_sh = T.alloc_shared((C, K), dtype)
            du_sh = T.alloc_shared((C, V), dtype)
            v_sh = T.alloc_shared((C, V), dtype)
            x_sh = T.alloc_shared((C, C), "float16")
            kkg_sh = T.alloc_shared((C, C), "float16")
            a_sh = T.alloc_shared((C, C), dtype)
            t_sh = T.alloc_shared((C, C), dtype)
            dka_sh = T.alloc_shared((C, K + ACC_PAD), "float32")
            dsum_sh = T.alloc_shared((C, C), "float32")
            g_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            rowf_sh = T.alloc_shared((C,), "float32")
            cole_sh = T.alloc_shared((C,), "float32")
            db_out = T.alloc_shared((C,), "float32")
            dgm_sh = T.alloc_shared((C,), "float32")
            acc = T.alloc_local((1,), "float32")
            kk0_f = T.alloc_fragment((C, C), "float32")
            kk_f = T.alloc_fragment((C, C), "float32")
            da_f = T.alloc_fragment((C, C), "float32")
            du_f = T.alloc_fragment((C, C), "float32")
            a_f = T.alloc_fragment((C, C), "float32")
            rk_f = T.alloc_fragment((C, K), "float32")
            rv_f = T.alloc_fragment((C, V), "float32")
            red = T.alloc_fragment((C,), "float32")
            red_v = T.alloc_fragment((C,), "float32")
            red_cc = T.alloc_fragment((C,), "float32")
            red_col = T.alloc_fragment((C,), "float32")
            ss = T.alloc_fragment((C,), "float32") if l2norm else None

            # k once, rows past the chunk's end zeroed (they would meet D's zero columns as NaN * 0 in a padded tail)
            load_rows(k, k_sh, cs, n, hk, 0, K)
            for i, j in T.Parallel(C, K):
                dka_sh[i, j] = dk_part[cs + T.min(i, n - 1), hk, j]
            # K K^T is the same for every value head: formed once, each head gates a register copy of it
            T.gemm(k_sh, k_sh, kk0_f, transpose_B=True, clear_accum=True)

            for hh in T.Pipelined(group, num_stages=2):
                T.copy(dw[cs:cs + C, hk * group + hh, :], dw_sh)
                T.copy(du[cs:cs + C, hk * group + hh, :], du_sh)
                T.copy(v[cs:cs + C, hk * group + hh, :], v_sh)
                T.copy(ag[cs:cs + C, hk * group + hh, :], x_sh)
                load_gates(gamma, g_sh, eg_sh, er_sh, cs, n, hk * group + hh)
                for i in T.Parallel(C):
                    b_sh[i] = T.if_then_else(i < n, beta[cs + T.min(i, n - 1), hk * group + hh], 0.0)
                T.gemm(dw_sh, k_sh, da_f, transpose_B=True, clear_accum=True)
                T.gemm(du_sh, v_sh, du_f, transpose_B=True, clear_accum=True)
                T.copy(kk0_f, kk_f)
                # dA = dw (diag(beta e) K)^T + du (diag(beta) V)^T: the scalings on the columns, the chunk's rows only
                for i, j in T.Parallel(C, C):
                    da_f[i, j] = T.if_then_else(i < n, T.if_then_else(
                        j < n, (da_f[i, j] * eg_sh[j] + du_f[i, j]) * b_sh[j], 0.0), 0.0)
                # A on the chunk's rows only: rows past a ragged end hold the next sequence's tiles
                through_inverse(x_sh, kkg_sh, a_sh, t_sh, kk_f, da_f, a_f, g_sh, b_sh, rowf_sh, cole_sh, red_cc, red_col,
                                n)
                # D += dKK = diag(beta) dM * Gamma (its products with K wait for the last head)
                if hh == 0:
                    for i, j in T.Parallel(C, C):
                        dsum_sh[i, j] = T.if_then_else(
                            j < i, da_f[i, j] * b_sh[i] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E), 0.0)
                else:
                    for i, j in T.Parallel(C, C):
                        dsum_sh[i, j] += T.if_then_else(
                            j < i, da_f[i, j] * b_sh[i] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E), 0.0)

                # r = A^T dw: dk's WY part (beta e r), and its k-dots
                T.gemm(a_sh, dw_sh, rk_f, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, K):
                    dka_sh[i, j] += rk_f[i, j] * b_sh[i] * eg_sh[i]
                for i, j in T.Parallel(C, K):
                    rk_f[i, j] = rk_f[i, j] * k_sh[i, j]
                T.reduce_sum(rk_f, red, dim=1, batch=ROW_BATCH)
                # A^T du: dv = diag(beta) A^T du, and the v-dots of A^T du (rows past the chunk's end are never
                # stored)
                T.gemm(a_sh, du_sh, rv_f, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, V):
                    if i < n:
                        dv[cs + i, hk * group + hh, j] = rv_f[i, j] * b_sh[i]
                for i, j in T.Parallel(C, V):
                    rv_f[i, j] = rv_f[i, j] * v_sh[i, j]
                T.reduce_sum(rv_f, red_v, dim=1, batch=ROW_BATCH)

                for i in T.Parallel(C):
                    db_out[i] = red[i] * eg_sh[i] + red_v[i] + rowf_sh[i]
                    dgm_sh[i] = red[i] * eg_sh[i] * b_sh[i] + b_sh[i] * rowf_sh[i] - cole_sh[i]
                # with the grouped dqkwg's two partial sums, in order
                write_gate_grads(db_out, dgm_sh, dgp, 2, dbeta, dgamma, dg, cs, n, hk * group + hh, tx, acc)
                T.sync_threads()

            # dk = the summed parts + D K + D^T K, then (l2norm) dx = r (dy - (y . dy) y), y = r x
            for i, j in T.Parallel(C, C):
                t_sh[i, j] = dsum_sh[i, j]
            for i, j in T.Parallel(C, K):
                rk_f[i, j] = dka_sh[i, j]
            T.gemm(t_sh, k_sh, rk_f)
            T.gemm(t_sh, k_sh, rk_f, transpose_A=True)
            if l2norm:
                # dy kept in dka_sh (each thread its own elements)
                for i, j in T.Parallel(C, K):
                    dka_sh[i, j] = rk_f[i, j]
                l2norm_bwd_rows(dka_sh, rk_f, ss, xk, rk, cs, n, hk, K)
            store_rows(rk_f, dk, cs, n, hk, 0, K)

    return gdn_bwd_wy_group


# cp.async double buffering of the value heads' tiles; TileLang's automatic warp specialisation and TMA lowering are
# off (the pipelined conv kernel's reasons: fragments replicated across producer-fed consumers)
build_bwd_wy_group.pass_configs = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


def bwd_wy(k, v, beta, gamma, ag, dw, du, dgp, chunks):
    """The WY backward and dg.

    Args:
        k: [T, Hk, K] bf16/fp16 (normalised if the op normalises). v: [T, Hv, V] same dtype. beta, gamma: [T, Hv]
        fp32. ag: [T, Hv, 64] fp16 (``kkt_solve``'s X). dw: [T, Hv, K] in k's dtype (``bwd_dqkwg``'s). du: [T, Hv, V]
        in k's dtype (``bwd_dh``'s dv). dgp: [K / 64, T, Hv] fp32 (``bwd_dqkwg``'s). chunks: [NC, 2] int32.

    Returns:
        (dk [T, Hv, K] fp32 the WY part, dv [T, Hv, V] in v's dtype, dbeta [T, Hv] fp32, dgamma [T, Hv] fp32 the WY
        part of the gamma gradient, dg [T, Hv] fp32 the gradient of the raw g).
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    kernel = toolkit.compile_kernel(build_bwd_wy, Hk, Hv, K, V, toolkit.tl_dtype(k.dtype))
    dk = toolkit.empty((Tn, Hv, K), torch.float32, k.device)
    dv = toolkit.empty((Tn, Hv, V), v.dtype, k.device)
    dbeta, dgamma, dg = (toolkit.empty((Tn, Hv), torch.float32, k.device) for _ in range(3))
    if chunks.shape[0] > 0:
        kernel(k, v, beta, gamma, ag, dw, du, dgp, chunks, dk, dv, dbeta, dgamma, dg)
    return dk, dv, dbeta, dgamma, dg


def bwd_wy_group(k, v, beta, gamma, ag, dw, du, dgp, dk_part, chunks, xk=None, rk=None):
    """The WY backward and dg after the grouped dqkwg (``bwd_dqkwg.bwd_dqkwg_group``), with dk finished: the WY
    part summed over each key head's value heads, ``dk_part`` added, and the l2norm backward when ``xk`` is given.

    Args:
        k, v, beta, gamma, ag, dw, du, chunks: as ``bwd_wy``'s. dgp: [2, T, Hv] fp32 and dk_part: [T, Hk, K] fp32,
        the grouped dqkwg's. xk: [T, Hk, K] the raw k with rk [T, Hk] fp32 its l2norm factor, or None.
        The kernel reads whole tiles: the rows of dw and du outside every chunk (a padded tail) must be finite (the
        launcher zeroes them).

    Returns:
        (dk [T, Hk, K] in k's dtype, dv [T, Hv, V] in v's dtype, dbeta [T, Hv] fp32, dgamma [T, Hv] fp32 the WY part
        of the gamma gradient, dg [T, Hv] fp32 the gradient of the raw g). Rows outside every chunk are not written.
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    l2norm = xk is not None
    kernel = toolkit.compile_kernel(build_bwd_wy_group, Hk, Hv, K, V, toolkit.tl_dtype(k.dtype), l2norm)
    if not l2norm:
        xk, rk = toolkit.unread((1, Hk, K), k.dtype, k.device), toolkit.unread((1, Hk), torch.float32, k.device)
    dk = toolkit.empty((Tn, Hk, K), k.dtype, k.device)
    dv = toolkit.empty((Tn, Hv, V), v.dtype, k.device)
    dbeta, dgamma, dg = (toolkit.empty((Tn, Hv), torch.float32, k.device) for _ in range(3))
    if chunks.shape[0] > 0:
        kernel(k, v, beta, gamma, ag, dw, du, dgp, dk_part, xk, rk, chunks, dk, dv, dbeta, dgamma, dg)
    return dk, dv, dbeta, dgamma, dg
