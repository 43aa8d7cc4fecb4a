"""Stage 4: the fused forward. One CTA walks one segment (a whole sequence, or a slice of it under context
parallelism) for one value head and one bDV-wide slice of V, keeping the state S [K, bDV] in registers:
w, u, v_new and the per-chunk states never touch HBM. Writes o and, for a sequence's last segment, the final state.

Grid (V / bDV, Hv, segments). ``segs[s] = (start, end, init, final)``: token range, the row of ``h_init`` to start
from (-1: zeros) and the row of ``ht`` to write (-1: none).
"""
import tilelang.language as T
import torch

from flashqla_kernels.gated_delta_rule.hopper._chunk_step import make_loaders
from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK, LOG2E, compile_kernel, tl_dtype

C = CHUNK


def build_fused_fwd(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str, scale: float, store_final: bool):
    group = Hv // Hk
    threads = 128
    num_tokens = T.dynamic("num_tokens")
    num_segs = T.dynamic("num_segs")
    num_init = T.dynamic("num_init")
    num_final = T.dynamic("num_final")
    load_qk, load_v, load_a, load_gates = make_loaders(Hv, group, K, bDV, dtype)

    @T.prim_func
    def gdn_fused_fwd(
        q: T.Tensor((num_tokens, Hk, K), dtype),
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        a0: T.Tensor((num_tokens, Hv, C), dtype),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        h_init: T.Tensor((num_init, Hv, K, V), "float32"),
        segs: T.Tensor((num_segs, 4), "int32"),
        o: T.Tensor((num_tokens, Hv, V), dtype),
        ht: T.Tensor((num_final, Hv, K, V), "float32"),
    ):
        with T.Kernel(V // bDV, Hv, num_segs, threads=threads) as (bv, bh, bs):
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

            q_sh = T.alloc_shared((C, K), dtype)
            k_sh = T.alloc_shared((C, K), dtype)
            v_sh = T.alloc_shared((C, bDV), dtype)
            a_sh = T.alloc_shared((C, C), dtype)
            s_sh = T.alloc_shared((K, bDV), dtype)
            w_sh = T.alloc_shared((C, bDV), dtype)
            vd_sh = T.alloc_shared((C, bDV), dtype)
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

            for it in T.serial(T.ceildiv(s1 - s0, C)):
                cs = s0 + it * C
                n = T.min(C, s1 - cs)
                load_qk(q, q_sh, cs, n, hk)
                load_qk(k, k_sh, cs, n, hk)
                load_v(v, v_sh, cs, n, bh, v0)
                load_a(a0, a_sh, cs, n, bh)
                load_gates(gamma, beta, g_sh, b_sh, eg_sh, er_sh, cs, n, bh)
                T.copy(s_f, s_sh)
                T.fence_proxy_async()

                # Pg = scale * Gamma * (Q K^T) and Ag = Gamma * A0 * beta_col, both causal
                T.gemm(q_sh, k_sh, p_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    decay = T.exp2((g_sh[i] - g_sh[j]) * LOG2E)
                    pg_sh[i, j] = T.if_then_else(j <= i, p_f[i, j] * decay * scale, 0.0)
                    ag_sh[i, j] = T.if_then_else(j <= i, a_sh[i, j] * decay * b_sh[j], 0.0)
                # W = V - exp(gamma) * (K S)
                T.gemm(k_sh, s_sh, u_f, clear_accum=True)
                for i, j in T.Parallel(C, bDV):
                    w_sh[i, j] = v_sh[i, j] - eg_sh[i] * u_f[i, j]
                T.fence_proxy_async()
                # Vd = Ag W; Vn = exp(gamma_C - gamma) * Vd goes where W was
                T.gemm(ag_sh, w_sh, vd_f, clear_accum=True)
                T.copy(vd_f, vd_sh)
                for i, j in T.Parallel(C, bDV):
                    w_sh[i, j] = vd_f[i, j] * er_sh[i]
                T.fence_proxy_async()
                # O = scale * exp(gamma) * (Q S) + Pg Vd
                T.gemm(q_sh, s_sh, o_f, clear_accum=True)
                for i, j in T.Parallel(C, bDV):
                    o_f[i, j] = o_f[i, j] * eg_sh[i] * scale
                T.gemm(pg_sh, vd_sh, o_f)
                # S = exp(gamma_C) S + K^T Vn
                for i, j in T.Parallel(K, bDV):
                    s_f[i, j] = s_f[i, j] * eg_sh[C - 1]
                T.gemm(k_sh, w_sh, s_f, transpose_A=True)

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


def fused_fwd(q, k, v, a0, gamma, beta, h_init, segs, o, ht, *, scale: float, bDV: int):
    """Run the fused output stage in place.

    Args:
        q, k: [T, Hk, K]; v, o: [T, Hv, V] (o is written); a0: [T, Hv, 64]; gamma, beta: [T, Hv] fp32;
        h_init: [R, Hv, K, V] fp32 start states (R >= 1); segs: [S, 4] int32; ht: [N, Hv, K, V] fp32 or None.
        scale: output scale. bDV: V slice per CTA (64 or 32).
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    store_final = ht is not None
    kernel = compile_kernel(build_fused_fwd, Hk, Hv, K, V, bDV, tl_dtype(q.dtype), float(scale), store_final)
    if ht is None:
        ht = torch.empty((1, Hv, K, V), dtype=torch.float32, device=q.device)
    kernel(q, k, v, a0, gamma, beta, h_init, segs, o, ht)
