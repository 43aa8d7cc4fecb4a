"""Backward stage: the state gradient carried back over each sequence's chunks, with dv (FLA's ``chunk_bwd_dv_local``
and ``chunk_gated_delta_rule_bwd_dhu`` in one pass).

One CTA walks one sequence backwards for one value head and one bDV-wide slice of V, the state gradient dS' [K, bDV]
in fp32 registers for the whole walk (exact: nothing truncated, nothing rounded between chunks). It starts from
``dht`` (or zeros); per chunk, last to first, with X = ``kkt_solve``'s Ag (X = A diag(beta)):

    dh_c = dS'                                                      (written in the input dtype, for dqkwg)
    dv   = diag(exp(gamma_C - gamma)) K dS' + Pt dO,   Pt = scale (K Q^T) * Gamma^T   (upper triangle: j >= i)
    dS'  <- exp(gamma_C) dS' + (scale diag(exp(gamma)) Q)^T dO - K^T (diag(exp(gamma)) X^T dv)

The last term is ``w^T dv`` with ``w = X diag(exp(gamma)) K`` never formed. After the sequence's first chunk the
carried gradient is dh0. Pt, X and X^T dv go through shared memory in the input dtype (X is converted from fp16).

The step is split over four warpgroups as the forward's ``chunk_fwd`` splits its own (below): a TMA producer fills a
2-deep ring, the chain dS' -> K dS' -> X^T dv -> K^T Y runs on two warpgroups, and Pt and the scaled dO are formed
beside it (Pt a step ahead, so Pt dO is off the chain). Against one warpgroup running the loads and GEMMs in turn,
the walk takes 0.88 ms instead of 2.41 at 16/32 8192x4 on an H100.

Grid (V / bDV, Hv, N), 512 threads. ``seqs[n] = (start, end, first chunk)``.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.chunk_bwd import C, LOG2E
from flashqla_kernels.gated_delta_rule.hopper.chunk_fwd import set_nreg


def block_v(K: int, V: int) -> int:
    """V slice per CTA of the dh walk: 64, or 32 at K = 256 (the fp32 state gradient stays in one warpgroup's
    registers). Narrower slices measured slower on an H100 (each chunk's loads and barriers cost the same at any
    width, so twice the CTAs is twice that cost)."""
    return min(V, 32 if K > 128 else 64)


# The warp-specialised walk (FlashQLA's layout, as ``chunk_fwd``): per chunk the critical chain is dS' -> smem,
# K dS', + Pt dO, X^T dv, -exp(gamma) rows, K^T Y; Pt, X in the input dtype and diag(exp(gamma)) dO are formed beside
# it, and the next chunk's tiles land while this one computes.
#
#   WG0 state    dS' (fp32 registers): dS' -> smem (and dh), dS' *= exp(gamma_C), += Q^T Doe, += K^T Y
#   WG1 values   Pd = Pt dO while dS' is published, then dv = diag(r) K dS' + Pd (stored),
#                Y = -diag(exp(gamma)) X^T dv -> smem
#   WG2 aux      Doe = scale diag(exp(gamma)) dO, then the next step's Pt = scale (K Q^T) * Gamma^T (upper triangle) and
#                X in the input dtype (bf16 inputs), into the other of two slots (``bar_pt`` / ``pt_free``)
#   WG3 producer warp 0: q, k; warp 1: the dO slice, gamma; warp 2: X (TMA for full chunks, masked loads for the
#                ragged one), double-buffered against ``ready`` / ``free``
WS_THREADS = 512
# setmaxnreg budgets (sum 504 <= 512): the state warpgroup holds dS' (K bDV / 128 fp32 a thread)
WS_NREG_STATE, WS_NREG_VALUES, WS_NREG_AUX, WS_NREG_PRODUCER = 160, 120, 136, 88


def build_bwd_dh(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, scale: float, has_dht: bool,
                 store_dh0: bool, store_grads: bool = True):
    """The dh kernel: grid (V / bDV, Hv, N), 512 threads; ``has_dht``: start from ``dht`` (else zeros);
    ``store_dh0``: write the gradient of the initial state; ``store_grads``: write dh and dv (off: only the walk's
    start gradient, the context-parallel first pass)."""
    group = Hv // Hk
    # bf16 inputs: X (fp16 from kkt_solve) is converted for the X^T dv product; fp16 inputs read it as loaded
    convert_x = dtype != "float16"
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_dht = T.dynamic("num_dht")
    num_dh0 = T.dynamic("num_dh0")
    # dv's own row count: without store_grads it is a one-row placeholder
    num_dv = T.dynamic("num_dv")

    @T.macro
    def form_pt(slot, k_sh, q_sh, g_sh, a_sh, p_f, xa_f, pt_sh, x_sh, bar_pt):
        # Pt[i, j] = scale k_i . q_j exp(gamma_j - gamma_i) for j >= i (masked before exp), and X in the input dtype,
        # for the chunk in ring slot ``slot``
        T.gemm(k_sh[slot, :, :], q_sh[slot, :, :], p_f, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, C):
            p_f[i, j] = T.if_then_else(
                j >= i, p_f[i, j] * T.exp2((g_sh[slot, j] - g_sh[slot, i]) * LOG2E) * scale, 0.0)
        T.copy(p_f, pt_sh[slot, :, :])
        if convert_x:
            T.copy(a_sh[slot, :, :], xa_f)
            T.copy(xa_f, x_sh[slot, :, :])
        T.fence_proxy_async()
        T.barrier_arrive(bar_pt[slot])

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
        with T.Kernel(V // bDV, Hv, num_seqs, threads=WS_THREADS) as (bv, bh, bn):
            hk = bh // group
            v0 = bv * bDV
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            n_it = T.alloc_var("int32")
            bos = seqs[bn, 0]
            eos = seqs[bn, 1]
            c0 = seqs[bn, 2]
            n_it = T.ceildiv(eos - bos, C)
            tx = T.get_thread_binding()

            q_sh = T.alloc_shared((2, C, K), dtype)
            k_sh = T.alloc_shared((2, C, K), dtype)
            do_sh = T.alloc_shared((2, C, bDV), dtype)
            a_sh = T.alloc_shared((2, C, C), "float16")
            g_sh = T.alloc_shared((2, C), "float32", scope="shared")
            dh_sh = T.alloc_shared((K, bDV), dtype)
            # Pt and X (in the input dtype) are formed a step ahead by the aux warpgroup: one buffer a ring slot
            pt_sh = T.alloc_shared((2, C, C), dtype)
            x_sh = T.alloc_shared((2, C, C), dtype) if convert_x else None
            doe_sh = T.alloc_shared((C, bDV), dtype)
            dv_sh = T.alloc_shared((C, bDV), dtype)
            y_sh = T.alloc_shared((C, bDV), dtype)
            eg_sh = T.alloc_shared((C,), "float32", scope="shared")
            er_sh = T.alloc_shared((C,), "float32", scope="shared")

            ds_f = T.alloc_fragment((K, bDV), "float32")
            dv_f = T.alloc_fragment((C, bDV), "float32")
            pd_f = T.alloc_fragment((C, bDV), "float32")
            y_f = T.alloc_fragment((C, bDV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            xa_f = T.alloc_fragment((C, C), "float32")
            doe_f = T.alloc_fragment((C, bDV), "float32")

            ready = T.alloc_barrier(arrive_count=[96] * 2)
            free = T.alloc_barrier(arrive_count=[384] * 2)
            bar_start = T.alloc_barrier(arrive_count=384)
            bar_state = T.alloc_barrier(arrive_count=256)
            bar_pt = T.alloc_barrier(arrive_count=[128] * 2)
            pt_free = T.alloc_barrier(arrive_count=[128] * 2)
            bar_doe = T.alloc_barrier(arrive_count=128)

            bar_y = T.alloc_barrier(arrive_count=128)

            if tx < 128:
                set_nreg(WS_NREG_STATE)
                if has_dht:
                    T.copy(dht[bn, bh, :, v0:v0 + bDV], ds_f)
                else:
                    T.clear(ds_f)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    if store_grads:
                        # the previous step's store must have read dh_sh before it is overwritten: the thread that
                        # issued it waits, and bar_start holds the others until it has
                        if tx == 0:
                            T.tma_store_wait(0)
                    T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    T.copy(ds_f, dh_sh)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_state)
                    T.barrier_wait(bar_state, it % 2)
                    if store_grads:
                        # the gradient leaving this chunk, as dh_sh holds it: one bulk store (issued by thread 0)
                        # that runs while the chain goes on; stores from registers stalled the walk
                        T.tma_copy(dh_sh, dh[c0 + n_it - 1 - it, bh, :, v0:v0 + bDV])
                    for i, j in T.Parallel(K, bDV):
                        ds_f[i, j] = ds_f[i, j] * eg_sh[C - 1]
                    T.barrier_wait(bar_doe, it % 2)
                    T.gemm(q_sh[it % 2, :, :], doe_sh, ds_f, transpose_A=True)
                    T.barrier_wait(bar_y, it % 2)
                    T.gemm(k_sh[it % 2, :, :], y_sh, ds_f, transpose_A=True)
                    T.barrier_arrive(free[it % 2])
                if store_grads:
                    if tx == 0:
                        T.tma_store_wait(0)
                if store_dh0:
                    T.copy(ds_f, dh0[bn, bh, :, v0:v0 + bDV])

            elif tx < 256:
                set_nreg(WS_NREG_VALUES)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    if store_grads:
                        # the previous step's dv store must have read dv_sh (as the state warpgroup's dh store)
                        if tx == 128:
                            T.tma_store_wait(0)
                    T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    for i in T.Parallel(C):
                        eg_sh[i] = T.exp2(g_sh[it % 2, i] * LOG2E)
                        er_sh[i] = T.exp2((g_sh[it % 2, C - 1] - g_sh[it % 2, i]) * LOG2E)
                    T.barrier_arrive(bar_state)
                    # Pt dO does not depend on dS': it runs while the state warpgroup publishes dS', from the Pt the
                    # aux warpgroup formed a step ahead, so the chain below is one product shorter
                    T.barrier_wait(bar_pt[it % 2], (it // 2) % 2)
                    T.gemm(pt_sh[it % 2, :, :], do_sh[it % 2, :, :], pd_f, clear_accum=True)
                    T.barrier_wait(bar_state, it % 2)
                    T.gemm(k_sh[it % 2, :, :], dh_sh, dv_f, clear_accum=True)
                    for i, j in T.Parallel(C, bDV):
                        dv_f[i, j] = dv_f[i, j] * er_sh[i] + pd_f[i, j]
                    T.copy(dv_f, dv_sh)
                    T.fence_proxy_async()
                    # Y = -diag(exp(gamma)) X^T dv: the w^T dv term of dS as K^T Y
                    if convert_x:
                        T.gemm(x_sh[it % 2, :, :], dv_sh, y_f, transpose_A=True, clear_accum=True)
                    else:
                        T.gemm(a_sh[it % 2, :, :], dv_sh, y_f, transpose_A=True, clear_accum=True)
                    # this slot's Pt and X are read: the aux warpgroup may form the step after next's there
                    T.barrier_arrive(pt_free[it % 2])
                    for i, j in T.Parallel(C, bDV):
                        y_f[i, j] = -eg_sh[i] * y_f[i, j]
                    T.copy(y_f, y_sh)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_y)
                    T.barrier_arrive(free[it % 2])
                    if store_grads:
                        # full chunks: one bulk store of dv_sh (thread 128), so the next step is not held up by
                        # register stores; a ragged chunk's rows end inside the box, so it stores row by row
                        cs = bos + (n_it - 1 - it) * C
                        if cs + C <= eos:
                            T.tma_copy(dv_sh, dv[cs:cs + C, bh, v0:v0 + bDV])
                        else:
                            for i, j in T.Parallel(C, bDV):
                                if cs + i < eos:
                                    dv[cs + i, bh, v0 + j] = dv_f[i, j]
                if store_grads:
                    if tx == 128:
                        T.tma_store_wait(0)

            elif tx < 384:
                set_nreg(WS_NREG_AUX)
                if n_it > 0:
                    T.barrier_wait(ready[0], 0)
                    form_pt(0, k_sh, q_sh, g_sh, a_sh, p_f, xa_f, pt_sh, x_sh, bar_pt)
                for it in T.serial(n_it):
                    T.barrier_wait(ready[it % 2], (it // 2) % 2)
                    T.barrier_arrive(bar_start)
                    T.barrier_wait(bar_start, it % 2)
                    T.copy(do_sh[it % 2, :, :], doe_f)
                    for i, j in T.Parallel(C, bDV):
                        doe_f[i, j] = doe_f[i, j] * T.exp2(g_sh[it % 2, i] * LOG2E) * scale
                    T.copy(doe_f, doe_sh)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_doe)
                    T.barrier_arrive(free[it % 2])
                    # the next step's Pt and X, into the other slot once the values warpgroup has read it
                    if it + 1 < n_it:
                        T.barrier_wait(ready[(it + 1) % 2], ((it + 1) // 2) % 2)
                        T.barrier_wait(pt_free[(it + 1) % 2], ((it + 1) // 2 + 1) % 2)
                        form_pt((it + 1) % 2, k_sh, q_sh, g_sh, a_sh, p_f, xa_f, pt_sh, x_sh, bar_pt)

            else:
                set_nreg(WS_NREG_PRODUCER)
                if tx < 384 + 32:
                    for it in T.serial(n_it):
                        T.barrier_wait(free[it % 2], (it // 2 + 1) % 2)
                        cs = bos + (n_it - 1 - it) * C
                        if cs + C <= eos:
                            T.tma_copy(q[cs:cs + C, hk, :], q_sh[it % 2, :, :], barrier=ready[it % 2])
                            T.tma_copy(k[cs:cs + C, hk, :], k_sh[it % 2, :, :], barrier=ready[it % 2])
                        else:
                            for i, j in T.Parallel(C, K):
                                q_sh[it % 2, i, j] = T.if_then_else(cs + i < eos, q[T.min(cs + i, eos - 1), hk, j],
                                                                    T.cast(0, dtype))
                                k_sh[it % 2, i, j] = T.if_then_else(cs + i < eos, k[T.min(cs + i, eos - 1), hk, j],
                                                                    T.cast(0, dtype))
                            T.fence_proxy_async()
                        T.barrier_arrive(ready[it % 2])
                elif tx < 384 + 64:
                    for it in T.serial(n_it):
                        T.barrier_wait(free[it % 2], (it // 2 + 1) % 2)
                        cs = bos + (n_it - 1 - it) * C
                        if cs + C <= eos:
                            T.tma_copy(do[cs:cs + C, bh, v0:v0 + bDV], do_sh[it % 2, :, :], barrier=ready[it % 2])
                        else:
                            for i, j in T.Parallel(C, bDV):
                                do_sh[it % 2, i, j] = T.if_then_else(
                                    cs + i < eos, do[T.min(cs + i, eos - 1), bh, v0 + j], T.cast(0, dtype))
                            T.fence_proxy_async()
                        # padded rows repeat the last valid gamma: every padded gate is <= 1, their terms are zero
                        for i in T.Parallel(C):
                            g_sh[it % 2, i] = gamma[T.min(cs + i, eos - 1), bh]
                        T.barrier_arrive(ready[it % 2])
                elif tx < 384 + 96:
                    for it in T.serial(n_it):
                        T.barrier_wait(free[it % 2], (it // 2 + 1) % 2)
                        cs = bos + (n_it - 1 - it) * C
                        if cs + C <= eos:
                            T.tma_copy(ag[cs:cs + C, bh, :], a_sh[it % 2, :, :], barrier=ready[it % 2])
                        else:
                            for i, j in T.Parallel(C, C):
                                a_sh[it % 2, i, j] = T.if_then_else(
                                    cs + i < eos, ag[T.min(cs + i, eos - 1), bh, j], T.cast(0, "float16"))
                            T.fence_proxy_async()
                        T.barrier_arrive(ready[it % 2])

    return gdn_bwd_dh


def bwd_dh(q, k, do, ag, gamma, dht, seqs, num_chunks: int, *, scale: float, store_dh0: bool,
           store_grads: bool = True, block: int | None = None):
    """The state gradient over the chunks of every walk (a sequence, or a segment of one), and dv.

    Args:
        q, k: [T, Hk, K] bf16/fp16 (normalised if the op normalises). do: [T, Hv, V] same dtype. ag: [T, Hv, 64]
        fp16. gamma: [T, Hv] fp32. dht: [N, Hv, K, V] fp32, the gradient of each walk's end state, or None (zeros).
        seqs: [N, 3] int32 (start, end, first chunk) of each walk. num_chunks: NC. scale: the output scale.
        store_dh0: return the gradient of each walk's start state. store_grads: write dh and dv (False: neither is
        returned). block: the V slice a CTA walks (default ``block_v(K, V)``; 32 halves each step's work and
        doubles the CTAs, for walks too few to fill the SMs).

    Returns:
        (dh [NC, Hv, K, V] in q's dtype, the gradient of the state leaving each chunk; dv [T, Hv, V] in q's dtype, the
        full gradient of v_new (every reader multiplies it in that dtype, so it is stored so: half the bytes of fp32,
        the same results); dh0 [N, Hv, K, V] fp32 or None). dh and dv are None without ``store_grads``.
    """
    Tn, Hk, K = k.shape
    Hv, V = do.shape[1], do.shape[2]
    N = seqs.shape[0]
    bDV = block or block_v(K, V)
    if V % bDV or bDV % 16:
        raise ValueError(f"bwd_dh: the V slice must be a multiple of 16 dividing V = {V}; got {bDV}")
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
