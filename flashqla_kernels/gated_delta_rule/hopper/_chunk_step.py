"""The per-chunk math shared by the fused output stage and the segment-state stage (TileLang macros).

Gate-factored form (FlashQLA), per chunk with incoming state S [K, bDV] (fp32, in registers):

    U   = K S                          W  = V - exp(gamma) * U        (V = 0 for a transition column)
    Ag  = Gamma * A0 * beta_col        Vd = Ag W                       (= FLA's v_new)
    O   = scale (exp(gamma) * (Q S) + (Gamma * Q K^T) Vd)             (output stage only)
    S  <- exp(gamma_C) S + K^T (exp(gamma_C - gamma) * Vd)

A ragged tail chunk is loaded with zero q/k/v/A0 rows, beta = 0 and gamma padded with its last valid value, so every
padded row contributes exactly zero and Gamma never exceeds 1.
"""
import tilelang.language as T

from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK, LOG2E

C = CHUNK


def make_loaders(Hv: int, group: int, K: int, bDV: int, dtype: str):
    """Macros loading one chunk's tiles into shared memory; ``n`` valid rows starting at token ``cs``."""

    @T.macro
    def load_qk(x, x_sh, cs, n, hk):
        if n == C:
            T.copy(x[cs:cs + C, hk, :], x_sh)
        else:
            for i, j in T.Parallel(C, K):
                x_sh[i, j] = T.if_then_else(i < n, x[T.min(cs + i, cs + n - 1), hk, j], T.cast(0, dtype))

    @T.macro
    def load_v(v, v_sh, cs, n, bh, v0):
        if n == C:
            T.copy(v[cs:cs + C, bh, v0:v0 + bDV], v_sh)
        else:
            for i, j in T.Parallel(C, bDV):
                v_sh[i, j] = T.if_then_else(i < n, v[T.min(cs + i, cs + n - 1), bh, v0 + j], T.cast(0, dtype))

    @T.macro
    def load_a(a0, a_sh, cs, n, bh):
        if n == C:
            T.copy(a0[cs:cs + C, bh, :], a_sh)
        else:
            for i, j in T.Parallel(C, C):
                a_sh[i, j] = T.if_then_else(i < n, a0[T.min(cs + i, cs + n - 1), bh, j], T.cast(0, dtype))

    @T.macro
    def load_gates(gamma, beta, g_sh, b_sh, eg_sh, er_sh, cs, n, bh):
        for i in T.Parallel(C):
            g_sh[i] = gamma[cs + T.min(i, n - 1), bh]
            b_sh[i] = T.if_then_else(i < n, beta[T.min(cs + i, cs + n - 1), bh], 0.0)
        for i in T.Parallel(C):
            eg_sh[i] = T.exp2(g_sh[i] * LOG2E)
            er_sh[i] = T.exp2((g_sh[C - 1] - g_sh[i]) * LOG2E)

    return load_qk, load_v, load_a, load_gates
