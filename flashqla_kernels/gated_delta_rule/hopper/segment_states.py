"""Stage 2 (context parallelism only): each non-final segment's affine map, exactly.

A segment maps its incoming state linearly plus a constant: ``S_end = M S_start + H`` with
``H`` = the end state from a zero start (V columns) and ``M`` = the map applied to the identity with V = 0 (K columns).
One kernel computes both: CTAs with ``bv < V / bDV`` run the state recurrence on V from zeros; the others run it on
the identity's columns with no V input. No term is dropped (FlashQLA's auto-CP drops terms below exp(-10)).

Grid (V / bDV + K / bDV, Hv, segments). ``segs[s] = (start, end)``. Outputs H [S, Hv, K, V], M [S, Hv, K, K] fp32.
"""
import tilelang.language as T
import torch

from flashqla_kernels.gated_delta_rule.hopper._chunk_step import make_loaders
from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK, LOG2E, compile_kernel, tl_dtype

C = CHUNK


def build_segment_states(Hk: int, Hv: int, K: int, V: int, bDV: int, dtype: str):
    group = Hv // Hk
    nV = V // bDV
    num_tokens = T.dynamic("num_tokens")
    num_segs = T.dynamic("num_segs")
    load_qk, load_v, load_a, load_gates = make_loaders(Hv, group, K, bDV, dtype)

    @T.prim_func
    def gdn_segment_states(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        v: T.Tensor((num_tokens, Hv, V), dtype),
        a0: T.Tensor((num_tokens, Hv, C), dtype),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        segs: T.Tensor((num_segs, 2), "int32"),
        hs: T.Tensor((num_segs, Hv, K, V), "float32"),
        ms: T.Tensor((num_segs, Hv, K, K), "float32"),
    ):
        with T.Kernel(nV + K // bDV, Hv, num_segs, threads=128) as (bv, bh, bs):
            hk = bh // group
            is_m = bv >= nV
            v0 = T.alloc_var("int32")
            v0 = T.if_then_else(is_m, (bv - nV) * bDV, bv * bDV)
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            s0 = segs[bs, 0]
            s1 = segs[bs, 1]
            cs = T.alloc_var("int32")
            n = T.alloc_var("int32")

            k_sh = T.alloc_shared((C, K), dtype)
            v_sh = T.alloc_shared((C, bDV), dtype)
            a_sh = T.alloc_shared((C, C), dtype)
            s_sh = T.alloc_shared((K, bDV), dtype)
            w_sh = T.alloc_shared((C, bDV), dtype)
            ag_sh = T.alloc_shared((C, C), dtype)
            g_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            eg_sh = T.alloc_shared((C,), "float32")
            er_sh = T.alloc_shared((C,), "float32")

            s_f = T.alloc_fragment((K, bDV), "float32")
            u_f = T.alloc_fragment((C, bDV), "float32")
            vd_f = T.alloc_fragment((C, bDV), "float32")

            for i, j in T.Parallel(K, bDV):
                s_f[i, j] = T.if_then_else(is_m and i == v0 + j, 1.0, 0.0)

            for it in T.serial(T.ceildiv(s1 - s0, C)):
                cs = s0 + it * C
                n = T.min(C, s1 - cs)
                load_qk(k, k_sh, cs, n, hk)
                if is_m:
                    T.clear(v_sh)
                else:
                    load_v(v, v_sh, cs, n, bh, v0)
                load_a(a0, a_sh, cs, n, bh)
                load_gates(gamma, beta, g_sh, b_sh, eg_sh, er_sh, cs, n, bh)
                T.copy(s_f, s_sh)
                for i, j in T.Parallel(C, C):
                    ag_sh[i, j] = T.if_then_else(
                        j <= i, a_sh[i, j] * T.exp2((g_sh[i] - g_sh[j]) * LOG2E) * b_sh[j], 0.0)
                T.fence_proxy_async()
                T.gemm(k_sh, s_sh, u_f, clear_accum=True)
                for i, j in T.Parallel(C, bDV):
                    w_sh[i, j] = v_sh[i, j] - eg_sh[i] * u_f[i, j]
                T.fence_proxy_async()
                T.gemm(ag_sh, w_sh, vd_f, clear_accum=True)
                for i, j in T.Parallel(C, bDV):
                    w_sh[i, j] = vd_f[i, j] * er_sh[i]
                T.fence_proxy_async()
                for i, j in T.Parallel(K, bDV):
                    s_f[i, j] = s_f[i, j] * eg_sh[C - 1]
                T.gemm(k_sh, w_sh, s_f, transpose_A=True)

            if is_m:
                T.copy(s_f, ms[bs, bh, :, v0:v0 + bDV])
            else:
                T.copy(s_f, hs[bs, bh, :, v0:v0 + bDV])

    return gdn_segment_states


def segment_states(k, v, a0, gamma, beta, segs, *, bDV: int):
    """Each segment's map ``S_end = M S_start + H``.

    Args:
        k: [T, Hk, K]; v: [T, Hv, V]; a0: [T, Hv, 64]; gamma, beta: [T, Hv] fp32; segs: [S, 2] int32 token ranges.

    Returns:
        H [S, Hv, K, V] fp32 and M [S, Hv, K, K] fp32.
    """
    Tn, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    kernel = compile_kernel(build_segment_states, Hk, Hv, K, V, bDV, tl_dtype(k.dtype))
    S = segs.shape[0]
    hs = torch.empty((S, Hv, K, V), dtype=torch.float32, device=k.device)
    ms = torch.empty((S, Hv, K, K), dtype=torch.float32, device=k.device)
    if S > 0:
        kernel(k, v, a0, gamma, beta, segs, hs, ms)
    return hs, ms
