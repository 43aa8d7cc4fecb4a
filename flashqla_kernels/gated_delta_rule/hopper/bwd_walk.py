"""Backward stage: the whole chunk backward in one walk per (sequence or segment, value head), with all of V
(``reference_bwd.chunk_bwd_step_ref`` is its step in float64).

The staged path writes dh, dv_new and dw to memory and reads them back (about 8.6 GB at 16/32 8192x4, more than the
op's whole fwd + bwd time at 4.2 TB/s). Here one CTA carries dS' [K, V] in fp32 registers back over a walk's
chunks and, per chunk, forms every gradient on chip from the chunk's q, k, v, dO, X and gates, the state entering it
(S = the forward's saved h) and the forward's saved v_new; only dq and dk per value head, dv, dbeta, dg and dh0 leave.
Per chunk, last to first (``chunk_bwd``'s notation; C = 64 rows, rows past a ragged end are zero):

    the chain       dv_new = diag(r) K dS' + Pt dO,   Pt = scale (K Q^T) * Gamma^T (upper triangle)
                    dS     = e_C dS' + Q^T Doe + K^T Y,   Doe = scale diag(e) dO,   Y = -diag(e) X^T dv_new
    dq, dk          dP = scale (dO v_new^T) * Gamma (lower),  dq = scale diag(e) dO S^T + dP K,
                    dk = diag(r) v_new dS'^T + dP^T Q,  dw = -dv_new S^T
    gates           dgamma_i = dq_i.q_i - dk_i.k_i, the last token adding e_C <S, dS'> + sum_j (diag(r) v_new dS'^T)_j.k_j
    WY              bwd_wy's math on dw and du = dv_new (``bwd_wy.through_inverse``): dk += diag(beta e) A^T dw +
                    dKK K + dKK^T K, dv = diag(beta) A^T du, dbeta, dgamma; then dg = the reverse cumsum of dgamma

Every product runs on the input dtype with fp32 accumulation, as in the staged kernels; the carried dS' never leaves
fp32. Grid (Hv, walks), 384 threads: two consumer warpgroups run the step above one product after another (TileLang
places their syncs, named barriers over the 256 of them), and a producer warpgroup refills each input tile by TMA
as soon as its last reader in the chunk before has released it (an mbarrier a tile: v_new after dk's state part,
S after dw, dO after K^T Y, X after the inverse, q after A^T dw, v after the v-dots, k at the end of the step), the
gates a chunk ahead in a two-slot ring. Each tile is held once, so the chunk's loads overlap the previous chunk's tail instead of stalling
its start. dq and dk leave per value head in the input dtype for ``chunk_bwd.gva_bwd`` (the key head's sum in fp32,
in head order, and the l2norm backward): half the bytes of fp32 partials, each rounded once.

Measured (internal, the kernels alone on the saved states, 16/32 8192x4, H100): 2.35 ms (18.4 us a chunk step, 128
walks) plus 0.28 for its GVA pass, against 3.26 for the staged dh, dqkwg and WY kernels it replaces. The same step
with synchronous loads on 256 threads took 3.00 ms (23.4 us). A step is about 28 MFLOP of products (5-6 us at one
SM's rate); they still wait on one another, and issuing independent ones together (one wait for two or three)
measured slower (more spills). A warp-specialised form (three warpgroups in lockstep phases) measured slower still
(34 us a step on the H200): ``docs/perf-notes.md`` has what each did.

``build_bwd_walk_ws`` (``KERNEL = "ws"``) is the step warp-specialised without the lockstep: three consumer
warpgroups on 512 threads that hand tiles to one another by mbarriers, so the chain (dS' -> dv_new -> Y -> dS, on
S and A) runs while the rest of A and all of B work beside it (its layout is at the builder).
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.bwd_wy import ROW_BATCH, through_inverse
from flashqla_kernels.gated_delta_rule.hopper.chunk_bwd import C, LOG2E, store_rows
from flashqla_kernels.gated_delta_rule.hopper.chunk_fwd import set_nreg

THREADS = 384  # two consumer warpgroups and the producer
NREG_CONSUMER, NREG_PRODUCER = 232, 40


def supported(K: int, V: int) -> bool:
    """The walk holds dS' [K, V] in fp32 registers and the chunk's tiles whole in shared memory: K, V <= 128."""
    return K <= 128 and V <= 128


@T.macro
def load_tile(src, dst, cs, n, head, width, bar):
    """A chunk's rows of src[:, head, :] into dst [C, width]: TMA for a full chunk (``bar`` counts its bytes), masked
    loads row by row for a ragged one (rows past its end are 0)."""
    if n == C:
        T.tma_copy(src[cs:cs + C, head, :], dst, barrier=bar)
    else:
        for i in T.serial(C):
            for j in T.Parallel(width):
                dst[i, j] = T.if_then_else(i < n, src[cs + T.min(i, n - 1), head, j], T.cast(0, dst.dtype))
        T.fence_proxy_async()


@T.macro
def refill(free, it, src, dst, cs, n, head, width, bar):
    """The chunk's tile into a single-held buffer once its last reader in the chunk before has released it."""
    if it > 0:
        T.barrier_wait(free, (it - 1) % 2)
    load_tile(src, dst, cs, n, head, width, bar)


def build_bwd_walk(Hk: int, Hv: int, K: int, V: int, dtype: str, scale: float, has_dht: bool, store_dh0: bool):
    """The walk kernel: grid (Hv, walks), 384 threads; ``has_dht``: start from ``dht`` (else zeros); ``store_dh0``:
    write the gradient of each walk's start state."""
    if not supported(K, V):
        raise ValueError(f"the fused backward walk holds K and V whole: K, V <= 128, got {K}, {V}")
    group = Hv // Hk
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_walks = T.dynamic("num_walks")
    num_dht = T.dynamic("num_dht")
    num_dh0 = T.dynamic("num_dh0")

    @T.prim_func
    def gdn_bwd_walk(
        q: T.Tensor((num_tokens, Hk, K), dtype),
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        do: T.Tensor((num_tokens, Hv, V), dtype),
        v_new: T.Tensor((num_tokens, Hv, V), dtype),
        h: T.Tensor((num_chunks, Hv, K, V), dtype),
        ag: T.Tensor((num_tokens, Hv, C), "float16"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        dht: T.Tensor((num_dht, Hv, K, V), "float32"),
        walks: T.Tensor((num_walks, 3), "int32"),
        dq: T.Tensor((num_tokens, Hv, K), dtype),
        dk: T.Tensor((num_tokens, Hv, K), dtype),
        dv: T.Tensor((num_tokens, Hv, V), dtype),
        dbeta: T.Tensor((num_tokens, Hv), "float32"),
        dg: T.Tensor((num_tokens, Hv), "float32"),
        dh0: T.Tensor((num_dh0, Hv, K, V), "float32"),
    ):
        with T.Kernel(Hv, num_walks, threads=THREADS) as (bh, bn):
            hk = bh // group
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            n_it = T.alloc_var("int32")
            cs = T.alloc_var("int32")
            n = T.alloc_var("int32")
            bos = walks[bn, 0]
            eos = walks[bn, 1]
            c0 = walks[bn, 2]
            n_it = T.ceildiv(eos - bos, C)
            tx = T.get_thread_binding()

            # the chunk's inputs
            q_sh = T.alloc_shared((C, K), dtype)
            k_sh = T.alloc_shared((C, K), dtype)
            v_sh = T.alloc_shared((C, V), dtype)
            do_sh = T.alloc_shared((C, V), dtype)
            vn_sh = T.alloc_shared((C, V), dtype)
            s_sh = T.alloc_shared((K, V), dtype)
            x_sh = T.alloc_shared((C, C), "float16")
            # formed on chip: dS' in the input dtype, X in it, dv_new, one [C, C] tile for Pt, then dP, then the WY
            # stage's scratch, and the WY stage's A and KKg (Doe and Y take dO's tile, dw q's, once they are read)
            ds_sh = T.alloc_shared((K, V), dtype)
            xb_sh = T.alloc_shared((C, C), dtype)
            dvn_sh = T.alloc_shared((C, V), dtype)
            t_sh = T.alloc_shared((C, C), dtype)
            a_sh = T.alloc_shared((C, C), dtype)
            kkg_sh = T.alloc_shared((C, C), "float16")
            g_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            dgq_sh = T.alloc_shared((C,), "float32")
            st_sh = T.alloc_shared((C,), "float32")
            tr_sh = T.alloc_shared((K,), "float32")
            rowf_sh = T.alloc_shared((C,), "float32")
            cole_sh = T.alloc_shared((C,), "float32")
            db_out = T.alloc_shared((C,), "float32")
            gring = T.alloc_shared((2, 4, C), "float32", scope="shared")
            rdy_qk = T.alloc_barrier(arrive_count=32)
            rdy_s = T.alloc_barrier(arrive_count=32)
            rdy_vd = T.alloc_barrier(arrive_count=32)
            rdy_x = T.alloc_barrier(arrive_count=32)
            rdy_v = T.alloc_barrier(arrive_count=32)
            free_q = T.alloc_barrier(arrive_count=256)
            free_k = T.alloc_barrier(arrive_count=256)
            free_s = T.alloc_barrier(arrive_count=256)
            free_vn = T.alloc_barrier(arrive_count=256)
            free_do = T.alloc_barrier(arrive_count=256)
            free_x = T.alloc_barrier(arrive_count=256)
            free_v = T.alloc_barrier(arrive_count=256)
            g_rdy = T.alloc_barrier(arrive_count=[32] * 2)
            g_free = T.alloc_barrier(arrive_count=[256] * 2)

            if tx < 256:
                set_nreg(NREG_CONSUMER)
                ds_f = T.alloc_fragment((K, V), "float32")
                sd_f = T.alloc_fragment((K, V), "float32")
                red_k = T.alloc_fragment((K,), "float32")
                cv_f = T.alloc_fragment((C, V), "float32")
                ck_f = T.alloc_fragment((C, K), "float32")
                dk_f = T.alloc_fragment((C, K), "float32")
                cc_f = T.alloc_fragment((C, C), "float32")
                kk_f = T.alloc_fragment((C, C), "float32")
                da_f = T.alloc_fragment((C, C), "float32")
                a_f = T.alloc_fragment((C, C), "float32")
                red = T.alloc_fragment((C,), "float32")
                red_v = T.alloc_fragment((C,), "float32")
                red_cc = T.alloc_fragment((C,), "float32")
                red_col = T.alloc_fragment((C,), "float32")
                tot = T.alloc_local((1,), "float32")

                if has_dht:
                    T.copy(dht[bn, bh, :, :], ds_f)
                else:
                    T.clear(ds_f)
                for it in T.serial(n_it):
                    cs = bos + (n_it - 1 - it) * C
                    n = T.min(eos - cs, C)
                    sl = it % 2
                    T.barrier_wait(g_rdy[sl], (it // 2) % 2)
                    for i in T.Parallel(C):
                        g_sh[i] = gring[sl, 0, i]
                        eg_sh[i] = gring[sl, 1, i]
                        er_sh[i] = gring[sl, 2, i]
                        b_sh[i] = gring[sl, 3, i]
                    T.barrier_arrive(g_free[sl])
                    T.barrier_wait(rdy_x, it % 2)
                    T.barrier_wait(rdy_s, it % 2)
                    T.barrier_wait(rdy_qk, it % 2)
                    T.barrier_wait(rdy_vd, it % 2)
                    T.copy(ds_f, ds_sh)
                    for i, j in T.Parallel(C, C):
                        xb_sh[i, j] = x_sh[i, j]

                    # <S, dS'> from the fp32 dS' in registers: the rows' sums, added below in a fixed order
                    for i, j in T.Parallel(K, V):
                        sd_f[i, j] = ds_f[i, j] * s_sh[i, j]
                    T.reduce_sum(sd_f, red_k, dim=1)
                    for i in T.Parallel(K):
                        tr_sh[i] = red_k[i]

                    # Pt = scale (K Q^T) * Gamma^T on j >= i
                    T.gemm(k_sh, q_sh, cc_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        t_sh[i, j] = T.if_then_else(
                            j >= i, cc_f[i, j] * T.exp2((g_sh[j] - g_sh[i]) * LOG2E) * scale, 0.0)
                    # dv_new = diag(r) K dS' + Pt dO
                    T.gemm(k_sh, ds_sh, cv_f, clear_accum=True)
                    for i, j in T.Parallel(C, V):
                        cv_f[i, j] = cv_f[i, j] * er_sh[i]
                    T.gemm(t_sh, do_sh, cv_f)
                    T.copy(cv_f, dvn_sh)
                    # dP = scale (dO v_new^T) * Gamma on j <= i
                    T.gemm(do_sh, vn_sh, cc_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        t_sh[i, j] = T.if_then_else(
                            j <= i, cc_f[i, j] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E) * scale, 0.0)
                    # dk = diag(r) v_new dS'^T + dP^T Q; the state part's k-dots go to the last token
                    T.gemm(vn_sh, ds_sh, dk_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(free_vn)
                    for i, j in T.Parallel(C, K):
                        dk_f[i, j] = dk_f[i, j] * er_sh[i]
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = dk_f[i, j] * k_sh[i, j]
                    T.reduce_sum(ck_f, red, dim=1, batch=ROW_BATCH)
                    for i in T.Parallel(C):
                        st_sh[i] = red[i]
                    T.gemm(t_sh, q_sh, dk_f, transpose_A=True)
                    # dq = scale diag(e) dO S^T + dP K
                    T.gemm(do_sh, s_sh, ck_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = ck_f[i, j] * eg_sh[i] * scale
                    T.gemm(t_sh, k_sh, ck_f)
                    store_rows(ck_f, dq, cs, n, bh, 0, K)
                    # dgamma_i = dq_i.q_i - dk_i.k_i, the last token adding e_C <S, dS'> + the state part's k-dots
                    # (every thread sums them in the same fixed order; rows past a ragged end are 0)
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = ck_f[i, j] * q_sh[i, j] - dk_f[i, j] * k_sh[i, j]
                    T.reduce_sum(ck_f, red, dim=1, batch=ROW_BATCH)
                    tot[0] = 0.0
                    for i in T.serial(C):
                        tot[0] += st_sh[i]
                    for i in T.serial(K):
                        tot[0] += eg_sh[C - 1] * tr_sh[i]
                    for i in T.Parallel(C):
                        dgq_sh[i] = red[i] + T.if_then_else(i == n - 1, tot[0], 0.0)

                    # dS = e_C dS' + Q^T Doe + K^T Y, Doe = scale diag(e) dO and then Y = -diag(e) X^T dv_new in dO's
                    # tile (dO has no reader left in this chunk)
                    for i, j in T.Parallel(C, V):
                        do_sh[i, j] = do_sh[i, j] * eg_sh[i] * scale
                    for i, j in T.Parallel(K, V):
                        ds_f[i, j] = ds_f[i, j] * eg_sh[C - 1]
                    T.gemm(q_sh, do_sh, ds_f, transpose_A=True)
                    T.gemm(xb_sh, dvn_sh, cv_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(C, V):
                        do_sh[i, j] = -eg_sh[i] * cv_f[i, j]
                    T.gemm(k_sh, do_sh, ds_f, transpose_A=True)
                    T.fence_proxy_async()
                    T.barrier_arrive(free_do)

                    # dw = -dv_new S^T, into q's tile (q has no reader left in this chunk)
                    T.gemm(dvn_sh, s_sh, ck_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(free_s)
                    for i, j in T.Parallel(C, K):
                        q_sh[i, j] = -ck_f[i, j]
                    # WY: dA = dw (diag(beta e) K)^T + du (diag(beta) V)^T on the chunk's rows and columns
                    T.gemm(k_sh, k_sh, kk_f, transpose_B=True, clear_accum=True)
                    T.gemm(q_sh, k_sh, da_f, transpose_B=True, clear_accum=True)
                    T.barrier_wait(rdy_v, it % 2)
                    T.gemm(dvn_sh, v_sh, cc_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        da_f[i, j] = T.if_then_else(i < n, T.if_then_else(
                            j < n, (da_f[i, j] * eg_sh[j] + cc_f[i, j]) * b_sh[j], 0.0), 0.0)
                    through_inverse(x_sh, kkg_sh, a_sh, t_sh, kk_f, da_f, a_f, g_sh, b_sh, rowf_sh, cole_sh, red_cc,
                                    red_col, n)
                    T.barrier_arrive(free_x)
                    # dKK = diag(beta) dM * Gamma
                    for i, j in T.Parallel(C, C):
                        t_sh[i, j] = T.if_then_else(
                            j < i, da_f[i, j] * b_sh[i] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E), 0.0)
                    # A^T dw: dk += diag(beta e) A^T dw, and its k-dots
                    T.gemm(a_sh, q_sh, ck_f, transpose_A=True, clear_accum=True)
                    T.fence_proxy_async()
                    T.barrier_arrive(free_q)
                    for i, j in T.Parallel(C, K):
                        dk_f[i, j] = dk_f[i, j] + ck_f[i, j] * b_sh[i] * eg_sh[i]
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = ck_f[i, j] * k_sh[i, j]
                    T.reduce_sum(ck_f, red, dim=1, batch=ROW_BATCH)
                    # A^T du: dv = diag(beta) A^T du, and its v-dots
                    T.gemm(a_sh, dvn_sh, cv_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(C, V):
                        if i < n:
                            dv[cs + i, bh, j] = cv_f[i, j] * b_sh[i]
                    for i, j in T.Parallel(C, V):
                        cv_f[i, j] = cv_f[i, j] * v_sh[i, j]
                    T.reduce_sum(cv_f, red_v, dim=1, batch=ROW_BATCH)
                    T.barrier_arrive(free_v)
                    # dk += dKK K + dKK^T K
                    T.gemm(t_sh, k_sh, dk_f)
                    T.gemm(t_sh, k_sh, dk_f, transpose_A=True)
                    T.barrier_arrive(free_k)
                    store_rows(dk_f, dk, cs, n, bh, 0, K)

                    # dbeta, and dg: the reverse cumsum within the chunk of every dgamma part (one thread a token, a
                    # warp's shuffle scan: fixed order)
                    for i in T.Parallel(C):
                        db_out[i] = red[i] * eg_sh[i] + red_v[i] + rowf_sh[i]
                        st_sh[i] = T.if_then_else(i < n, dgq_sh[i] + red[i] * eg_sh[i] * b_sh[i] + b_sh[i] * rowf_sh[i]
                                                  - cole_sh[i], 0.0)
                    T.sync_threads(1, 256)
                    if tx < n:
                        dbeta[cs + tx, bh] = db_out[tx]
                        # dg_i = the sum of the chunk's dgamma over rows j >= i, one thread a row (fixed order)
                        tot[0] = 0.0
                        for j in T.serial(C):
                            if j >= tx:
                                tot[0] += st_sh[j]
                        dg[cs + tx, bh] = tot[0]
                    T.sync_threads(1, 256)

                if store_dh0:
                    T.copy(ds_f, dh0[bn, bh, :, :])

            else:
                set_nreg(NREG_PRODUCER)
                if tx < 256 + 32:
                    for it in T.serial(n_it):
                        cs = bos + (n_it - 1 - it) * C
                        n = T.min(eos - cs, C)
                        if it > 0:
                            T.barrier_wait(free_s, (it - 1) % 2)
                        T.tma_copy(h[c0 + n_it - 1 - it, bh, :, :], s_sh, barrier=rdy_s)
                        T.barrier_arrive(rdy_s)
                        refill(free_q, it, q, q_sh, cs, n, hk, K, rdy_qk)
                        refill(free_k, it, k, k_sh, cs, n, hk, K, rdy_qk)
                        T.barrier_arrive(rdy_qk)
                elif tx < 256 + 64:
                    for it in T.serial(n_it):
                        cs = bos + (n_it - 1 - it) * C
                        n = T.min(eos - cs, C)
                        refill(free_vn, it, v_new, vn_sh, cs, n, bh, V, rdy_vd)
                        refill(free_do, it, do, do_sh, cs, n, bh, V, rdy_vd)
                        T.barrier_arrive(rdy_vd)
                elif tx < 256 + 96:
                    for it in T.serial(n_it):
                        cs = bos + (n_it - 1 - it) * C
                        n = T.min(eos - cs, C)
                        refill(free_x, it, ag, x_sh, cs, n, bh, C, rdy_x)
                        T.barrier_arrive(rdy_x)
                        refill(free_v, it, v, v_sh, cs, n, bh, V, rdy_v)
                        T.barrier_arrive(rdy_v)
                else:
                    for it in T.serial(n_it):
                        sl = it % 2
                        cs = bos + (n_it - 1 - it) * C
                        n = T.min(eos - cs, C)
                        T.barrier_wait(g_free[sl], (it // 2 + 1) % 2)
                        # padded rows repeat the last valid gamma (every padded gate <= 1; their terms meet zero rows)
                        for i in T.Parallel(C):
                            gring[sl, 0, i] = gamma[cs + T.min(i, n - 1), bh]
                            gring[sl, 1, i] = T.exp2(gamma[cs + T.min(i, n - 1), bh] * LOG2E)
                            gring[sl, 2, i] = T.exp2((gamma[cs + n - 1, bh] - gamma[cs + T.min(i, n - 1), bh]) * LOG2E)
                            gring[sl, 3, i] = T.if_then_else(i < n, beta[cs + T.min(i, n - 1), bh], 0.0)
                        T.barrier_arrive(g_rdy[sl])

    return gdn_bwd_walk


# fixed-order sums everywhere, no atomics: the walk repeats bit for bit
build_bwd_walk.pass_configs = {"tl.disable_warp_specialized": True}


# The warp-specialised walk: the same step on three consumer warpgroups that hand tiles to one another by mbarriers,
# each running as far ahead as its inputs allow, beside a producer warpgroup. Per chunk:
#
#   S (dS' in registers)       dS' -> ds_sh; <S, dS'> (each thread's share, each warp's by a fixed shuffle tree);
#                              dS' *= e_C; Doe = scale diag(e) dO in dO's tile once A and B have read dO; dS' += Q^T
#                              Doe; dS' += K^T Y once A has put Y in the same tile
#   A (the chain, then WY)     Pt; dv_new = diag(r) K dS' + Pt dO; Y = -diag(e) X^T dv_new (X in the input dtype);
#                              dw = -dv_new S^T; K K^T, dA; A = I - X KKg (fp16, as the staged kernels), P = dA A^T,
#                              dM = SL(-A^T P) and, for the column sums as row sums (K K^T is symmetric), P^T A;
#                              rowf, cole, dKK; A^T du: dv (stored) and its v-dots
#   B (dq, dk, the gates)      dP; dq = scale diag(e) dO S^T + dP K (stored) and its q-dots; dk = diag(r) v_new dS'^T
#                              + dP^T Q and its k-dots; then with A's WY tiles dk += diag(beta e) A^T dw + dKK K +
#                              dKK^T K (stored); dbeta, dgamma and dg (the reverse cumsum within the chunk)
#
# The chain runs S -> A -> S: the step's critical path is dS' -> dv_new -> Y -> dS, and the rest of A and all of B
# overlap it. Inputs are held once (227 KB: q, k, v, dO, v_new, S, X; the producer refills each after its last reader
# in the chunk before, the gates a chunk ahead in a two-slot ring of gamma and beta, exp2 formed where used). On chip:
# ds_sh, dv_new, dw, dP (B's), A, KKg, one [C, C] tile for Pt, then X in the input dtype, then P, and one for dA, then
# dKK (read by B). Each warpgroup syncs its own 128 threads on its own named barrier.
WS_THREADS = 512
# setmaxnreg (the four sum to 512): dS' is 128 of S's registers, and S spills at 152; A and B fit 160 (ptxas)
WS_NREG_S, WS_NREG_A, WS_NREG_B, WS_NREG_PRODUCER = 160, 160, 160, 32


def build_bwd_walk_ws(Hk: int, Hv: int, K: int, V: int, dtype: str, scale: float, has_dht: bool, store_dh0: bool):
    """The warp-specialised walk kernel: grid (Hv, walks), 512 threads; arguments and outputs as ``build_bwd_walk``."""
    if not supported(K, V):
        raise ValueError(f"the fused backward walk holds K and V whole: K, V <= 128, got {K}, {V}")
    group = Hv // Hk
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_walks = T.dynamic("num_walks")
    num_dht = T.dynamic("num_dht")
    num_dh0 = T.dynamic("num_dh0")

    @T.prim_func
    def gdn_bwd_walk_ws(
        q: T.Tensor((num_tokens, Hk, K), dtype),
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        do: T.Tensor((num_tokens, Hv, V), dtype),
        v_new: T.Tensor((num_tokens, Hv, V), dtype),
        h: T.Tensor((num_chunks, Hv, K, V), dtype),
        ag: T.Tensor((num_tokens, Hv, C), "float16"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        dht: T.Tensor((num_dht, Hv, K, V), "float32"),
        walks: T.Tensor((num_walks, 3), "int32"),
        dq: T.Tensor((num_tokens, Hv, K), dtype),
        dk: T.Tensor((num_tokens, Hv, K), dtype),
        dv: T.Tensor((num_tokens, Hv, V), dtype),
        dbeta: T.Tensor((num_tokens, Hv), "float32"),
        dg: T.Tensor((num_tokens, Hv), "float32"),
        dh0: T.Tensor((num_dh0, Hv, K, V), "float32"),
    ):
        with T.Kernel(Hv, num_walks, threads=WS_THREADS) as (bh, bn):
            hk = bh // group
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            n_it = T.alloc_var("int32")
            cs = T.alloc_var("int32")
            n = T.alloc_var("int32")
            bos = walks[bn, 0]
            eos = walks[bn, 1]
            c0 = walks[bn, 2]
            n_it = T.ceildiv(eos - bos, C)
            tx = T.get_thread_binding()

            q_sh = T.alloc_shared((C, K), dtype)
            k_sh = T.alloc_shared((C, K), dtype)
            v_sh = T.alloc_shared((C, V), dtype)
            do_sh = T.alloc_shared((C, V), dtype)  # dO, then Doe (S's), then Y (A's for S)
            vn_sh = T.alloc_shared((C, V), dtype)
            s_sh = T.alloc_shared((K, V), dtype)
            x_sh = T.alloc_shared((C, C), "float16")
            ds_sh = T.alloc_shared((K, V), dtype)
            dvn_sh = T.alloc_shared((C, V), dtype)
            dw_sh = T.alloc_shared((C, K), dtype)
            dp_sh = T.alloc_shared((C, C), dtype)
            a_sh = T.alloc_shared((C, C), dtype)
            t1_sh = T.alloc_shared((C, C), dtype)  # Pt, then X, then P
            t2_sh = T.alloc_shared((C, C), dtype)  # dA, then dKK
            kkg_sh = T.alloc_shared((C, C), "float16")  # KKg, fp16 as X for X KKg
            gring = T.alloc_shared((2, 2, C), "float32", scope="shared")  # gamma, beta (exp2 where used)
            tr4 = T.alloc_shared((2, 4), "float32", scope="shared")
            st_sh = T.alloc_shared((C,), "float32", scope="shared")  # the state part's k-dots, then dgamma
            rowf_sh = T.alloc_shared((C,), "float32", scope="shared")
            cole_sh = T.alloc_shared((C,), "float32", scope="shared")
            vd_sh = T.alloc_shared((C,), "float32", scope="shared")
            tot_sh = T.alloc_shared((1,), "float32", scope="shared")

            rdy_q = T.alloc_barrier(arrive_count=32)
            rdy_k = T.alloc_barrier(arrive_count=32)
            rdy_s = T.alloc_barrier(arrive_count=32)
            rdy_do = T.alloc_barrier(arrive_count=32)
            rdy_vn = T.alloc_barrier(arrive_count=32)
            rdy_x = T.alloc_barrier(arrive_count=32)
            rdy_v = T.alloc_barrier(arrive_count=32)
            free_q = T.alloc_barrier(arrive_count=384)
            free_k = T.alloc_barrier(arrive_count=384)
            free_s = T.alloc_barrier(arrive_count=384)
            free_do = T.alloc_barrier(arrive_count=128)
            free_vn = T.alloc_barrier(arrive_count=128)
            free_x = T.alloc_barrier(arrive_count=128)
            free_v = T.alloc_barrier(arrive_count=128)
            g_rdy = T.alloc_barrier(arrive_count=[32] * 2)
            g_free = T.alloc_barrier(arrive_count=[384] * 2)
            ds_rdy = T.alloc_barrier(arrive_count=128)
            ds_free = T.alloc_barrier(arrive_count=256)
            a_do = T.alloc_barrier(arrive_count=128)
            b_do = T.alloc_barrier(arrive_count=128)
            doe_done = T.alloc_barrier(arrive_count=128)
            y_rdy = T.alloc_barrier(arrive_count=128)
            wy_rdy = T.alloc_barrier(arrive_count=128)
            wy_free = T.alloc_barrier(arrive_count=128)
            tr_rdy = T.alloc_barrier(arrive_count=[128] * 2)

            if tx < 128:
                # S: dS' in fp32 registers, the chain's state half
                set_nreg(WS_NREG_S)
                ds_f = T.alloc_fragment((K, V), "float32")
                tp = T.alloc_local((1,), "float32")
                if has_dht:
                    T.copy(dht[bn, bh, :, :], ds_f)
                else:
                    T.clear(ds_f)
                for it in T.serial(n_it):
                    sl = it % 2
                    par = it % 2
                    T.barrier_wait(g_rdy[sl], (it // 2) % 2)
                    if it > 0:
                        T.barrier_wait(ds_free, (it - 1) % 2)
                    T.copy(ds_f, ds_sh)
                    T.fence_proxy_async()
                    T.barrier_arrive(ds_rdy)
                    # <S, dS'> on the fp32 dS': each thread's share, then each warp's by a fixed shuffle tree; B adds
                    # the four in order
                    T.barrier_wait(rdy_s, par)
                    tp[0] = 0.0
                    for i, j in T.Parallel(K, V):
                        tp[0] += ds_f[i, j] * s_sh[i, j]
                    T.barrier_arrive(free_s)
                    tp[0] = T.warp_reduce_sum(tp[0])
                    if tx % 32 == 0:
                        tr4[sl, tx // 32] = tp[0]
                    T.barrier_arrive(tr_rdy[sl])
                    for i, j in T.Parallel(K, V):
                        ds_f[i, j] = ds_f[i, j] * T.exp2(gring[sl, 0, C - 1] * LOG2E)
                    # Doe in dO's tile once A (Pt dO) and B (dP, dO S^T) have read dO
                    T.barrier_wait(rdy_do, par)
                    T.barrier_wait(a_do, par)
                    T.barrier_wait(b_do, par)
                    for i, j in T.Parallel(C, V):
                        do_sh[i, j] = do_sh[i, j] * T.exp2(gring[sl, 0, i] * LOG2E) * scale
                    T.fence_proxy_async()
                    T.sync_threads(1, 128)
                    T.barrier_wait(rdy_q, par)
                    T.gemm(q_sh, do_sh, ds_f, transpose_A=True)
                    T.barrier_arrive(free_q)
                    T.barrier_arrive(doe_done)
                    # dS' += K^T Y, Y in dO's tile from A
                    T.barrier_wait(y_rdy, par)
                    T.barrier_wait(rdy_k, par)
                    T.gemm(k_sh, do_sh, ds_f, transpose_A=True)
                    T.barrier_arrive(free_k)
                    T.barrier_arrive(free_do)
                    T.barrier_arrive(g_free[sl])
                if store_dh0:
                    T.copy(ds_f, dh0[bn, bh, :, :])

            elif tx < 256:
                # A: the chain's value half (Pt, dv_new, Y), then dw and the WY stage
                set_nreg(WS_NREG_A)
                cc_f = T.alloc_fragment((C, C), "float32")
                cv_f = T.alloc_fragment((C, V), "float32")
                kk_f = T.alloc_fragment((C, C), "float32")
                da_f = T.alloc_fragment((C, C), "float32")
                red = T.alloc_fragment((C,), "float32")
                for it in T.serial(n_it):
                    sl = it % 2
                    par = it % 2
                    cs = bos + (n_it - 1 - it) * C
                    n = T.min(eos - cs, C)
                    T.barrier_wait(g_rdy[sl], (it // 2) % 2)
                    # Pt = scale (K Q^T) * Gamma^T on j >= i
                    T.barrier_wait(rdy_q, par)
                    T.barrier_wait(rdy_k, par)
                    T.gemm(k_sh, q_sh, cc_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(free_q)
                    for i, j in T.Parallel(C, C):
                        t1_sh[i, j] = T.if_then_else(
                            j >= i, cc_f[i, j] * T.exp2((gring[sl, 0, j] - gring[sl, 0, i]) * LOG2E) * scale, 0.0)
                    T.fence_proxy_async()
                    T.sync_threads(2, 128)
                    # dv_new = diag(r) K dS' + Pt dO
                    T.barrier_wait(ds_rdy, par)
                    T.gemm(k_sh, ds_sh, cv_f, clear_accum=True)
                    T.barrier_arrive(ds_free)
                    for i, j in T.Parallel(C, V):
                        cv_f[i, j] = cv_f[i, j] * T.exp2((gring[sl, 0, C - 1] - gring[sl, 0, i]) * LOG2E)
                    T.barrier_wait(rdy_do, par)
                    T.gemm(t1_sh, do_sh, cv_f)
                    T.barrier_arrive(a_do)
                    T.copy(cv_f, dvn_sh)
                    # X in the input dtype over Pt (every warp is past Pt dO)
                    T.barrier_wait(rdy_x, par)
                    T.sync_threads(2, 128)
                    for i, j in T.Parallel(C, C):
                        t1_sh[i, j] = x_sh[i, j]
                    T.fence_proxy_async()
                    T.sync_threads(2, 128)
                    # Y = -diag(e) X^T dv_new into dO's tile once S has used Doe
                    T.gemm(t1_sh, dvn_sh, cv_f, transpose_A=True, clear_accum=True)
                    T.barrier_wait(doe_done, par)
                    for i, j in T.Parallel(C, V):
                        do_sh[i, j] = -T.exp2(gring[sl, 0, i] * LOG2E) * cv_f[i, j]
                    T.fence_proxy_async()
                    T.barrier_arrive(y_rdy)

                    # dw = -dv_new S^T, once B has read the chunk before's WY tiles
                    if it > 0:
                        T.barrier_wait(wy_free, (it - 1) % 2)
                    T.barrier_wait(rdy_s, par)
                    T.gemm(dvn_sh, s_sh, cv_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(free_s)
                    for i, j in T.Parallel(C, K):
                        dw_sh[i, j] = -cv_f[i, j]
                    T.fence_proxy_async()
                    T.sync_threads(2, 128)
                    # dA = dw (diag(beta e) K)^T + du (diag(beta) V)^T on the chunk's rows and columns
                    T.gemm(k_sh, k_sh, kk_f, transpose_B=True, clear_accum=True)
                    T.gemm(dw_sh, k_sh, da_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(free_k)
                    T.barrier_wait(rdy_v, par)
                    T.gemm(dvn_sh, v_sh, cc_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        da_f[i, j] = T.if_then_else(i < n, T.if_then_else(
                            j < n, (da_f[i, j] * T.exp2(gring[sl, 0, j] * LOG2E) + cc_f[i, j]) * gring[sl, 1, j], 0.0),
                            0.0)
                    # A = I - X KKg on the chunk's rows, KKg = StrictLower(K K^T * Gamma)
                    for i, j in T.Parallel(C, C):
                        kkg_sh[i, j] = T.if_then_else(
                            j < i, kk_f[i, j] * T.exp2((gring[sl, 0, i] - gring[sl, 0, j]) * LOG2E), 0.0)
                    T.fence_proxy_async()
                    T.sync_threads(2, 128)
                    T.gemm(x_sh, kkg_sh, cc_f, clear_accum=True)
                    T.barrier_arrive(free_x)
                    T.sync_threads(2, 128)
                    for i, j in T.Parallel(C, C):
                        a_sh[i, j] = T.if_then_else(i < n, T.if_then_else(
                            j <= i, T.if_then_else(i == j, 1.0, 0.0) - cc_f[i, j], 0.0), 0.0)
                        t2_sh[i, j] = da_f[i, j]
                    T.fence_proxy_async()
                    T.sync_threads(2, 128)
                    # P = dA A^T into X's tile; then A^T P and P^T A
                    T.gemm(t2_sh, a_sh, cc_f, transpose_B=True, clear_accum=True)
                    T.copy(cc_f, t1_sh)
                    T.fence_proxy_async()
                    T.sync_threads(2, 128)
                    T.gemm(a_sh, t1_sh, da_f, transpose_A=True, clear_accum=True)
                    T.gemm(t1_sh, a_sh, cc_f, transpose_A=True, clear_accum=True)
                    # dM = StrictLower(-A^T P); cole = colsum(diag(beta) dM * KKg) as the row sums of
                    # StrictUpper(-P^T A) * K K^T gated the other way * beta_col; dKK = diag(beta) dM * Gamma
                    for i, j in T.Parallel(C, C):
                        da_f[i, j] = T.if_then_else(j < i, -da_f[i, j], 0.0)
                        cc_f[i, j] = T.if_then_else(
                            j > i, -cc_f[i, j] * kk_f[i, j] * T.exp2((gring[sl, 0, j] - gring[sl, 0, i]) * LOG2E)
                            * gring[sl, 1, j], 0.0)
                    T.reduce_sum(cc_f, red, dim=1)
                    for i in T.Parallel(C):
                        cole_sh[i] = red[i]
                    for i, j in T.Parallel(C, C):
                        t2_sh[i, j] = T.if_then_else(
                            j < i, da_f[i, j] * gring[sl, 1, i] * T.exp2((gring[sl, 0, i] - gring[sl, 0, j]) * LOG2E),
                            0.0)
                        da_f[i, j] = T.if_then_else(
                            j < i, da_f[i, j] * kk_f[i, j] * T.exp2((gring[sl, 0, i] - gring[sl, 0, j]) * LOG2E), 0.0)
                    T.reduce_sum(da_f, red, dim=1)
                    for i in T.Parallel(C):
                        rowf_sh[i] = red[i]
                    # A^T du: dv = diag(beta) A^T du, and its v-dots
                    T.gemm(a_sh, dvn_sh, cv_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(C, V):
                        if i < n:
                            dv[cs + i, bh, j] = cv_f[i, j] * gring[sl, 1, i]
                    for i, j in T.Parallel(C, V):
                        cv_f[i, j] = cv_f[i, j] * v_sh[i, j]
                    T.barrier_arrive(free_v)
                    T.reduce_sum(cv_f, red, dim=1)
                    for i in T.Parallel(C):
                        vd_sh[i] = red[i]
                    T.fence_proxy_async()
                    T.barrier_arrive(wy_rdy)
                    T.barrier_arrive(g_free[sl])
                    T.sync_threads(2, 128)

            elif tx < 384:
                # B: dq, dk and the gate gradients
                set_nreg(WS_NREG_B)
                cc_f = T.alloc_fragment((C, C), "float32")
                ck_f = T.alloc_fragment((C, K), "float32")
                dk_f = T.alloc_fragment((C, K), "float32")
                red_q = T.alloc_fragment((C,), "float32")
                red_k = T.alloc_fragment((C,), "float32")
                dgq_f = T.alloc_fragment((C,), "float32")
                tot = T.alloc_local((1,), "float32")
                for it in T.serial(n_it):
                    sl = it % 2
                    par = it % 2
                    cs = bos + (n_it - 1 - it) * C
                    n = T.min(eos - cs, C)
                    T.barrier_wait(g_rdy[sl], (it // 2) % 2)
                    # dP = scale (dO v_new^T) * Gamma on j <= i
                    T.barrier_wait(rdy_do, par)
                    T.barrier_wait(rdy_vn, par)
                    T.gemm(do_sh, vn_sh, cc_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        dp_sh[i, j] = T.if_then_else(
                            j <= i, cc_f[i, j] * T.exp2((gring[sl, 0, i] - gring[sl, 0, j]) * LOG2E) * scale, 0.0)
                    # dq = scale diag(e) dO S^T + dP K, stored; its q-dots
                    T.barrier_wait(rdy_s, par)
                    T.gemm(do_sh, s_sh, ck_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(b_do)
                    T.barrier_arrive(free_s)
                    T.fence_proxy_async()
                    T.sync_threads(3, 128)
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = ck_f[i, j] * T.exp2(gring[sl, 0, i] * LOG2E) * scale
                    T.barrier_wait(rdy_k, par)
                    T.gemm(dp_sh, k_sh, ck_f)
                    store_rows(ck_f, dq, cs, n, bh, 0, K)
                    T.barrier_wait(rdy_q, par)
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = ck_f[i, j] * q_sh[i, j]
                    T.reduce_sum(ck_f, red_q, dim=1)
                    # dk = diag(r) v_new dS'^T + dP^T Q; the state part's k-dots go to the last token
                    T.barrier_wait(ds_rdy, par)
                    T.gemm(vn_sh, ds_sh, dk_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(ds_free)
                    T.barrier_arrive(free_vn)
                    for i, j in T.Parallel(C, K):
                        dk_f[i, j] = dk_f[i, j] * T.exp2((gring[sl, 0, C - 1] - gring[sl, 0, i]) * LOG2E)
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = dk_f[i, j] * k_sh[i, j]
                    T.reduce_sum(ck_f, red_k, dim=1)
                    for i in T.Parallel(C):
                        st_sh[i] = red_k[i]
                    T.gemm(dp_sh, q_sh, dk_f, transpose_A=True)
                    T.barrier_arrive(free_q)
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = dk_f[i, j] * k_sh[i, j]
                    T.reduce_sum(ck_f, red_k, dim=1)
                    for i in T.Parallel(C):
                        dgq_f[i] = red_q[i] - red_k[i]
                    # A's WY tiles: dk += diag(beta e) A^T dw (its k-dots) + dKK K + dKK^T K, stored
                    T.barrier_wait(wy_rdy, par)
                    T.gemm(a_sh, dw_sh, ck_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(C, K):
                        dk_f[i, j] = dk_f[i, j] + ck_f[i, j] * gring[sl, 1, i] * T.exp2(gring[sl, 0, i] * LOG2E)
                    for i, j in T.Parallel(C, K):
                        ck_f[i, j] = ck_f[i, j] * k_sh[i, j]
                    T.reduce_sum(ck_f, red_q, dim=1)
                    T.gemm(t2_sh, k_sh, dk_f)
                    T.gemm(t2_sh, k_sh, dk_f, transpose_A=True)
                    T.barrier_arrive(free_k)
                    store_rows(dk_f, dk, cs, n, bh, 0, K)
                    # the last token's e_C <S, dS'> + the state part's k-dots, one thread in a fixed order
                    T.barrier_wait(tr_rdy[sl], (it // 2) % 2)
                    T.sync_threads(3, 128)
                    if tx == 256:
                        tot[0] = 0.0
                        for i in T.serial(C):
                            tot[0] += st_sh[i]
                        tot[0] += T.exp2(gring[sl, 0, C - 1] * LOG2E) * (
                            ((tr4[sl, 0] + tr4[sl, 1]) + tr4[sl, 2]) + tr4[sl, 3])
                        tot_sh[0] = tot[0]
                    T.sync_threads(3, 128)
                    for i in T.Parallel(C):
                        if i < n:
                            dbeta[cs + i, bh] = red_q[i] * T.exp2(gring[sl, 0, i] * LOG2E) + vd_sh[i] + rowf_sh[i]
                        st_sh[i] = T.if_then_else(
                            i < n, dgq_f[i] + T.if_then_else(i == n - 1, tot_sh[0], 0.0)
                            + red_q[i] * T.exp2(gring[sl, 0, i] * LOG2E) * gring[sl, 1, i]
                            + gring[sl, 1, i] * rowf_sh[i] - cole_sh[i], 0.0)
                    T.sync_threads(3, 128)
                    T.barrier_arrive(wy_free)
                    T.barrier_arrive(g_free[sl])
                    # dg_i = the sum of the chunk's dgamma over rows j >= i, one thread a row (fixed order)
                    if tx - 256 < n:
                        tot[0] = 0.0
                        for j in T.serial(C):
                            if j >= tx - 256:
                                tot[0] += st_sh[j]
                        dg[cs + tx - 256, bh] = tot[0]
                    T.sync_threads(3, 128)

            else:
                set_nreg(WS_NREG_PRODUCER)
                if tx < 384 + 32:
                    for it in T.serial(n_it):
                        cs = bos + (n_it - 1 - it) * C
                        n = T.min(eos - cs, C)
                        refill(free_q, it, q, q_sh, cs, n, hk, K, rdy_q)
                        T.barrier_arrive(rdy_q)
                        if it > 0:
                            T.barrier_wait(free_s, (it - 1) % 2)
                        T.tma_copy(h[c0 + n_it - 1 - it, bh, :, :], s_sh, barrier=rdy_s)
                        T.barrier_arrive(rdy_s)
                        refill(free_k, it, k, k_sh, cs, n, hk, K, rdy_k)
                        T.barrier_arrive(rdy_k)
                elif tx < 384 + 64:
                    for it in T.serial(n_it):
                        cs = bos + (n_it - 1 - it) * C
                        n = T.min(eos - cs, C)
                        refill(free_do, it, do, do_sh, cs, n, bh, V, rdy_do)
                        T.barrier_arrive(rdy_do)
                        refill(free_vn, it, v_new, vn_sh, cs, n, bh, V, rdy_vn)
                        T.barrier_arrive(rdy_vn)
                elif tx < 384 + 96:
                    for it in T.serial(n_it):
                        cs = bos + (n_it - 1 - it) * C
                        n = T.min(eos - cs, C)
                        refill(free_x, it, ag, x_sh, cs, n, bh, C, rdy_x)
                        T.barrier_arrive(rdy_x)
                        refill(free_v, it, v, v_sh, cs, n, bh, V, rdy_v)
                        T.barrier_arrive(rdy_v)
                else:
                    for it in T.serial(n_it):
                        sl = it % 2
                        cs = bos + (n_it - 1 - it) * C
                        n = T.min(eos - cs, C)
                        T.barrier_wait(g_free[sl], (it // 2 + 1) % 2)
                        # padded rows repeat the last valid gamma (every padded gate <= 1; their terms meet zero rows)
                        for i in T.Parallel(C):
                            gring[sl, 0, i] = gamma[cs + T.min(i, n - 1), bh]
                            gring[sl, 1, i] = T.if_then_else(i < n, beta[cs + T.min(i, n - 1), bh], 0.0)
                        T.barrier_arrive(g_rdy[sl])

    return gdn_bwd_walk_ws


# every hand-off between warpgroups is an mbarrier and every sync inside one its own named barrier: the planner's
# syncs would be whole-CTA barriers inside a warpgroup's branch
build_bwd_walk_ws.pass_configs = {"tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": True}


# which walk kernel runs: "plain" (one step after another on two warpgroups, the measured one) or "ws" (three
# warpgroups handing tiles to one another, opt-in until docs/perf-notes.md has its GPU tests and its time)
KERNEL = "plain"
KERNELS = ("ws", "plain")


def builder():
    """The walk kernel's builder (``KERNEL``'s)."""
    if KERNEL not in KERNELS:
        raise ValueError(f"bwd_walk.KERNEL must be one of {KERNELS}; got {KERNEL!r}")
    return build_bwd_walk_ws if KERNEL == "ws" else build_bwd_walk


def bwd_walk(q, k, v, do, v_new, h, ag, gamma, beta, dht, walks, *, scale: float, store_dh0: bool):
    """Every gradient of the chunk backward in one walk per (walk, value head).

    Args:
        q, k: [T, Hk, K] bf16/fp16 (normalised if the op normalises). v, do, v_new: [T, Hv, V] same dtype (v_new the
        forward's saved one). h: [>= NC, Hv, K, V] the forward's saved states, in q's dtype. ag: [T, Hv, 64] fp16
        (``kkt_solve``'s X). gamma, beta: [T, Hv] fp32. dht: [W, Hv, K, V] fp32, the gradient of each walk's end state,
        or None (zeros). walks: [W, 3] int32 (start, end, first chunk) of each walk (``plan.make_bwd_plan``'s).
        scale: the output scale. store_dh0: return the gradient of each walk's start state.

    Returns:
        (dq [T, Hv, K] and dk [T, Hv, K] per value head in q's dtype (``chunk_bwd.gva_bwd`` sums them in fp32), dv
        [T, Hv, V] in v's dtype, dbeta [T, Hv] fp32, dg [T, Hv] fp32 the gradient of the raw g, dh0 [W, Hv, K, V] fp32 or None).
        Rows outside every walk are not written.
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    W = walks.shape[0]
    kernel = toolkit.compile_kernel(builder(), Hk, Hv, K, V, toolkit.tl_dtype(q.dtype), float(scale),
                                    dht is not None, store_dh0)
    dq = toolkit.empty((Tn, Hv, K), q.dtype, q.device)
    dk = toolkit.empty((Tn, Hv, K), q.dtype, q.device)
    dv = toolkit.empty((Tn, Hv, V), v.dtype, q.device)
    dbeta = toolkit.empty((Tn, Hv), torch.float32, q.device)
    dg = toolkit.empty((Tn, Hv), torch.float32, q.device)
    dh0 = toolkit.empty((W, Hv, K, V), torch.float32, q.device) if store_dh0 else None
    if dht is None:
        dht = toolkit.unread((1, Hv, K, V), torch.float32, q.device)  # not read without has_dht
    if W > 0:
        kernel(q, k, v, do, v_new, h, ag, gamma, beta, dht, walks, dq, dk, dv, dbeta, dg,
               dh0 if store_dh0 else toolkit.unread((1, Hv, K, V), torch.float32, q.device))
    return dq, dk, dv, dbeta, dg, dh0
