"""Stage 4: the chunk forward. One CTA walks one segment (a whole sequence, or a slice of it under context
parallelism) for one value head and one bDV-wide slice of V, keeping the state S [K, bDV] in fp32 registers: W, Vd,
Vn and the per-chunk states never touch HBM. Writes o and, for a sequence's last segment, the final state.

Per chunk, gate-factored (FlashQLA), with Ag from ``kkt_solve`` and incoming state S:

    U  = K S                           W  = V - exp(gamma) U            Vd = Ag W       (= FLA's v_new)
    O  = exp(gamma) scale Q S + Pg Vd,  Pg = scale Gamma * Q K^T        (lower triangle, Gamma_ij = exp(g_i - g_j))
    S <- exp(gamma_C) S + K^T Vn,       Vn = exp(gamma_C - gamma) Vd

The chunk step is split over four warpgroups that run concurrently (FlashQLA's layout):

    WG0 state    S (fp32 registers): S -> smem, S *= exp(gamma_C), S += K^T Vn
    WG1 values   U = K S, W = V - exp(gamma) U (formed in the accumulator's registers), Vd = Ag W, Vn
    WG2 output   P = Q K^T, Pg in the accumulator's registers, O = exp(gamma) Q S, O += Pg Vd (wgmma with A in
                 registers), O -> shared memory (stmatrix) -> one bulk store
    WG3 producer warp 0: q, k; warp 1: v slice, beta; warp 2: Ag, gamma (TMA for full chunks, masked loads for
                 the ragged tail), double-buffered against ``ready`` / ``free`` mbarriers

Per chunk the critical chain is S -> smem, K S, W, Ag W, Vn, K^T Vn; Q K^T, Pg, Q S and the output GEMM run on WG2
beside it, and the next chunk's tiles land while this one computes. WG0 waits only for Vn (``bar_vn``), not for the
output GEMM, before its state update; WG2 arrives at the next step's ``bar_start`` as soon as its last shared-memory
read (the Pg Vd GEMM) is done, so its O store to global memory overlaps the next step of the other warpgroups. The
output warpgroup is the busiest of the three (three GEMMs and the Pg mask): its O leaves through a shared tile and one
TMA store (a ragged last chunk: element stores from registers), not 32 bounds-checked four-byte stores a thread.

W, Ag, Vd and Pg are fp16 (the Ag W and Pg Vd GEMMs) for bf16 inputs too: 8x finer rounding than bf16 (the values are
bounded like A0), which halves the bf16 error against the float64 reference; q, k, S and Vn stay in the input dtype.
W is formed in the K S accumulator and stored with one fragment copy (stmatrix) because an element loop over shared
memory gets a warpgroup barrier per element pair from TileLang's sync planner, on the values warpgroup's critical chain.

With ``l2norm`` the stage reads q and k as given and ``kkt_solve``'s inverse norms ``rn`` (rq, rk per token and key
head), folded into the row scalings the chunk step already applies: ``K_n S = diag(rk) K S`` (W uses ``exp(gamma) rk``),
``Q_n S = diag(rq) Q S`` (O uses ``exp(gamma) rq``), ``Q_n K_n^T = diag(rq) Q K^T diag(rk)`` (Pg: one exp2 of
``(gamma_i log2 e + log2 rq_i) - (gamma_j log2 e - log2 rk_j)``, the same instruction count as without l2norm) and
``K_n^T Vn = K^T diag(rk) Vn`` (Vn carries rk).

The step can also write each chunk's entering state h (WG0: one bulk TMA store of the shared-memory copy it makes
anyway, waited on only before the next step overwrites it) and Vd = v_new (WG1), what the backward needs. The
forward under grad does so beside o (``save_states``: the backward then skips its recompute), and the backward's
recompute (``chunk_states``, ``build_chunk_states``) does so instead of o: its output warpgroup keeps only its part
of the barrier protocol and the producer loads no q.

Grid (V / bDV, Hv, segments), 512 threads. ``segs[s] = (start, end, init, final)``: token range, the row of ``h_init``
to start from (-1: zeros) and the row of ``ht`` to write (-1: none).
"""
import tilelang
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.plan import CHUNK

C = CHUNK
LOG2E = toolkit.LOG2E
THREADS = 512
# setmaxnreg budgets (sum 504 <= 512 = 64K registers / 128 threads). ptxas -v, K = V = bDV = 128 bf16: no spills.
# The producer's masked tail loads need the 88 (FlashQLA's 32 spills ~100 B there); without setmaxnreg the
# 128-register cap of 512 threads spills S (1.5 KB). The output warpgroup keeps the fp16 Pg operand (16 registers)
# beside its accumulator, so 8 registers move to it from the values warpgroup (20-44 bytes of spills at 128 / 128,
# none at 120 / 136).
NREG_STATE, NREG_VALUES, NREG_OUTPUT, NREG_PRODUCER = 160, 120, 136, 88
NREG_LAUNCH = 65536 // THREADS  # what every warp holds at launch: setmaxnreg.inc may only raise it, .dec only lower it


# sm_90's opt-in shared memory for one CTA (227 KB), static and dynamic together: a kernel over it fails to launch
SMEM_PER_CTA = 232448


def shared_bytes(K: int, bDV: int, dtype: str, l2norm: bool, store_states: bool, o_tile: bool) -> int:
    """Shared memory of one CTA of the chunk step (the module doc; ``o_tile``: O leaves through a shared tile)."""
    e = 2  # bf16 / fp16 inputs; W, Ag, Vd and Pg are fp16
    tiles = 2 * C * K * e * 2 + 2 * C * bDV * e + 2 * C * C * 2 + K * bDV * e  # q, k, v, Ag double-buffered; S
    tiles += C * bDV * (2 + e)  # Vd, Vn
    tiles += C * bDV * 2 if dtype != "float16" else 0  # W's own fp16 tile
    tiles += C * bDV * e * (int(store_states) + int(o_tile))  # v_new's and O's store tiles
    gates = 4 * (2 * C * 2 + C * 2)  # gamma, beta double-buffered; exp(gamma), exp(gamma_C - gamma)
    gates += 4 * (2 * C * 4 + C * 2) if l2norm else 0  # rq, rk, lq, lk double-buffered; exp(gamma) rk, exp(gamma) rq
    return tiles + gates + 128  # the mbarriers


def set_nreg(count: int):
    """``setmaxnreg`` towards ``count`` from the launch allocation: .inc above it, .dec below (an .inc to a lower count
    is an illegal instruction on the H200: every launch faults)."""
    return T.set_max_nreg(count, 1 if count >= NREG_LAUNCH else 0)


def _chunk_step(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, scale: float, store_final: bool,
                l2norm: bool, store_states: bool, outputs: bool = True):
    """The step both kernels run (the module doc), as a macro over their tensors; ``store_states``: write each
    chunk's entering state and v_new; ``outputs``: write o (and ht with ``store_final``)."""
    group = Hv // Hk
    # the operands of the Ag W and Pg Vd GEMMs: W, Ag, Vd, Pg
    idt = "float16"
    # bf16 inputs: W gets its own fp16 tile; fp16 inputs: W is written over this chunk's V tile
    separate_w = idt != dtype
    # O through a shared tile where it fits beside the rest (saving the states for the backward at K = bDV = 128 it
    # would not: that build stores O from registers)
    o_tile = outputs and shared_bytes(K, bDV, dtype, l2norm, store_states, True) <= SMEM_PER_CTA

    @T.macro
    def chunk_step(q, k, v, a0, gamma, beta, h_init, segs, o, ht, rn, hs, vns, seg_chunk0):
        with T.Kernel(V // bDV, Hv, segs.shape[0], threads=THREADS) as (bv, bh, bs):
            hk = bh // group
            v0 = bv * bDV
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            init = T.alloc_var("int32")
            fin = T.alloc_var("int32")
            n_it = T.alloc_var("int32")
            s0 = segs[bs, 0]
            s1 = segs[bs, 1]
            init = segs[bs, 2]
            fin = segs[bs, 3]
            n_it = T.ceildiv(s1 - s0, C)
            tx = T.get_thread_binding()

            q_sh = T.alloc_shared((2, C, K), dtype)
            k_sh = T.alloc_shared((2, C, K), dtype)
            v_sh = T.alloc_shared((2, C, bDV), dtype)
            a_sh = T.alloc_shared((2, C, C), "float16")
            g_sh = T.alloc_shared((2, C), "float32", scope="shared")
            b_sh = T.alloc_shared((2, C), "float32", scope="shared")
            h_sh = T.alloc_shared((K, bDV), dtype)
            vd_sh = T.alloc_shared((C, bDV), idt)
            w_sh = T.alloc_shared((C, bDV), idt) if separate_w else None
            vn_sh = T.alloc_shared((C, bDV), dtype)
            # with store_states: v_new (= Vd in the input dtype) leaves from here by one bulk store
            vs_sh = T.alloc_shared((C, bDV), dtype) if store_states else None
            # O of a full chunk leaves from here by one bulk store (the output warpgroup's leader)
            o_sh = T.alloc_shared((C, bDV), dtype) if o_tile else None
            eg_sh = T.alloc_shared((C,), "float32", scope="shared")
            er_sh = T.alloc_shared((C,), "float32", scope="shared")
            # l2norm: the inverse norms of the chunk's q and k rows, the log2 gates carrying them (Pg's scaling
            # rq_i rk_j exp(g_i - g_j) is then one exp2, as without l2norm) and exp(gamma) times each
            rq_sh = T.alloc_shared((2, C), "float32", scope="shared") if l2norm else None
            rk_sh = T.alloc_shared((2, C), "float32", scope="shared") if l2norm else None
            lq_sh = T.alloc_shared((2, C), "float32", scope="shared") if l2norm else None
            lk_sh = T.alloc_shared((2, C), "float32", scope="shared") if l2norm else None
            ek_sh = T.alloc_shared((C,), "float32", scope="shared") if l2norm else None
            eq_sh = T.alloc_shared((C,), "float32", scope="shared") if l2norm else None

            # V is read element-wise (W = V - exp(gamma) U) in the accumulator's layout: eight rows a warp, which in a
            # linear tile of 256-byte rows all fall in the same four banks; swizzled, they fall in 32
            T.annotate_layout({v_sh: tilelang.layout.make_swizzled_layout(v_sh)})
            s_f = T.alloc_fragment((K, bDV), "float32")
            u_f = T.alloc_fragment((C, bDV), "float32")
            vd_f = T.alloc_fragment((C, bDV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, bDV), "float32")
            pg_f = T.alloc_fragment((C, C), idt)

            # ready: the 3 loader warps arrive (TMA bytes on top); free: the 3 consumer warpgroups
            ready = T.alloc_barrier(arrive_count=[96] * 2)
            free = T.alloc_barrier(arrive_count=[384] * 2)
            bar_start = T.alloc_barrier(arrive_count=384)
            bar_state = T.alloc_barrier(arrive_count=256)
            bar_vd = T.alloc_barrier(arrive_count=128)
            bar_vn = T.alloc_barrier(arrive_count=128)

            if tx < 128:
                set_nreg(NREG_STATE)
                if init >= 0:
                    T.copy(h_init[init, bh, :, v0:v0 + bDV], s_f)
                else:
                    T.clear(s_f)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    if store_states:
                        # the previous step's store must have read h_sh before it is overwritten; the thread that
                        # issued it waits, and bar_start holds the others until it has
                        if tx == 0:
                            T.tma_store_wait(0)
                    T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    T.copy(s_f, h_sh)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_state)
                    T.barrier_wait(bar_state, it % 2)
                    if store_states:
                        # the state entering this chunk, as h_sh holds it: one bulk store from shared memory that
                        # runs while this warpgroup and the values warpgroup go on (register stores stalled the walk)
                        T.tma_copy(h_sh, hs[seg_chunk0[bs] + it, bh, :, v0:v0 + bDV])
                    for i, j in T.Parallel(K, bDV):
                        s_f[i, j] = s_f[i, j] * eg_sh[C - 1]
                    T.barrier_wait(bar_vn, it % 2)
                    T.gemm(k_sh[it % 2, :, :], vn_sh, s_f, transpose_A=True)
                    T.barrier_arrive(free[it % 2])
                if store_states:
                    if tx == 0:
                        T.tma_store_wait(0)
                if store_final:
                    if fin >= 0:
                        T.copy(s_f, ht[fin, bh, :, v0:v0 + bDV])

            elif tx < 256:
                set_nreg(NREG_VALUES)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    if store_states:
                        # the previous step's v_new store must have read vs_sh (as h_sh's, thread 128 waits)
                        if tx == 128:
                            T.tma_store_wait(0)
                    T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    if l2norm:
                        for i in T.Parallel(C):
                            eg_sh[i] = T.exp2(g_sh[it % 2, i] * LOG2E)
                            ek_sh[i] = T.exp2(g_sh[it % 2, i] * LOG2E) * rk_sh[it % 2, i]
                            eq_sh[i] = T.exp2(g_sh[it % 2, i] * LOG2E) * rq_sh[it % 2, i]
                            er_sh[i] = T.exp2((g_sh[it % 2, C - 1] - g_sh[it % 2, i]) * LOG2E) * rk_sh[it % 2, i]
                    else:
                        for i in T.Parallel(C):
                            eg_sh[i] = T.exp2(g_sh[it % 2, i] * LOG2E)
                            er_sh[i] = T.exp2((g_sh[it % 2, C - 1] - g_sh[it % 2, i]) * LOG2E)
                    T.barrier_arrive(bar_state)
                    T.barrier_wait(bar_state, it % 2)
                    T.gemm(k_sh[it % 2, :, :], h_sh, u_f, clear_accum=True)
                    # W = V - exp(gamma) U in registers, then one fragment store
                    if l2norm:
                        for i, j in T.Parallel(C, bDV):
                            u_f[i, j] = v_sh[it % 2, i, j] - ek_sh[i] * u_f[i, j]
                    else:
                        for i, j in T.Parallel(C, bDV):
                            u_f[i, j] = v_sh[it % 2, i, j] - eg_sh[i] * u_f[i, j]
                    if separate_w:
                        T.copy(u_f, w_sh)
                    else:
                        T.copy(u_f, v_sh[it % 2, :, :])
                    T.fence_proxy_async()
                    # Vd = Ag W on the tile as loaded
                    if separate_w:
                        T.gemm(a_sh[it % 2, :, :], w_sh, vd_f, clear_accum=True)
                    else:
                        T.gemm(a_sh[it % 2, :, :], v_sh[it % 2, :, :], vd_f, clear_accum=True)
                    T.copy(vd_f, vd_sh)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_vd)
                    if store_states:
                        T.copy(vd_f, vs_sh)
                    # Vn scaled in the registers, then one fragment store (stmatrix), as W is: the state warpgroup
                    # waits for Vn, and element stores with swizzled addresses cost more
                    for i, j in T.Parallel(C, bDV):
                        vd_f[i, j] = vd_f[i, j] * er_sh[i]
                    T.copy(vd_f, vn_sh)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_vn)
                    T.barrier_arrive(free[it % 2])
                    if store_states:
                        # v_new of full chunks: one bulk store (thread 128) that runs while the next step starts; a
                        # ragged chunk's rows end inside the box, so it stores row by row
                        cs = s0 + it * C
                        if cs + C <= s1:
                            T.tma_copy(vs_sh, vns[cs:cs + C, bh, v0:v0 + bDV])
                        else:
                            for i, j in T.Parallel(C, bDV):
                                if cs + i < s1:
                                    vns[cs + i, bh, v0 + j] = vs_sh[i, j]
                if store_states:
                    if tx == 128:
                        T.tma_store_wait(0)

            elif tx < 384:
                set_nreg(NREG_OUTPUT)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    if it == 0:  # later steps: arrived at the end of the previous one, before its O store
                        T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    if outputs:  # the recompute needs no output: only the barrier protocol
                        T.gemm(q_sh[it % 2, :, :], k_sh[it % 2, :, :], p_f, transpose_B=True, clear_accum=True)
                        if l2norm:
                            for i, j in T.Parallel(C, C):
                                p_f[i, j] = T.if_then_else(
                                    j <= i, p_f[i, j] * T.exp2(lq_sh[it % 2, i] - lk_sh[it % 2, j]) * scale, 0.0)
                        else:
                            for i, j in T.Parallel(C, C):
                                p_f[i, j] = T.if_then_else(
                                    j <= i, p_f[i, j] * T.exp2((g_sh[it % 2, i] - g_sh[it % 2, j]) * LOG2E) * scale,
                                    0.0)
                        T.copy(p_f, pg_f)
                        T.barrier_wait(bar_state, it % 2)
                        T.gemm(q_sh[it % 2, :, :], h_sh, o_f, clear_accum=True)
                        if l2norm:
                            for i, j in T.Parallel(C, bDV):
                                o_f[i, j] = o_f[i, j] * eq_sh[i] * scale
                        else:
                            for i, j in T.Parallel(C, bDV):
                                o_f[i, j] = o_f[i, j] * eg_sh[i] * scale
                        T.barrier_wait(bar_vd, it % 2)
                        T.gemm(pg_f, vd_sh, o_f)
                    # this step's shared-memory reads (h_sh, eg_sh, vd_sh) are done: release the next step to the
                    # other warpgroups now and store O while they run it
                    T.barrier_arrive(bar_start)
                    if outputs:
                        cs = s0 + it * C
                        if o_tile and cs + C <= s1:
                            # registers -> o_sh (stmatrix) -> one bulk store: 32 four-byte global stores a thread,
                            # each with its bounds test, cost this warpgroup (the walk's busiest) more than the copy.
                            # The store's issuer is the lane elect.sync picks in the first warp; all of that warp wait
                            # (a thread with no store in flight returns at once) before the tile is rewritten
                            if tx < 288:
                                T.tma_store_wait(0)
                            T.copy(o_f, o_sh)
                            T.fence_proxy_async()
                            T.tma_copy(o_sh, o[cs:cs + C, bh, v0:v0 + bDV])
                        else:
                            for i, j in T.Parallel(C, bDV):
                                if cs + i < s1:
                                    o[cs + i, bh, v0 + j] = o_f[i, j]
                    T.barrier_arrive(free[it % 2])
                if o_tile:
                    if tx < 288:
                        T.tma_store_wait(0)

            else:
                set_nreg(NREG_PRODUCER)
                if tx < 384 + 32:
                    for it in T.serial(n_it):
                        T.barrier_wait(free[it % 2], (it // 2 + 1) % 2)
                        cs = s0 + it * C
                        # the recompute reads no q (its output warpgroup is idle)
                        if cs + C <= s1:
                            if outputs:
                                T.tma_copy(q[cs:cs + C, hk, :], q_sh[it % 2, :, :], barrier=ready[it % 2])
                            T.tma_copy(k[cs:cs + C, hk, :], k_sh[it % 2, :, :], barrier=ready[it % 2])
                        elif not outputs:
                            for i, j in T.Parallel(C, K):
                                k_sh[it % 2, i, j] = T.if_then_else(cs + i < s1, k[T.min(cs + i, s1 - 1), hk, j],
                                                                    T.cast(0, dtype))
                            T.fence_proxy_async()
                        else:
                            for i, j in T.Parallel(C, K):
                                q_sh[it % 2, i, j] = T.if_then_else(cs + i < s1, q[T.min(cs + i, s1 - 1), hk, j],
                                                                    T.cast(0, dtype))
                                k_sh[it % 2, i, j] = T.if_then_else(cs + i < s1, k[T.min(cs + i, s1 - 1), hk, j],
                                                                    T.cast(0, dtype))
                            T.fence_proxy_async()
                        T.barrier_arrive(ready[it % 2])
                elif tx < 384 + 64:
                    for it in T.serial(n_it):
                        T.barrier_wait(free[it % 2], (it // 2 + 1) % 2)
                        cs = s0 + it * C
                        if cs + C <= s1:
                            T.tma_copy(v[cs:cs + C, bh, v0:v0 + bDV], v_sh[it % 2, :, :], barrier=ready[it % 2])
                        else:
                            for i, j in T.Parallel(C, bDV):
                                v_sh[it % 2, i, j] = T.if_then_else(
                                    cs + i < s1, v[T.min(cs + i, s1 - 1), bh, v0 + j], T.cast(0, dtype))
                            T.fence_proxy_async()
                        for i in T.Parallel(C):
                            b_sh[it % 2, i] = T.if_then_else(cs + i < s1, beta[T.min(cs + i, s1 - 1), bh], 0.0)
                        T.barrier_arrive(ready[it % 2])
                elif tx < 384 + 96:
                    for it in T.serial(n_it):
                        T.barrier_wait(free[it % 2], (it // 2 + 1) % 2)
                        cs = s0 + it * C
                        if cs + C <= s1:
                            T.tma_copy(a0[cs:cs + C, bh, :], a_sh[it % 2, :, :], barrier=ready[it % 2])
                        else:
                            for i, j in T.Parallel(C, C):
                                a_sh[it % 2, i, j] = T.if_then_else(
                                    cs + i < s1, a0[T.min(cs + i, s1 - 1), bh, j], T.cast(0, "float16"))
                            # the values warpgroup's wgmma reads this tile (async proxy)
                            T.fence_proxy_async()
                        # padded rows repeat the last valid gamma: Gamma stays <= 1 and their terms are zero
                        for i in T.Parallel(C):
                            g_sh[it % 2, i] = gamma[T.min(cs + i, s1 - 1), bh]
                        if l2norm:
                            for i in T.Parallel(C):
                                rq_sh[it % 2, i] = rn[T.min(cs + i, s1 - 1), hk, 0]
                                rk_sh[it % 2, i] = rn[T.min(cs + i, s1 - 1), hk, 1]
                                lq_sh[it % 2, i] = (gamma[T.min(cs + i, s1 - 1), bh] * LOG2E
                                                    + T.log2(rn[T.min(cs + i, s1 - 1), hk, 0]))
                                lk_sh[it % 2, i] = (gamma[T.min(cs + i, s1 - 1), bh] * LOG2E
                                                    - T.log2(rn[T.min(cs + i, s1 - 1), hk, 1]))
                        T.barrier_arrive(ready[it % 2])


    return chunk_step


def build_chunk_fwd(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, scale: float, store_final: bool,
                    l2norm: bool = False, save_states: bool = False):
    """The chunk_fwd kernel for q/k/v in ``dtype`` (bfloat16 or float16); ``store_final``: write ``ht``;
    ``l2norm``: normalise q and k by ``rn`` (the module doc); ``save_states``: also write every chunk's entering
    state and v_new for the backward (``chunk_states``' outputs)."""
    step = _chunk_step(Hk, Hv, K, V, bDV, dtype, scale, store_final, l2norm, save_states)
    num_tokens = T.dynamic("num_tokens")
    num_segs = T.dynamic("num_segs")
    num_init = T.dynamic("num_init")
    num_final = T.dynamic("num_final")
    num_rn = T.dynamic("num_rn")
    if save_states:
        num_chunks = T.dynamic("num_chunks")

        @T.prim_func
        def gdn_chunk_fwd_saving(
            q: T.Tensor((num_tokens, Hk, K), dtype),
            k: T.Tensor((num_tokens, Hk, K), dtype),
            v: T.Tensor((num_tokens, Hv, V), dtype),
            a0: T.Tensor((num_tokens, Hv, C), "float16"),
            gamma: T.Tensor((num_tokens, Hv), "float32"),
            beta: T.Tensor((num_tokens, Hv), "float32"),
            h_init: T.Tensor((num_init, Hv, K, V), "float32"),
            segs: T.Tensor((num_segs, 4), "int32"),
            o: T.Tensor((num_tokens, Hv, V), dtype),
            ht: T.Tensor((num_final, Hv, K, V), "float32"),
            rn: T.Tensor((num_rn, Hk, 2), "float32"),
            seg_chunk0: T.Tensor((num_segs,), "int32"),
            hs: T.Tensor((num_chunks, Hv, K, V), dtype),
            vns: T.Tensor((num_tokens, Hv, V), dtype),
        ):
            step(q, k, v, a0, gamma, beta, h_init, segs, o, ht, rn, hs, vns, seg_chunk0)

        return gdn_chunk_fwd_saving

    @T.prim_func
    def gdn_chunk_fwd(
        q: T.Tensor((num_tokens, Hk, K), dtype),
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        a0: T.Tensor((num_tokens, Hv, C), "float16"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        h_init: T.Tensor((num_init, Hv, K, V), "float32"),
        segs: T.Tensor((num_segs, 4), "int32"),
        o: T.Tensor((num_tokens, Hv, V), dtype),
        ht: T.Tensor((num_final, Hv, K, V), "float32"),
        rn: T.Tensor((num_rn, Hk, 2), "float32"),
    ):
        step(q, k, v, a0, gamma, beta, h_init, segs, o, ht, rn, None, None, None)

    return gdn_chunk_fwd


def build_chunk_states(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str):
    """The backward's recompute kernel ``gdn_chunk_states`` (the module doc): keys already normalised, every
    chunk's entering state and v_new written in ``dtype``."""
    step = _chunk_step(Hk, Hv, K, V, bDV, dtype, 1.0, False, False, True, outputs=False)
    num_tokens = T.dynamic("num_tokens")
    num_segs = T.dynamic("num_segs")
    num_init = T.dynamic("num_init")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_chunk_states(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        a0: T.Tensor((num_tokens, Hv, C), "float16"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        h_init: T.Tensor((num_init, Hv, K, V), "float32"),
        segs: T.Tensor((num_segs, 4), "int32"),
        seg_chunk0: T.Tensor((num_segs,), "int32"),
        hs: T.Tensor((num_chunks, Hv, K, V), dtype),
        vns: T.Tensor((num_tokens, Hv, V), dtype),
    ):
        step(None, k, v, a0, gamma, beta, h_init, segs, None, None, None, hs, vns, seg_chunk0)

    return gdn_chunk_states


def chunk_states(k, v, ag, gamma, beta, h_init, segs, seg_chunk0, num_chunks: int, *, bDV: int):
    """The backward's recompute of the forward's per-chunk states on this stage's warp-specialised step.

    Args:
        k: [T, Hk, K] bf16/fp16, normalised if the op normalises. v: [T, Hv, V]; ag, gamma, beta: as ``chunk_fwd``.
        h_init, segs: as ``chunk_fwd`` (a ``plan.Plan``'s, with context parallelism's start states). seg_chunk0: [S]
        int32, the plan's first chunk row of each segment. num_chunks: NC. bDV: V slice per CTA.

    Returns:
        (h [NC, Hv, K, V], the state entering every chunk; v_new [T, Hv, V]), both in k's dtype; rows of a padded
        tail are not written.
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    kernel = toolkit.compile_kernel(build_chunk_states, Hk, Hv, K, V, bDV, toolkit.tl_dtype(k.dtype))
    h = toolkit.empty((num_chunks, Hv, K, V), k.dtype, k.device)
    v_new = toolkit.empty((Tn, Hv, V), k.dtype, k.device)
    if segs.shape[0] > 0:
        kernel(k, v, ag, gamma, beta, h_init, segs, seg_chunk0, h, v_new)
    return h, v_new


def chunk_fwd(q, k, v, ag, gamma, beta, h_init, segs, o, ht, *, scale: float, bDV: int, rn=None, states=None):
    """Run the chunk_fwd stage in place.

    Args:
        q, k: [T, Hk, K] bf16/fp16; v, o: [T, Hv, V] (o is written); ag: [T, Hv, 64] fp16 (``kkt_solve``'s Ag);
        gamma, beta: [T, Hv] fp32; h_init: [R, Hv, K, V] fp32 start states (R >= 1); segs: [S, 4] int32 (see the
        module doc); ht: [N, Hv, K, V] fp32 (written) or None. scale: output scale. bDV: V slice per CTA (32, 64, 128).
        rn: [T, Hk, 2] fp32 inverse l2 norms of q and k (``kkt_solve``'s, with l2norm) or None.
        states: None, or (seg_chunk0 [S] int32 the plan's first chunk row of each segment, h [>= NC, Hv, K, V] and
        v_new [T, Hv, V] in q's dtype): also write ``chunk_states``' outputs into h and v_new, for the backward.
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    store_final = ht is not None
    kernel = toolkit.compile_kernel(build_chunk_fwd, Hk, Hv, K, V, bDV, toolkit.tl_dtype(q.dtype), float(scale),
                                    store_final, rn is not None, states is not None)
    if ht is None:
        # the kernel's ht argument, not written without store_final
        ht = toolkit.unread((1, Hv, K, V), torch.float32, q.device)
    if rn is None:
        rn = toolkit.unread((1, Hk, 2), torch.float32, q.device)  # not read without l2norm
    if states is None:
        kernel(q, k, v, ag, gamma, beta, h_init, segs, o, ht, rn)
    else:
        kernel(q, k, v, ag, gamma, beta, h_init, segs, o, ht, rn, *states)
