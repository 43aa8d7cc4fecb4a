"""Stage 2 (context parallelism only): each non-final segment's affine map.

A segment maps its incoming state linearly plus a constant: ``S_end = M S_start + H`` with
``H`` = the end state from a zero start (V columns) and ``M`` = the map applied to the identity with V = 0 (K columns).
One kernel computes both: CTAs with ``bv < V / bDV`` run the state recurrence on V from zeros; the others run it on
the identity's columns with no V input. Per chunk it is ``chunk_fwd``'s state step without the output:

    U = K S,   W = V - exp(gamma) U,   Vd = Ag W,   S <- exp(gamma_C) S + K^T (exp(gamma_C - gamma) Vd)

with Ag as ``kkt_solve`` wrote it (fp16; W goes to an fp16 tile to match it). A ragged tail chunk loads zero k/v/Ag
rows, beta = 0 and gamma padded with its last valid value, so every padded row contributes exactly zero.

Decay shortcut: with g <= 0 and unit-norm keys, ||M|| <= exp(sum of g over the segment) and a token's contribution to
H is scaled by at most exp(sum of g after it). Where that sum is below NEGLIGIBLE_LOG_DECAY = -20 (exp(-20) = 2e-9,
below fp32's rounding of the state and six orders below the rounding of the walk's own bf16 / fp16 products) M counts
as 0 and H only needs the chunks after that point. FlashQLA's auto-CP cuts at -10 (4.5e-5); heads with g = 0 get the
full M. On an H100 the cut at -20 instead of -40 took the maps (internal timing) from 0.064 to 0.044 ms at 16/32
32768x1 (the benchmark's gates, about -3.2 a chunk: 7 chunks walked instead of 13); the scanned start states moved by
2e-5 relative, the difference between two bf16 walks.
Every CTA finds where its map's H walk starts itself: the map's chunk totals of gamma are staged in shared memory 256
at a time from the map's end, and one thread adds them until the sum drops below NEGLIGIBLE_LOG_DECAY (the last chunk
where it does is where H starts). Finding the starts in the kernel avoids ~25 small torch kernels per call (host-bound:
the H200 timed that form of this stage at 0.47-1.08 ms across runs of the same kernels).

With ``l2norm`` the keys are read as given and normalised by ``kkt_solve``'s ``rk`` folded into the row scalings
(``K_n S = diag(rk) K S``, ``K_n^T Vn = K^T diag(rk) Vn``), as in ``chunk_fwd``.

Grid (V / bDV + K / bDV, Hv, maps), 256 threads. ``segs[r] = (start, end)`` of map r.
Outputs H [R, Hv, K, V], M [R, Hv, K, K] fp32 and ``start`` [R, Hv] int32: H's first token, or -1 where the walk
covers the whole map and M is needed. Where ``start >= 0`` M is written as zeros and ``state_scan`` skips it (no M
read, no product: the next segment starts from H).
"""
import tilelang
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.plan import CHUNK

C = CHUNK
LOG2E = toolkit.LOG2E
THREADS = 256
NEGLIGIBLE_LOG_DECAY = -20.0


def _loaders(l2norm: bool):
    """Macros: ``load_tile`` (masked, synchronous: the ragged tail chunk), ``fetch_gates`` (register prefetch of one
    chunk's gamma, padded with its last valid value, and beta, zero-padded; issued a chunk step before use) and
    ``store_gates`` (those registers to shared memory); with ``l2norm`` the gates carry the keys' inverse norms too."""

    @T.macro
    def load_tile(x, x_sh, buf, cs, n, head, col0, width):
        for i, j in T.Parallel(C, width):
            x_sh[buf, i, j] = T.if_then_else(i < n, x[T.min(cs + i, cs + n - 1), head, col0 + j],
                                             T.cast(0, x_sh.dtype))

    @T.macro
    def fetch_gates(gamma, beta, rn, gnext, cs, n, bh, hk, tx):
        if tx < C:
            gnext[0] = gamma[cs + T.min(tx, n - 1), bh]
            gnext[1] = T.if_then_else(tx < n, beta[T.min(cs + tx, cs + n - 1), bh], 0.0)
            if l2norm:
                gnext[2] = rn[cs + T.min(tx, n - 1), hk, 1]

    @T.macro
    def store_gates(g_sh, b_sh, rk_sh, gnext, tx):
        if tx < C:
            g_sh[tx] = gnext[0]
            b_sh[tx] = gnext[1]
            if l2norm:
                rk_sh[tx] = gnext[2]

    return load_tile, fetch_gates, store_gates


def build_segment_states(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, l2norm: bool = False,
                         maps_only: bool = False):
    """The segment_states kernel: grid (V / bDV + K / bDV, Hv, maps), 256 threads; ``l2norm``: keys normalised by
    ``rn``; ``maps_only``: only the M blocks (grid (K / bDV, Hv, maps); H is neither walked nor written), for the
    backward, which carries gradients across segments by M alone."""
    group = Hv // Hk
    nV = V // bDV
    num_tokens = T.dynamic("num_tokens")
    num_segs = T.dynamic("num_segs")
    num_hs = T.dynamic("num_hs")  # 1 (a placeholder) with maps_only
    num_rn = T.dynamic("num_rn")
    load_tile, fetch_gates, store_gates = _loaders(l2norm)

    @T.prim_func
    def gdn_segment_states(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        a0: T.Tensor((num_tokens, Hv, C), "float16"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        segs: T.Tensor((num_segs, 2), "int32"),
        start: T.Tensor((num_segs, Hv), "int32"),
        hs: T.Tensor((num_hs, Hv, K, V), "float32"),
        ms: T.Tensor((num_segs, Hv, K, K), "float32"),
        rn: T.Tensor((num_rn, Hk, 2), "float32"),
    ):
        with T.Kernel((0 if maps_only else nV) + K // bDV, Hv, num_segs, threads=THREADS) as (bx, bh, bs):
            hk = bh // group
            bv = bx + nV if maps_only else bx
            is_m = bv >= nV
            # column offset into V (state blocks) or into the identity's K columns (map blocks)
            v0 = (bv - T.if_then_else(is_m, nV, 0)) * bDV
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            s1 = segs[bs, 1]
            skip = T.alloc_var("int32")
            tx = T.get_thread_binding()
            # where H starts: the map's chunk totals from its end, THREADS at a time; thread 0 sums them in order
            tot_sh = T.alloc_shared((THREADS,), "float32")
            found_sh = T.alloc_shared((1,), "int32")
            acc = T.alloc_local((1,), "float32")
            found = T.alloc_local((1,), "int32")
            m0 = segs[bs, 0]
            nch = T.ceildiv(s1 - m0, C)
            acc[0] = 0.0
            found[0] = -1
            for blk in T.serial(T.ceildiv(nch, THREADS)):
                T.sync_threads()
                ci = nch - 1 - (blk * THREADS + tx)  # this thread's chunk, counted from the map's start
                tot_sh[tx] = T.if_then_else(
                    ci >= 0, gamma[T.min(m0 + (T.max(ci, 0) + 1) * C, s1) - 1, bh], 0.0)
                T.sync_threads()
                if tx == 0:
                    for t in T.serial(THREADS):
                        if found[0] < 0 and blk * THREADS + t < nch:
                            acc[0] = acc[0] + tot_sh[t]
                            if acc[0] < NEGLIGIBLE_LOG_DECAY:
                                found[0] = nch - 1 - (blk * THREADS + t)
            if tx == 0:
                found_sh[0] = found[0]
            T.sync_threads()
            skip = T.if_then_else(found_sh[0] < 0, -1, m0 + found_sh[0] * C)
            if bx == 0 and tx == 0:
                start[bs, bh] = skip
            # the planner lays the tiles below over these two buffers: everyone has read found_sh first
            T.sync_threads()
            # M negligible: zero columns, no walk. H: start where earlier tokens stop mattering.
            s0 = T.if_then_else(skip < 0, segs[bs, 0], T.if_then_else(is_m, s1, skip))
            cs = T.alloc_var("int32")
            n = T.alloc_var("int32")
            buf = T.alloc_var("int32")
            gnext = T.alloc_local((3,), "float32")

            k_sh = T.alloc_shared((2, C, K), dtype)
            v_sh = T.alloc_shared((2, C, bDV), dtype)
            a_sh = T.alloc_shared((2, C, C), "float16")
            s_sh = T.alloc_shared((K, bDV), dtype)
            w_sh = T.alloc_shared((C, bDV), dtype)
            # Ag arrives in fp16; W must match it for the Ag W GEMM (its own tile unless inputs are fp16)
            w16_sh = T.alloc_shared((C, bDV), "float16") if dtype != "float16" else w_sh
            g_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")
            # l2norm: the keys' inverse norms, and exp(gamma) times them
            rk_sh = T.alloc_shared((C,), "float32") if l2norm else None
            ek_sh = T.alloc_shared((C,), "float32") if l2norm else None

            # V is read element-wise (W) in the accumulator's layout, eight rows a warp: swizzled, not in linear rows
            # whose 128 or 256 bytes put those eight rows in the same banks
            T.annotate_layout({v_sh: tilelang.layout.make_swizzled_layout(v_sh)})
            s_f = T.alloc_fragment((K, bDV), "float32")
            u_f = T.alloc_fragment((C, bDV), "float32")
            vd_f = T.alloc_fragment((C, bDV), "float32")

            for i, j in T.Parallel(K, bDV):
                s_f[i, j] = T.if_then_else(is_m and skip < 0 and i == v0 + j, 1.0, 0.0)
            if is_m:
                T.clear(v_sh)
            if s1 - s0 >= C:
                T.async_copy(k[s0:s0 + C, hk, :], k_sh[0, :, :])
                if not is_m:
                    T.async_copy(v[s0:s0 + C, bh, v0:v0 + bDV], v_sh[0, :, :])
                T.async_copy(a0[s0:s0 + C, bh, :], a_sh[0, :, :])

            fetch_gates(gamma, beta, rn, gnext, s0, T.min(C, s1 - s0), bh, hk, tx)
            for it in T.serial(T.ceildiv(s1 - s0, C)):
                T.sync_threads()
                buf = it % 2
                cs = s0 + it * C
                n = T.min(C, s1 - cs)
                if n < C:
                    load_tile(k, k_sh, buf, cs, n, hk, 0, K)
                    if not is_m:
                        load_tile(v, v_sh, buf, cs, n, bh, v0, bDV)
                    load_tile(a0, a_sh, buf, cs, n, bh, 0, C)
                store_gates(g_sh, b_sh, rk_sh, gnext, tx)
                if cs + C < s1:
                    fetch_gates(gamma, beta, rn, gnext, cs + C, T.min(C, s1 - cs - C), bh, hk, tx)
                T.sync_threads()
                if l2norm:
                    for i in T.Parallel(C):
                        eg_sh[i] = T.exp2(g_sh[i] * LOG2E)
                        ek_sh[i] = T.exp2(g_sh[i] * LOG2E) * rk_sh[i]
                        er_sh[i] = T.exp2((g_sh[C - 1] - g_sh[i]) * LOG2E) * rk_sh[i]
                else:
                    for i in T.Parallel(C):
                        eg_sh[i] = T.exp2(g_sh[i] * LOG2E)
                        er_sh[i] = T.exp2((g_sh[C - 1] - g_sh[i]) * LOG2E)
                T.copy(s_f, s_sh)
                T.ptx_wait_group(0)
                T.fence_proxy_async()
                T.sync_threads()
                if cs + 2 * C <= s1:
                    T.async_copy(k[cs + C:cs + 2 * C, hk, :], k_sh[1 - buf, :, :])
                    if not is_m:
                        T.async_copy(v[cs + C:cs + 2 * C, bh, v0:v0 + bDV], v_sh[1 - buf, :, :])
                    T.async_copy(a0[cs + C:cs + 2 * C, bh, :], a_sh[1 - buf, :, :])

                T.wgmma_gemm(k_sh[buf, :, :], s_sh, u_f, clear_accum=True)
                T.wait_wgmma(0)
                if l2norm:
                    for i, j in T.Parallel(C, bDV):
                        w16_sh[i, j] = v_sh[buf, i, j] - ek_sh[i] * u_f[i, j]
                else:
                    for i, j in T.Parallel(C, bDV):
                        w16_sh[i, j] = v_sh[buf, i, j] - eg_sh[i] * u_f[i, j]
                T.fence_proxy_async()
                T.sync_threads()
                T.wgmma_gemm(a_sh[buf, :, :], w16_sh, vd_f, clear_accum=True)
                T.wait_wgmma(0)
                T.sync_threads()
                for i, j in T.Parallel(C, bDV):
                    w_sh[i, j] = vd_f[i, j] * er_sh[i]
                T.fence_proxy_async()
                T.sync_threads()
                for i, j in T.Parallel(K, bDV):
                    s_f[i, j] = s_f[i, j] * eg_sh[C - 1]
                T.wgmma_gemm(k_sh[buf, :, :], w_sh, s_f, transpose_A=True)
                T.wait_wgmma(0)

            if is_m:
                T.copy(s_f, ms[bs, bh, :, v0:v0 + bDV])
            else:
                T.copy(s_f, hs[bs, bh, :, v0:v0 + bDV])

    return gdn_segment_states


# Explicit barriers, as in the chunk stage (double-buffered cp.async).
build_segment_states.pass_configs = {"tl.disable_thread_storage_sync": True}


def segment_states(k, v, ag, gamma, beta, maps, *, bDV: int, rn=None, maps_only: bool = False):
    """The map ``S_end = M S_start + H`` of every token range in ``maps`` (the forward: each non-final segment).

    Args:
        k: [T, Hk, K]; v: [T, Hv, V]; ag: [T, Hv, 64] fp16 (``kkt_solve``'s Ag); gamma, beta: [T, Hv] fp32;
        maps: [R, 2] int32 token ranges (a Plan's ``maps``). bDV: V slice per CTA. rn: [T, Hk, 2] fp32 inverse l2 norms of q and k
        (``kkt_solve``'s, with l2norm) or None. maps_only: M and the start table alone (H is None).

    Returns:
        H [R, Hv, K, V] fp32, M [R, Hv, K, K] fp32, and start [R, Hv] int32: per map and head the token H's walk
        starts at, or -1 where M is needed (M is zero wherever start >= 0).
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    args = (Hk, Hv, K, V, bDV, toolkit.tl_dtype(k.dtype), rn is not None) + ((True,) if maps_only else ())
    kernel = toolkit.compile_kernel(build_segment_states, *args)
    R = maps.shape[0]
    hs = (toolkit.unread((1, Hv, K, V), torch.float32, k.device) if maps_only
          else toolkit.empty((R, Hv, K, V), torch.float32, k.device))
    ms = toolkit.empty((R, Hv, K, K), torch.float32, k.device)
    start = toolkit.empty((R, Hv), torch.int32, k.device)
    if R > 0:
        if rn is None:
            rn = toolkit.unread((1, Hk, 2), torch.float32, k.device)  # not read without l2norm
        kernel(k, v, ag, gamma, beta, maps, start, hs, ms, rn)
    return (None if maps_only else hs), ms, start
