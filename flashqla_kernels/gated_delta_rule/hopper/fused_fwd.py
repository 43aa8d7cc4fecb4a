"""Stage 4: the fused forward. One CTA walks one segment (a whole sequence, or a slice of it under context
parallelism) for one value head and one bDV-wide slice of V, keeping the state S [K, bDV] in registers:
w, u, v_new and the per-chunk states never touch HBM. Writes o and, for a sequence's last segment, the final state.

Latency hiding without warp specialisation (two warpgroups share every GEMM): the next chunk's q/k/v/A0 tiles stream
in by cp.async into the other half of a double buffer, its gates by a register prefetch, while this chunk computes;
the GEMMs are asynchronous wgmma issued so that the chain the next chunk waits on (K S -> W -> Vd -> S update) goes
first and Ag, Q K^T, Q S, Pg and the output GEMM fill its gaps.

Grid (V / bDV, Hv, segments). ``segs[s] = (start, end, init, final)``: token range, the row of ``h_init`` to start
from (-1: zeros) and the row of ``ht`` to write (-1: none).
"""
import tilelang.language as T
import torch

from flashqla_kernels.gated_delta_rule.hopper._chunk_step import make_loaders
from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK, LOG2E, compile_kernel, tl_dtype

C = CHUNK
THREADS = 256


def build_fused_fwd(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, scale: float, store_final: bool):
    group = Hv // Hk
    num_tokens = T.dynamic("num_tokens")
    num_segs = T.dynamic("num_segs")
    num_init = T.dynamic("num_init")
    num_final = T.dynamic("num_final")
    load_tile, fetch_gates, store_gates = make_loaders(K, bDV, dtype)

    @T.prim_func
    def gdn_fused_fwd(
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
            s0 = segs[bs, 0]
            s1 = segs[bs, 1]
            init = segs[bs, 2]
            fin = segs[bs, 3]
            cs = T.alloc_var("int32")
            n = T.alloc_var("int32")
            buf = T.alloc_var("int32")
            tx = T.get_thread_binding()
            gnext = T.alloc_local((2,), "float32")

            q_sh = T.alloc_shared((2, C, K), dtype)
            k_sh = T.alloc_shared((2, C, K), dtype)
            v_sh = T.alloc_shared((2, C, bDV), dtype)
            a_sh = T.alloc_shared((2, C, C), "float16")
            s_sh = T.alloc_shared((K, bDV), dtype)
            w_sh = T.alloc_shared((C, bDV), dtype)
            vd_sh = T.alloc_shared((C, bDV), dtype)
            vn_sh = T.alloc_shared((C, bDV), dtype)
            ag_sh = T.alloc_shared((C, C), dtype)
            pg_sh = T.alloc_shared((C, C), dtype)
            g_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")

            s_f = T.alloc_fragment((K, bDV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            u_f = T.alloc_fragment((C, bDV), "float32")
            vd_f = T.alloc_fragment((C, bDV), "float32")
            o_f = T.alloc_fragment((C, bDV), "float32")

            if init >= 0:
                T.copy(h_init[init, bh, :, v0:v0 + bDV], s_f)
            else:
                T.clear(s_f)
            # prologue: stream the first chunk if it is full
            if s1 - s0 >= C:
                T.async_copy(q[s0:s0 + C, hk, :], q_sh[0, :, :])
                T.async_copy(k[s0:s0 + C, hk, :], k_sh[0, :, :])
                T.async_copy(v[s0:s0 + C, bh, v0:v0 + bDV], v_sh[0, :, :])
                T.async_copy(a0[s0:s0 + C, bh, :], a_sh[0, :, :])

            fetch_gates(gamma, beta, gnext, s0, T.min(C, s1 - s0), bh, tx)
            for it in T.serial(T.ceildiv(s1 - s0, C)):
                # the previous step's readers of the gate vectors and of this buffer are done
                T.sync_threads()
                buf = it % 2
                cs = s0 + it * C
                n = T.min(C, s1 - cs)
                if n < C:
                    load_tile(q, q_sh, buf, cs, n, hk, 0, K)
                    load_tile(k, k_sh, buf, cs, n, hk, 0, K)
                    load_tile(v, v_sh, buf, cs, n, bh, v0, bDV)
                    load_tile(a0, a_sh, buf, cs, n, bh, 0, C)
                store_gates(g_sh, b_sh, gnext, tx)
                if cs + C < s1:
                    fetch_gates(gamma, beta, gnext, cs + C, T.min(C, s1 - cs - C), bh, tx)
                T.sync_threads()
                for i in T.Parallel(C):
                    eg_sh[i] = T.exp2(g_sh[i] * LOG2E)
                    er_sh[i] = T.exp2((g_sh[C - 1] - g_sh[i]) * LOG2E)
                T.copy(s_f, s_sh)
                T.ptx_wait_group(0)
                T.fence_proxy_async()
                T.sync_threads()
                # prefetch the next chunk into the other buffer (its last readers finished last step)
                if cs + 2 * C <= s1:
                    T.async_copy(q[cs + C:cs + 2 * C, hk, :], q_sh[1 - buf, :, :])
                    T.async_copy(k[cs + C:cs + 2 * C, hk, :], k_sh[1 - buf, :, :])
                    T.async_copy(v[cs + C:cs + 2 * C, bh, v0:v0 + bDV], v_sh[1 - buf, :, :])
                    T.async_copy(a0[cs + C:cs + 2 * C, bh, :], a_sh[1 - buf, :, :])

                # K S first: it heads the chain K S -> W -> Vd -> S update that the next chunk waits on;
                # Ag, Q K^T and Q S fill the gaps
                T.wgmma_gemm(k_sh[buf, :, :], s_sh, u_f, clear_accum=True)
                T.wgmma_gemm(q_sh[buf, :, :], k_sh[buf, :, :], p_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(q_sh[buf, :, :], s_sh, o_f, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    ag_sh[i, j] = T.if_then_else(
                        j <= i, a_sh[buf, i, j] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E) * b_sh[j], 0.0)
                T.wait_wgmma(2)
                for i, j in T.Parallel(C, bDV):
                    w_sh[i, j] = v_sh[buf, i, j] - eg_sh[i] * u_f[i, j]
                T.fence_proxy_async()
                T.sync_threads()
                T.wgmma_gemm(ag_sh, w_sh, vd_f, clear_accum=True)
                T.wait_wgmma(2)
                for i, j in T.Parallel(C, C):
                    pg_sh[i, j] = T.if_then_else(
                        j <= i, p_f[i, j] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E) * scale, 0.0)
                T.wait_wgmma(0)
                for i, j in T.Parallel(C, bDV):
                    o_f[i, j] = o_f[i, j] * eg_sh[i] * scale
                T.copy(vd_f, vd_sh)
                for i, j in T.Parallel(C, bDV):
                    vn_sh[i, j] = vd_f[i, j] * er_sh[i]
                for i, j in T.Parallel(K, bDV):
                    s_f[i, j] = s_f[i, j] * eg_sh[C - 1]
                T.fence_proxy_async()
                T.sync_threads()
                T.wgmma_gemm(k_sh[buf, :, :], vn_sh, s_f, transpose_A=True)
                T.wgmma_gemm(pg_sh, vd_sh, o_f)
                T.wait_wgmma(0)

                if n == C:
                    T.copy(o_f, o[cs:cs + C, bh, v0:v0 + bDV])
                else:
                    for i, j in T.Parallel(C, bDV):
                        if i < n:
                            o[cs + i, bh, v0 + j] = o_f[i, j]

            if store_final:
                if fin >= 0:
                    T.copy(s_f, ht[fin, bh, :, v0:v0 + bDV])

    return gdn_fused_fwd


# Synchronisation is explicit above: the automatic pass cannot see that cp.async into one half of a double buffer
# never overlaps reads of the other half, and would put a barrier inside every element loop.
build_fused_fwd.pass_configs = {"tl.disable_thread_storage_sync": True}


def fused_fwd(q, k, v, a0, gamma, beta, h_init, segs, o, ht, *, scale: float, bDV: int):
    """Run the fused output stage in place.

    Args:
        q, k: [T, Hk, K]; v, o: [T, Hv, V] (o is written); a0: [T, Hv, 64] fp16; gamma, beta: [T, Hv] fp32;
        h_init: [R, Hv, K, V] fp32 start states (R >= 1); segs: [S, 4] int32; ht: [N, Hv, K, V] fp32 or None.
        scale: output scale. bDV: V slice per CTA (32, 64 or 128).
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    store_final = ht is not None
    kernel = compile_kernel(build_fused_fwd, Hk, Hv, K, V, bDV, tl_dtype(q.dtype), float(scale), store_final)
    if ht is None:
        ht = torch.empty((1, Hv, K, V), dtype=torch.float32, device=q.device)
    kernel(q, k, v, a0, gamma, beta, h_init, segs, o, ht)
