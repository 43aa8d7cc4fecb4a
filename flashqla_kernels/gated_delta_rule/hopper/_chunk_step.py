"""Chunk loaders shared by the fused output stage and the segment-state stage (TileLang macros).

Gate-factored form (FlashQLA), per chunk with incoming state S [K, bDV] (fp32, in registers):

    U   = K S                          W  = V - exp(gamma) * U        (V = 0 for a transition column)
    Ag  = Gamma * A0 * beta_col        Vd = Ag W                       (= FLA's v_new)
    O   = scale (exp(gamma) * (Q S) + (Gamma * Q K^T) Vd)             (output stage only)
    S  <- exp(gamma_C) S + K^T (exp(gamma_C - gamma) * Vd)

A ragged tail chunk is loaded with zero q/k/v/A0 rows, beta = 0 and gamma padded with its last valid value, so every
padded row contributes exactly zero and Gamma never exceeds 1.
"""
import tilelang.language as T

from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK

C = CHUNK


def make_loaders(K: int, bDV: int, dtype: str):
    """Macros: ``load_tile`` (masked, synchronous: the ragged tail chunk), ``fetch_gates`` (register prefetch of one
    chunk's gamma, padded with its last valid value, and beta, zero-padded; issued a chunk step before use) and
    ``store_gates`` (those registers to shared memory)."""

    @T.macro
    def load_tile(x, x_sh, buf, cs, n, head, col0, width):
        for i, j in T.Parallel(C, width):
            x_sh[buf, i, j] = T.if_then_else(i < n, x[T.min(cs + i, cs + n - 1), head, col0 + j],
                                             T.cast(0, x_sh.dtype))

    @T.macro
    def fetch_gates(gamma, beta, gnext, cs, n, bh, tx):
        if tx < C:
            gnext[0] = gamma[cs + T.min(tx, n - 1), bh]
            gnext[1] = T.if_then_else(tx < n, beta[T.min(cs + tx, cs + n - 1), bh], 0.0)

    @T.macro
    def store_gates(g_sh, b_sh, gnext, tx):
        if tx < C:
            g_sh[tx] = gnext[0]
            b_sh[tx] = gnext[1]

    return load_tile, fetch_gates, store_gates
