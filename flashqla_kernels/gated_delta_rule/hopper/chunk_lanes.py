"""The two-lane chunk step of ``chunk_fwd`` (``chunk_fwd.LANES = 2``, slices of 64 columns or more).

On one chain the values and state warpgroups take turns: each waits while the other works, and the tensor cores idle
through every hand-off. The slice is therefore walked as two independent chains, its two column halves, offset by
half a step:

    WG0, WG1  state of lane 0 / lane 1 (half of S each, 64 fp32 registers a thread at bDV 128)
    WG2       values: lane 0, then lane 1, of each step
    WG3       output: Q K^T and Pg once per step, then Q S, Pg Vd and the O store per lane
    WG4       producer, as ``chunk_fwd``'s; it also forms the per-row gate factors exp(gamma) and exp(gamma_C - gamma)

While WG2 works on lane 1, lane 0's state warpgroup updates its S and publishes the next step's, so WG2 goes on to
lane 0 of the next step without waiting. Every hand-off is an mbarrier per lane (no step-wide barrier): ``st`` (S in
h_sh), ``hfree`` (K S and Q S have read it), ``vdb`` / ``vdfree`` (Vd for the output GEMM), ``vnb`` (Vn for the state
update). Each output element is the same products summed in the same order as on one chain (N-splitting a GEMM does
not change its K order), so the two walks agree bit for bit.
"""
import tilelang.language as T

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.plan import CHUNK

C = CHUNK
LOG2E = toolkit.LOG2E
# the two-lane step: a state warpgroup per lane, 640 threads at 96 registers each. setmaxnreg.inc draws only on what
# the CTA's own .dec released, so the budgets sum to 5 x 96 (a sum of 512, as at 512 threads, deadlocked the first
# launch on the GPU). A lane's state warpgroup keeps its 96 (64 for its half of S; 88 spilled 1.2 KB).
THREADS = 640
NREG_STATE = 96
# (values, output, producer): the split of the 288 registers left, by what the step does: the plain forward, the
# forward that saves the states for a backward, the backward's recompute of the states (no outputs). ptxas -v over
# fourteen splits at K = V = 128: none is spill-free in every variant (where the producer gets too few, the whole
# kernel spills more), but each of these has no spills in the variants it serves: bf16 and fp16, with and without
# l2norm and the final state, slices of 64 and 128.
NREG_SPLIT = {"plain": (104, 104, 80), "saving": (88, 112, 88), "recompute": (104, 88, 96)}
NREG_LAUNCH = 65536 // THREADS // 8 * 8  # registers are allocated 8 a thread at a time


def set_nreg(count: int):
    """``setmaxnreg`` towards ``count`` from the 96-register launch allocation: .inc above it, .dec below, nothing
    at it."""
    # the call is returned: the kernel's parser emits an expression statement's value
    return T.set_max_nreg(count, 1 if count > NREG_LAUNCH else 0) if count != NREG_LAUNCH else None


def chunk_step_lanes(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, scale: float, store_final: bool,
                      l2norm: bool, store_states: bool, outputs: bool = True):
    """The chunk step on two lanes (the module doc), as a macro over ``chunk_fwd``'s kernel tensors; arguments as
    ``chunk_fwd._chunk_step``'s.

    Every per-lane tile is a 2-D buffer of its own, and the lane code is a macro called once per lane with that
    lane's buffers: fragment copies into a slice of a 3-D tile at a run-time lane index lose the stmatrix path."""
    group = Hv // Hk
    idt = "float16"
    separate_w = idt != dtype
    H = bDV // 2  # one lane's columns
    nreg_values, nreg_output, nreg_producer = NREG_SPLIT[
        "recompute" if not outputs else "saving" if store_states else "plain"]
    # one barrier per lane and hand-off; a phase completes once per chunk step. hfree (the lane's h_sh reads of a
    # step are done: K S, Q S) also counts the state warpgroup's first thread once its bulk store of h_sh has read
    # it; vdfree (Pg Vd has read vd_sh) counts the values warpgroup's (thread 256) once its v_new store has read vs_sh.
    n_hfree = 128 + (128 if outputs else 0) + (1 if store_states else 0)
    n_vdfree = (128 if outputs else 0) + (1 if store_states else 0)

    @T.macro
    def publish(s_f, lane, it, first, tx, bs, bh, v0, h_sh, st, hfree, hs, seg_chunk0):
        # the state entering step ``it`` of ``lane`` to h_sh, once the lane's readers of step it - 1 are done
        # (``first``: step 0, a Python bool, so no branch is left in the loop)
        if not first:
            if store_states:
                # and the lane's previous bulk store has read h_sh (thread 0 issued it)
                if tx == 0:
                    T.tma_store_wait(0)
                    T.barrier_arrive(hfree[lane])
            T.barrier_wait(hfree[lane], (it - 1) % 2)
        T.copy(s_f, h_sh)
        T.fence_proxy_async()
        T.barrier_arrive(st[lane])
        if store_states:
            # every thread's part of h_sh is written: one bulk store from shared memory
            T.barrier_wait(st[lane], it % 2)
            # issued by the whole warpgroup: TileLang elects its first thread (thread 0 of the lane's warpgroup, the
            # one that waits for the store) with elect.sync over full warps, which hangs under a one-thread branch
            T.tma_copy(h_sh, hs[seg_chunk0[bs] + it, bh, :, v0 + lane * H:v0 + lane * H + H])

    @T.macro
    def update(s_f, lane, it, k_sh, vn_sh, vnb, eg_sh):
        # S <- exp(gamma_C) S + K^T Vn for step ``it`` of ``lane``
        for i, j in T.Parallel(K, H):
            s_f[i, j] = s_f[i, j] * eg_sh[it % 2, C - 1]
        T.barrier_wait(vnb[lane], it % 2)
        T.gemm(k_sh[it % 2, :, :], vn_sh, s_f, transpose_A=True)

    @T.macro
    def state(s_f, lane, n_it, init, fin, tx, bs, bh, v0, h_init, ht, k_sh, h_sh, vn_sh, eg_sh, ready, free, st, hfree,
              vnb, hs, seg_chunk0):
        # one lane's state warpgroup (``tx``: its thread index within the warpgroup): S in registers, published to
        # h_sh before each step and updated by the step's Vn. The GEMM sits at one unconditional place in the loop
        # (a second site gave ptxas two register assignments of the accumulator and a trip through local memory).
        if init >= 0:
            T.copy(h_init[init, bh, :, v0 + lane * H:v0 + lane * H + H], s_f)
        else:
            T.clear(s_f)
        if n_it > 0:  # an empty segment stores no state
            publish(s_f, lane, 0, True, tx, bs, bh, v0, h_sh, st, hfree, hs, seg_chunk0)
        for it in T.serial(n_it):
            T.barrier_wait(ready[it % 2], (it // 2) % 2)
            update(s_f, lane, it, k_sh, vn_sh, vnb, eg_sh)
            T.barrier_arrive(free[it % 2])
            if it + 1 < n_it:
                publish(s_f, lane, it + 1, False, tx, bs, bh, v0, h_sh, st, hfree, hs, seg_chunk0)
        if store_states:
            if tx == 0:
                T.tma_store_wait(0)
        if store_final:
            if fin >= 0:
                T.copy(s_f, ht[fin, bh, :, v0 + lane * H:v0 + lane * H + H])

    @T.macro
    def values(lane, it, tx, s0, s1, bh, v0, k_sh, a_sh, v_sh, h_sh, w_sh, vd_sh, vn_sh, vs_sh, eg_sh, ek_sh,
               er_sh, u_f, vd_f, st, hfree, vdb, vdfree, vnb, vns):
        # U = K S, W = V - exp(gamma) U, Vd = Ag W, Vn for step ``it`` of ``lane``
        T.barrier_wait(st[lane], it % 2)
        T.gemm(k_sh[it % 2, :, :], h_sh, u_f, clear_accum=True)
        T.barrier_arrive(hfree[lane])
        if l2norm:
            for i, j in T.Parallel(C, H):
                u_f[i, j] = v_sh[it % 2, i, j] - ek_sh[it % 2, i] * u_f[i, j]
        else:
            for i, j in T.Parallel(C, H):
                u_f[i, j] = v_sh[it % 2, i, j] - eg_sh[it % 2, i] * u_f[i, j]
        if separate_w:
            T.copy(u_f, w_sh)
            T.fence_proxy_async()
            T.gemm(a_sh[it % 2, :, :], w_sh, vd_f, clear_accum=True)
        else:
            T.copy(u_f, v_sh[it % 2, :, :])
            T.fence_proxy_async()
            T.gemm(a_sh[it % 2, :, :], v_sh[it % 2, :, :], vd_f, clear_accum=True)
        if it > 0:
            if store_states:
                # the lane's previous v_new store must have read vs_sh (thread 256 issued it)
                if tx == 256:
                    T.tma_store_wait(0)
                    T.barrier_arrive(vdfree[lane])
            T.barrier_wait(vdfree[lane], (it - 1) % 2)
        if outputs:
            T.copy(vd_f, vd_sh)
        if store_states:
            T.copy(vd_f, vs_sh)
        T.fence_proxy_async()
        T.barrier_arrive(vdb[lane])
        # Vn scaled in the registers, then one fragment store
        for i, j in T.Parallel(C, H):
            vd_f[i, j] = vd_f[i, j] * er_sh[it % 2, i]
        T.copy(vd_f, vn_sh)
        T.fence_proxy_async()
        T.barrier_arrive(vnb[lane])
        if store_states:
            # v_new of full chunks: one bulk store (thread 256) once every thread's part of vs_sh is written; a
            # ragged chunk's rows end inside the box, so it stores row by row
            T.barrier_wait(vdb[lane], it % 2)
            cs = s0 + it * C
            if cs + C <= s1:
                # the warpgroup issues it; TileLang elects thread 256 (as the state warpgroup's store)
                T.tma_copy(vs_sh, vns[cs:cs + C, bh, v0 + lane * H:v0 + lane * H + H])
            else:
                for i, j in T.Parallel(C, H):
                    if cs + i < s1:
                        vns[cs + i, bh, v0 + lane * H + j] = vs_sh[i, j]

    @T.macro
    def output(lane, it, s0, s1, bh, v0, q_sh, h_sh, vd_sh, eg_sh, eq_sh, pg_f, o_f, st, hfree, vdb, vdfree, o):
        # O = exp(gamma) scale Q S + Pg Vd for step ``it`` of ``lane``, stored from the registers
        T.barrier_wait(st[lane], it % 2)
        T.gemm(q_sh[it % 2, :, :], h_sh, o_f, clear_accum=True)
        T.barrier_arrive(hfree[lane])
        if l2norm:
            for i, j in T.Parallel(C, H):
                o_f[i, j] = o_f[i, j] * eq_sh[it % 2, i] * scale
        else:
            for i, j in T.Parallel(C, H):
                o_f[i, j] = o_f[i, j] * eg_sh[it % 2, i] * scale
        T.barrier_wait(vdb[lane], it % 2)
        T.gemm(pg_f, vd_sh, o_f)
        T.barrier_arrive(vdfree[lane])
        cs = s0 + it * C
        if cs + C <= s1:
            T.copy(o_f, o[cs:cs + C, bh, v0 + lane * H:v0 + lane * H + H])
        else:
            for i, j in T.Parallel(C, H):
                if cs + i < s1:
                    o[cs + i, bh, v0 + lane * H + j] = o_f[i, j]

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
            v_sh0 = T.alloc_shared((2, C, H), dtype)
            v_sh1 = T.alloc_shared((2, C, H), dtype)
            a_sh = T.alloc_shared((2, C, C), "float16")
            g_sh = T.alloc_shared((2, C), "float32", scope="shared")
            b_sh = T.alloc_shared((2, C), "float32", scope="shared")
            # the per-row gate factors of each stage, formed by the producer: exp(gamma) (times rk for K S's rows
            # and rq for Q S's with l2norm) and exp(gamma_C - gamma) (times rk)
            eg_sh = T.alloc_shared((2, C), "float32", scope="shared")
            er_sh = T.alloc_shared((2, C), "float32", scope="shared")
            ek_sh = T.alloc_shared((2, C), "float32", scope="shared") if l2norm else None
            eq_sh = T.alloc_shared((2, C), "float32", scope="shared") if l2norm else None
            lq_sh = T.alloc_shared((2, C), "float32", scope="shared") if l2norm else None
            lk_sh = T.alloc_shared((2, C), "float32", scope="shared") if l2norm else None
            h_sh0 = T.alloc_shared((K, H), dtype)
            h_sh1 = T.alloc_shared((K, H), dtype)
            vd_sh0 = T.alloc_shared((C, H), idt) if outputs else None
            vd_sh1 = T.alloc_shared((C, H), idt) if outputs else None
            w_sh0 = T.alloc_shared((C, H), idt) if separate_w else None
            w_sh1 = T.alloc_shared((C, H), idt) if separate_w else None
            vn_sh0 = T.alloc_shared((C, H), dtype)
            vn_sh1 = T.alloc_shared((C, H), dtype)
            vs_sh0 = T.alloc_shared((C, H), dtype) if store_states else None
            vs_sh1 = T.alloc_shared((C, H), dtype) if store_states else None

            s_a = T.alloc_fragment((K, H), "float32")
            s_b = T.alloc_fragment((K, H), "float32")
            u_f = T.alloc_fragment((C, H), "float32")
            vd_f = T.alloc_fragment((C, H), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, H), "float32")
            pg_f = T.alloc_fragment((C, C), idt)

            ready = T.alloc_barrier(arrive_count=[96] * 2)
            free = T.alloc_barrier(arrive_count=[512] * 2)
            st = T.alloc_barrier(arrive_count=[128] * 2)  # h_sh of the lane holds its entering state
            hfree = T.alloc_barrier(arrive_count=[n_hfree] * 2)
            vdb = T.alloc_barrier(arrive_count=[128] * 2)  # vd_sh / vs_sh of the lane written
            vdfree = T.alloc_barrier(arrive_count=[max(n_vdfree, 1)] * 2)
            vnb = T.alloc_barrier(arrive_count=[128] * 2)  # vn_sh of the lane written

            if tx < 128:
                set_nreg(NREG_STATE)
                state(s_a, 0, n_it, init, fin, tx, bs, bh, v0, h_init, ht, k_sh, h_sh0, vn_sh0, eg_sh, ready, free, st,
                      hfree, vnb, hs, seg_chunk0)
            elif tx < 256:
                set_nreg(NREG_STATE)
                state(s_b, 1, n_it, init, fin, tx - 128, bs, bh, v0, h_init, ht, k_sh, h_sh1, vn_sh1, eg_sh, ready,
                      free, st, hfree, vnb, hs, seg_chunk0)
            elif tx < 384:
                set_nreg(nreg_values)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    values(0, it, tx, s0, s1, bh, v0, k_sh, a_sh, v_sh0, h_sh0, w_sh0, vd_sh0, vn_sh0, vs_sh0,
                           eg_sh, ek_sh, er_sh, u_f, vd_f, st, hfree, vdb, vdfree, vnb, vns)
                    values(1, it, tx, s0, s1, bh, v0, k_sh, a_sh, v_sh1, h_sh1, w_sh1, vd_sh1, vn_sh1, vs_sh1,
                           eg_sh, ek_sh, er_sh, u_f, vd_f, st, hfree, vdb, vdfree, vnb, vns)
                    T.barrier_arrive(free[it % 2])
                if store_states:
                    if tx == 256:
                        T.tma_store_wait(0)

            elif tx < 512:
                set_nreg(nreg_output)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    if outputs:
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
                        output(0, it, s0, s1, bh, v0, q_sh, h_sh0, vd_sh0, eg_sh, eq_sh, pg_f, o_f, st, hfree, vdb,
                               vdfree, o)
                        output(1, it, s0, s1, bh, v0, q_sh, h_sh1, vd_sh1, eg_sh, eq_sh, pg_f, o_f, st, hfree, vdb,
                               vdfree, o)
                    T.barrier_arrive(free[it % 2])

            else:
                set_nreg(nreg_producer)
                if tx < 512 + 32:
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
                elif tx < 512 + 64:
                    for it in T.serial(n_it):
                        T.barrier_wait(free[it % 2], (it // 2 + 1) % 2)
                        cs = s0 + it * C
                        if cs + C <= s1:
                            T.tma_copy(v[cs:cs + C, bh, v0:v0 + H], v_sh0[it % 2, :, :], barrier=ready[it % 2])
                            T.tma_copy(v[cs:cs + C, bh, v0 + H:v0 + bDV], v_sh1[it % 2, :, :],
                                       barrier=ready[it % 2])
                        else:
                            for i, j in T.Parallel(C, H):
                                v_sh0[it % 2, i, j] = T.if_then_else(
                                    cs + i < s1, v[T.min(cs + i, s1 - 1), bh, v0 + j], T.cast(0, dtype))
                                v_sh1[it % 2, i, j] = T.if_then_else(
                                    cs + i < s1, v[T.min(cs + i, s1 - 1), bh, v0 + H + j], T.cast(0, dtype))
                            T.fence_proxy_async()
                        for i in T.Parallel(C):
                            b_sh[it % 2, i] = T.if_then_else(cs + i < s1, beta[T.min(cs + i, s1 - 1), bh], 0.0)
                        T.barrier_arrive(ready[it % 2])
                elif tx < 512 + 96:
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
                            eg_sh[it % 2, i] = T.exp2(gamma[T.min(cs + i, s1 - 1), bh] * LOG2E)
                        if l2norm:
                            for i in T.Parallel(C):
                                ek_sh[it % 2, i] = (T.exp2(gamma[T.min(cs + i, s1 - 1), bh] * LOG2E)
                                                    * rn[T.min(cs + i, s1 - 1), hk, 1])
                                eq_sh[it % 2, i] = (T.exp2(gamma[T.min(cs + i, s1 - 1), bh] * LOG2E)
                                                    * rn[T.min(cs + i, s1 - 1), hk, 0])
                                er_sh[it % 2, i] = (T.exp2((gamma[T.min(cs + C - 1, s1 - 1), bh]
                                                            - gamma[T.min(cs + i, s1 - 1), bh]) * LOG2E)
                                                    * rn[T.min(cs + i, s1 - 1), hk, 1])
                                lq_sh[it % 2, i] = (gamma[T.min(cs + i, s1 - 1), bh] * LOG2E
                                                    + T.log2(rn[T.min(cs + i, s1 - 1), hk, 0]))
                                lk_sh[it % 2, i] = (gamma[T.min(cs + i, s1 - 1), bh] * LOG2E
                                                    - T.log2(rn[T.min(cs + i, s1 - 1), hk, 1]))
                        else:
                            for i in T.Parallel(C):
                                er_sh[it % 2, i] = T.exp2((gamma[T.min(cs + C - 1, s1 - 1), bh]
                                                           - gamma[T.min(cs + i, s1 - 1), bh]) * LOG2E)
                        T.barrier_arrive(ready[it % 2])

    return chunk_step
