"""Stage 4, warp-specialised variant (``FLASHQLA_KERNELS_VARIANT=ws``): the same fused forward as ``fused_fwd``, same
inputs, outputs and algebra, with the chunk step split over four warpgroups that run concurrently (FlashQLA's layout):

    WG0 state    S (fp32 registers, 160 regs/thread): S -> smem, S *= exp(gamma_C), S += K^T Vn
    WG1 values   U = K S, W = V - exp(gamma) U (in place of V), Vd = Ag W, Vn = exp(gamma_C - gamma) Vd
    WG2 output   P = Q K^T, Ag = Gamma * A0 * beta_col, O = exp(gamma) Q S, Pg = Gamma * P, O += Pg Vd, store O
    WG3 producer warp 0: q, k; warp 1: v slice, beta; warp 2: A0, gamma (TMA for full chunks, masked loads for
                 the ragged tail), double-buffered against ``ready``/``free`` mbarriers

Per chunk the critical chain is S -> smem, K S, W, Ag W, Vn, K^T Vn; Ag, Q K^T, Q S, Pg and the output GEMM run on
WG2 beside it instead of between its steps, and the next chunk's tiles land while this one computes.
Unlike FlashQLA, WG0 waits only for Vn (``bar_vn``), not for the output GEMM, before its state update, and WG2 stores
O from registers (no o staging buffer, no store warp).

Grid (V / bDV, Hv, segments), 512 threads; ``segs`` as in ``fused_fwd``.

Two variant parts take element loops off the output warpgroup, which the trace showed to be the step's critical
path (H200, 16/32 8192x4, bDV 128: 10900 cycles a step, 4300 of them in its Ag loop and 2900 in its Pg loop, both
issue-bound on per-element swizzled shared-memory addressing while the values warpgroup's W loop competed for the
same schedulers):

- ``a_gated`` (``agp``): the ``a0`` input already holds Ag (``prep_v2(..., gated=True)``); the values warpgroup
  multiplies the TMA tile directly (fp16: needs ``inner="float16"`` or fp16 inputs), no Ag loop, no ``bar_ag``;
- ``p_in_registers`` (``prs``): Pg = scale * Gamma * P is formed in the Q K^T accumulator's registers, cast there, and
  the output GEMM reads it from registers (wgmma with A in registers), no Pg tile in shared memory; and the output
  warpgroup arrives at the next step's ``bar_start`` as soon as its last shared-memory read (the Pg Vd GEMM) is
  done, so its O store to global memory (~1700 cycles at bDV 128) overlaps the next step of the other warpgroups
  instead of delaying it.

``trace=True`` builds a diagnostic twin (``trace_step``): the same schedule, no final state, and thread 0 of each
warpgroup of CTA (0, 0, 0) writes ``clock64`` stamps at the hand-off points of every chunk step into ``ht[0, 0]``
(``TRACE_EVENTS`` events x ``TRACE_STEPS`` steps per warpgroup, cycles since that warpgroup started, as fp32): where
a step's time goes, measured on the device without a profiler. The untraced kernel's code is unchanged by it.
"""
import tilelang.language as T
import torch

from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK, LOG2E, compile_kernel, tl_dtype, trailing_flags

C = CHUNK
THREADS = 512
# setmaxnreg budgets (sum 504 <= 512 = 64K registers / 128 threads). ptxas -v, K = V = bDV = 128 bf16, both inner
# dtypes: no spills. The producer's masked tail loads need the 88 (FlashQLA's 32 spills ~100 B there); without
# setmaxnreg the 128-register cap of 512 threads spills S (1.5 KB).
NREG_STATE, NREG_VALUES, NREG_OUTPUT, NREG_PRODUCER = 160, 128, 128, 88
# prs keeps the fp16 Pg operand (16 registers) beside the output accumulator: 8 registers move from the values
# warpgroup to the output one (ptxas -v: 20-44 bytes of spills at 128 / 128, none at 120 / 136)
NREG_VALUES_PRS, NREG_OUTPUT_PRS = 120, 136
NREG_LAUNCH = 65536 // THREADS  # what every warp holds at launch: setmaxnreg.inc may only raise it, .dec only lower it


def set_nreg(count: int):
    """``setmaxnreg`` towards ``count`` from the launch allocation: .inc above it, .dec below (an .inc to a lower count
    is an illegal instruction on the H200: the first prs build asked ``.inc 120`` and every launch faulted)."""
    return T.set_max_nreg(count, 1 if count >= NREG_LAUNCH else 0)
# trace=True: stamps per warpgroup (state, values, output, producer warp 0) and chunk steps recorded
TRACE_EVENTS, TRACE_STEPS = 10, 64
TRACE_NAMES = (
    ("ready", "start", "S->smem", "state", "S*decay", "Vn", "K^T Vn"),
    ("ready", "start", "exp gates", "state", "K S", "W", "Ag", "Ag W", "Vd->smem", "Vn->smem"),
    ("ready", "start", "Q K^T", "Ag->smem", "Pg->smem", "state", "Q S", "Vd", "Pg Vd", "store O"),
    ("free", "issued"),
)


def build_fused_fwd_ws(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, scale: float, store_final: bool,
                       inner: str = "", trace: bool = False, w_in_registers: bool = False, a_gated: bool = False,
                       p_in_registers: bool = False):
    """``inner``: dtype of the W, Ag, Vd and Pg operands (the Ag W and Pg Vd GEMMs); "" = the input dtype. "float16"
    with bf16 inputs keeps those four in fp16 (8x finer rounding; the values are bounded like A0, which the default
    already stores in fp16) while q, k, S and Vn stay bf16 (variant ``ws16``). ``trace``: see the module doc (then
    ``store_final`` must be False: ``ht`` holds the stamps). ``w_in_registers`` (variant part ``wreg``): W is formed in
    the K S accumulator's registers and stored with one fragment copy (stmatrix), instead of an element loop over
    shared memory into which TileLang's sync planner puts a warpgroup barrier per element pair (32 per chunk step
    on the values warpgroup's critical chain; seen in the generated CUDA). ``a_gated``, ``p_in_registers``: see the
    module doc."""
    if a_gated and (inner or dtype) != "float16":
        raise ValueError(f"a_gated needs the fp16 inner operands (inner='float16' or fp16 inputs), got "
                         f"dtype={dtype!r}, inner={inner!r}: Ag arrives in fp16 and W must match it")
    if trace and (store_final or K * V < 4 * TRACE_EVENTS * TRACE_STEPS):
        raise ValueError(f"trace=True needs store_final=False and K*V >= {4 * TRACE_EVENTS * TRACE_STEPS}")
    group = Hv // Hk
    idt = inner or dtype

    @T.macro
    def stamp(ht, tx, bv, bh, bs, wg, event, it):
        # trace builds: thread 0 of the warpgroup of CTA (0, 0, 0) stores clock64 mod 2^24 (exact in fp32; the
        # reader unwraps the differences); other builds emit nothing
        if trace:
            if bv == 0 and bh == 0 and bs == 0 and tx % 128 == 0 and it < TRACE_STEPS:
                ht[0, 0, ((wg * TRACE_EVENTS + event) * TRACE_STEPS + it) // V,
                   ((wg * TRACE_EVENTS + event) * TRACE_STEPS + it) % V] = T.cast(
                    T.call_extern("int64", "clock64") % 16777216, "float32")

    @T.macro
    def ag_times_w(ht, tx, bv, bh, bs, it, a_tile, ag_sh, bar_ag, w_tile, vd_f):
        # Vd = Ag W (values warpgroup): agp multiplies the loaded tile, else waits for the output warpgroup's Ag
        if a_gated:
            stamp(ht, tx, bv, bh, bs, 1, 6, it)
            T.gemm(a_tile, w_tile, vd_f, clear_accum=True)
        else:
            T.barrier_wait(bar_ag, it % 2)
            stamp(ht, tx, bv, bh, bs, 1, 6, it)
            T.gemm(ag_sh, w_tile, vd_f, clear_accum=True)

    separate_w = idt != dtype
    num_tokens = T.dynamic("num_tokens")
    num_segs = T.dynamic("num_segs")
    num_init = T.dynamic("num_init")
    num_final = T.dynamic("num_final")

    @T.prim_func
    def gdn_fused_fwd_ws(
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
    ):
        with T.Kernel(V // bDV, Hv, num_segs, threads=THREADS) as (bv, bh, bs):
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
            ag_sh = None if a_gated else T.alloc_shared((C, C), idt)
            pg_sh = None if p_in_registers else T.alloc_shared((C, C), idt)
            eg_sh = T.alloc_shared((C,), "float32", scope="shared")
            er_sh = T.alloc_shared((C,), "float32", scope="shared")

            s_f = T.alloc_fragment((K, bDV), "float32")
            u_f = T.alloc_fragment((C, bDV), "float32")
            vd_f = T.alloc_fragment((C, bDV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, bDV), "float32")
            pg_f = T.alloc_fragment((C, C), idt) if p_in_registers else None

            # ready: the 3 loader warps arrive (TMA bytes on top); free: the 3 consumer warpgroups
            ready = T.alloc_barrier(arrive_count=[96] * 2)
            free = T.alloc_barrier(arrive_count=[384] * 2)
            bar_start = T.alloc_barrier(arrive_count=384)
            bar_state = T.alloc_barrier(arrive_count=256)
            bar_ag = None if a_gated else T.alloc_barrier(arrive_count=128)
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
                    stamp(ht, tx, bv, bh, bs, 0, 0, it)
                    T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    stamp(ht, tx, bv, bh, bs, 0, 1, it)
                    T.copy(s_f, h_sh)
                    T.fence_proxy_async()
                    stamp(ht, tx, bv, bh, bs, 0, 2, it)
                    T.barrier_arrive(bar_state)
                    T.barrier_wait(bar_state, it % 2)
                    stamp(ht, tx, bv, bh, bs, 0, 3, it)
                    for i, j in T.Parallel(K, bDV):
                        s_f[i, j] = s_f[i, j] * eg_sh[C - 1]
                    stamp(ht, tx, bv, bh, bs, 0, 4, it)
                    T.barrier_wait(bar_vn, it % 2)
                    stamp(ht, tx, bv, bh, bs, 0, 5, it)
                    T.gemm(k_sh[it % 2, :, :], vn_sh, s_f, transpose_A=True)
                    stamp(ht, tx, bv, bh, bs, 0, 6, it)
                    T.barrier_arrive(free[it % 2])
                if store_final:
                    if fin >= 0:
                        T.copy(s_f, ht[fin, bh, :, v0:v0 + bDV])

            elif tx < 256:
                set_nreg(NREG_VALUES_PRS if p_in_registers else NREG_VALUES)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    stamp(ht, tx, bv, bh, bs, 1, 0, it)
                    T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    stamp(ht, tx, bv, bh, bs, 1, 1, it)
                    for i in T.Parallel(C):
                        eg_sh[i] = T.exp2(g_sh[it % 2, i] * LOG2E)
                        er_sh[i] = T.exp2((g_sh[it % 2, C - 1] - g_sh[it % 2, i]) * LOG2E)
                    stamp(ht, tx, bv, bh, bs, 1, 2, it)
                    T.barrier_arrive(bar_state)
                    T.barrier_wait(bar_state, it % 2)
                    stamp(ht, tx, bv, bh, bs, 1, 3, it)
                    T.gemm(k_sh[it % 2, :, :], h_sh, u_f, clear_accum=True)
                    stamp(ht, tx, bv, bh, bs, 1, 4, it)
                    if w_in_registers:
                        # W = V - exp(gamma) U in registers, then one fragment store (over V's tile unless ws16)
                        for i, j in T.Parallel(C, bDV):
                            u_f[i, j] = v_sh[it % 2, i, j] - eg_sh[i] * u_f[i, j]
                        if separate_w:
                            T.copy(u_f, w_sh)
                        else:
                            T.copy(u_f, v_sh[it % 2, :, :])
                        T.fence_proxy_async()
                        stamp(ht, tx, bv, bh, bs, 1, 5, it)
                        if separate_w:
                            ag_times_w(ht, tx, bv, bh, bs, it, a_sh[it % 2, :, :], ag_sh, bar_ag, w_sh, vd_f)
                        else:
                            ag_times_w(ht, tx, bv, bh, bs, it, a_sh[it % 2, :, :], ag_sh, bar_ag,
                                       v_sh[it % 2, :, :], vd_f)
                    elif separate_w:
                        for i, j in T.Parallel(C, bDV):
                            w_sh[i, j] = v_sh[it % 2, i, j] - eg_sh[i] * u_f[i, j]
                        T.fence_proxy_async()
                        stamp(ht, tx, bv, bh, bs, 1, 5, it)
                        ag_times_w(ht, tx, bv, bh, bs, it, a_sh[it % 2, :, :], ag_sh, bar_ag, w_sh, vd_f)
                    else:
                        # W = V - exp(gamma) U, written over this chunk's V tile
                        for i, j in T.Parallel(C, bDV):
                            v_sh[it % 2, i, j] = v_sh[it % 2, i, j] - eg_sh[i] * u_f[i, j]
                        T.fence_proxy_async()
                        stamp(ht, tx, bv, bh, bs, 1, 5, it)
                        ag_times_w(ht, tx, bv, bh, bs, it, a_sh[it % 2, :, :], ag_sh, bar_ag, v_sh[it % 2, :, :],
                                   vd_f)
                    stamp(ht, tx, bv, bh, bs, 1, 7, it)
                    T.copy(vd_f, vd_sh)
                    T.fence_proxy_async()
                    stamp(ht, tx, bv, bh, bs, 1, 8, it)
                    T.barrier_arrive(bar_vd)
                    for i, j in T.Parallel(C, bDV):
                        vn_sh[i, j] = vd_f[i, j] * er_sh[i]
                    T.fence_proxy_async()
                    stamp(ht, tx, bv, bh, bs, 1, 9, it)
                    T.barrier_arrive(bar_vn)
                    T.barrier_arrive(free[it % 2])

            elif tx < 384:
                set_nreg(NREG_OUTPUT_PRS if p_in_registers else NREG_OUTPUT)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    stamp(ht, tx, bv, bh, bs, 2, 0, it)
                    if p_in_registers:
                        if it == 0:  # later steps: arrived at the end of the previous one, before its O store
                            T.barrier_arrive(bar_start)
                    else:
                        T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    stamp(ht, tx, bv, bh, bs, 2, 1, it)
                    T.gemm(q_sh[it % 2, :, :], k_sh[it % 2, :, :], p_f, transpose_B=True, clear_accum=True)
                    stamp(ht, tx, bv, bh, bs, 2, 2, it)
                    if not a_gated:
                        for i, j in T.Parallel(C, C):
                            ag_sh[i, j] = T.if_then_else(
                                j <= i,
                                a_sh[it % 2, i, j] * T.exp2((g_sh[it % 2, i] - g_sh[it % 2, j]) * LOG2E)
                                * b_sh[it % 2, j], 0.0)
                        T.fence_proxy_async()
                    stamp(ht, tx, bv, bh, bs, 2, 3, it)
                    if not a_gated:
                        T.barrier_arrive(bar_ag)
                    if p_in_registers:
                        for i, j in T.Parallel(C, C):
                            p_f[i, j] = T.if_then_else(
                                j <= i, p_f[i, j] * T.exp2((g_sh[it % 2, i] - g_sh[it % 2, j]) * LOG2E) * scale,
                                0.0)
                        T.copy(p_f, pg_f)
                    else:
                        for i, j in T.Parallel(C, C):
                            pg_sh[i, j] = T.if_then_else(
                                j <= i, p_f[i, j] * T.exp2((g_sh[it % 2, i] - g_sh[it % 2, j]) * LOG2E) * scale,
                                0.0)
                        T.fence_proxy_async()
                    stamp(ht, tx, bv, bh, bs, 2, 4, it)
                    T.barrier_wait(bar_state, it % 2)
                    stamp(ht, tx, bv, bh, bs, 2, 5, it)
                    T.gemm(q_sh[it % 2, :, :], h_sh, o_f, clear_accum=True)
                    stamp(ht, tx, bv, bh, bs, 2, 6, it)
                    for i, j in T.Parallel(C, bDV):
                        o_f[i, j] = o_f[i, j] * eg_sh[i] * scale
                    T.barrier_wait(bar_vd, it % 2)
                    stamp(ht, tx, bv, bh, bs, 2, 7, it)
                    if p_in_registers:
                        T.gemm(pg_f, vd_sh, o_f)
                    else:
                        T.gemm(pg_sh, vd_sh, o_f)
                    stamp(ht, tx, bv, bh, bs, 2, 8, it)
                    if p_in_registers:
                        # this step's shared-memory reads (h_sh, eg_sh, vd_sh) are done: release the next step to
                        # the other warpgroups now and store O while they run it
                        T.barrier_arrive(bar_start)
                    cs = s0 + it * C
                    if cs + C <= s1:
                        T.copy(o_f, o[cs:cs + C, bh, v0:v0 + bDV])
                    else:
                        for i, j in T.Parallel(C, bDV):
                            if cs + i < s1:
                                o[cs + i, bh, v0 + j] = o_f[i, j]
                    stamp(ht, tx, bv, bh, bs, 2, 9, it)
                    T.barrier_arrive(free[it % 2])

            else:
                set_nreg(NREG_PRODUCER)
                if tx < 384 + 32:
                    for it in T.serial(n_it):
                        T.barrier_wait(free[it % 2], (it // 2 + 1) % 2)
                        stamp(ht, tx, bv, bh, bs, 3, 0, it)
                        cs = s0 + it * C
                        if cs + C <= s1:
                            T.tma_copy(q[cs:cs + C, hk, :], q_sh[it % 2, :, :], barrier=ready[it % 2])
                            T.tma_copy(k[cs:cs + C, hk, :], k_sh[it % 2, :, :], barrier=ready[it % 2])
                        else:
                            for i, j in T.Parallel(C, K):
                                q_sh[it % 2, i, j] = T.if_then_else(cs + i < s1, q[T.min(cs + i, s1 - 1), hk, j],
                                                                    T.cast(0, dtype))
                                k_sh[it % 2, i, j] = T.if_then_else(cs + i < s1, k[T.min(cs + i, s1 - 1), hk, j],
                                                                    T.cast(0, dtype))
                            T.fence_proxy_async()
                        stamp(ht, tx, bv, bh, bs, 3, 1, it)
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
                            if a_gated:  # the values warpgroup's wgmma reads this tile (async proxy)
                                T.fence_proxy_async()
                        # padded rows repeat the last valid gamma: Gamma stays <= 1 and their terms are zero
                        for i in T.Parallel(C):
                            g_sh[it % 2, i] = gamma[T.min(cs + i, s1 - 1), bh]
                        T.barrier_arrive(ready[it % 2])

    return gdn_fused_fwd_ws


def fused_fwd_ws(q, k, v, a0, gamma, beta, h_init, segs, o, ht, *, scale: float, bDV: int, inner: str = "",
                 w_in_registers: bool = False, a_gated: bool = False, p_in_registers: bool = False):
    """Run the warp-specialised fused output stage in place; same contract as ``fused_fwd.fused_fwd``.

    Args:
        q, k: [T, Hk, K]; v, o: [T, Hv, V] (o is written); a0: [T, Hv, 64] fp16 (Ag with ``a_gated``); gamma, beta:
        [T, Hv] fp32; h_init: [R, Hv, K, V] fp32 start states (R >= 1); segs: [S, 4] int32; ht: [N, Hv, K, V] fp32
        or None. scale: output scale. bDV: V slice per CTA (32, 64 or 128). inner, w_in_registers, a_gated,
        p_in_registers: see ``build_fused_fwd_ws``.
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    store_final = ht is not None
    kernel = compile_kernel(build_fused_fwd_ws, Hk, Hv, K, V, bDV, tl_dtype(q.dtype), float(scale), store_final,
                            inner, *trailing_flags(False, w_in_registers, a_gated, p_in_registers))
    if ht is None:
        ht = torch.empty((1, Hv, K, V), dtype=torch.float32, device=q.device)
    kernel(q, k, v, a0, gamma, beta, h_init, segs, o, ht)


def trace_step(q, k, v, a0, gamma, beta, h_init, segs, o, *, scale: float, bDV: int, inner: str = "",
               w_in_registers: bool = False, a_gated: bool = False, p_in_registers: bool = False):
    """Run the traced twin (o written as by ``fused_fwd_ws``, no final state) and return its stamps.

    Returns:
        ``[4, TRACE_EVENTS, TRACE_STEPS]`` float64 cycles of CTA (0, 0, 0) since its first stamp, per warpgroup and
        event of ``TRACE_NAMES`` (unused slots and steps beyond the segment's are NaN).
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    kernel = compile_kernel(build_fused_fwd_ws, Hk, Hv, K, V, bDV, tl_dtype(q.dtype), float(scale), False, inner,
                            *trailing_flags(True, w_in_registers, a_gated, p_in_registers))
    ht = torch.full((1, Hv, K, V), float("nan"), dtype=torch.float32, device=q.device)
    kernel(q, k, v, a0, gamma, beta, h_init, segs, o, ht)
    raw = ht[0, 0].flatten()[:4 * TRACE_EVENTS * TRACE_STEPS].double().cpu()
    return unwrap_stamps(raw).view(4, TRACE_EVENTS, TRACE_STEPS)


def unwrap_stamps(raw: torch.Tensor, period: int = 1 << 24) -> torch.Tensor:
    """clock64-mod-``period`` stamps -> cycles since the earliest one (NaN stays NaN). The stamps of one traced run
    span less than a period (8 ms at 2 GHz), so they lie on an arc of the circle: it begins after the widest gap."""
    values = raw[~raw.isnan()].sort().values
    if values.numel() == 0:
        return raw
    gaps = torch.diff(torch.cat([values, values[:1] + period]))  # the gap after each value; the last one wraps
    start = values[(int(gaps.argmax()) + 1) % values.numel()]
    return torch.remainder(raw - start, period)
