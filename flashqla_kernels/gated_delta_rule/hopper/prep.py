"""Stage 1: per (chunk, value head), the chunk-local gate cumsum and the gate-free UT inverse.

    gamma_i = sum_{j <= i} g_j                               (within the chunk, natural-log units)
    A0      = (I + StrictLower(diag(beta) K K^T))^-1         (C x C, unit lower triangular), stored fp16

A0 depends on k and beta only (FlashQLA's gate factoring): the fused stages re-apply the gate as
``Ag = Gamma * A0 * beta_col`` with Gamma_ij = exp(gamma_i - gamma_j) <= 1, which cannot overflow.
The inverse is exact forward substitution in fp32, one column per thread: column c of A0 solves (I + L) x = e_c
on its own, so the 64 threads never synchronise; L is read from shared memory as a broadcast and x stays in
registers (fully unrolled, 16-row panels skip the zero upper part of L).
Padded rows of a ragged tail chunk are neither read nor written.
"""
import tilelang.language as T
import torch

from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK, compile_kernel, tl_dtype

PANEL = 16


def build_prep(Hk: int, Hv: int, K: int, dtype: str):
    """The prep kernel: grid (chunks, Hv), 64 threads. ``chunks[c] = (start, end)`` token offsets of chunk c."""
    C = CHUNK
    group = Hv // Hk
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_prep(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        g: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        a0: T.Tensor((num_tokens, Hv, C), "float16"),
    ):
        with T.Kernel(num_chunks, Hv, threads=C) as (bc, bh):
            hk = bh // group
            tx = T.get_thread_binding()
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            s0 = chunks[bc, 0]
            s1 = chunks[bc, 1]
            n = s1 - s0

            k_sh = T.alloc_shared((C, K), dtype)
            g_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            l_sh = T.alloc_shared((C, C), "float32")
            kk = T.alloc_fragment((C, C), "float32")
            x = T.alloc_local((C,), "float32")
            acc = T.alloc_local((4,), "float32")

            if n == C:
                T.copy(k[s0:s0 + C, hk, :], k_sh)
            else:
                for i, j in T.Parallel(C, K):
                    k_sh[i, j] = T.if_then_else(i < n, k[T.min(s0 + i, s1 - 1), hk, j], T.cast(0, dtype))
            for i in T.Parallel(C):
                g_sh[i] = T.if_then_else(i < n, g[T.min(s0 + i, s1 - 1), bh], 0.0)
                b_sh[i] = T.if_then_else(i < n, beta[T.min(s0 + i, s1 - 1), bh], 0.0)

            # L = StrictLower(diag(beta) K K^T)
            T.gemm(k_sh, k_sh, kk, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                l_sh[i, j] = T.if_then_else(j < i, kk[i, j] * b_sh[i], 0.0)

            # gamma_tx: chunk-local inclusive cumsum (broadcast reads)
            for a in T.unroll(4):
                acc[a] = 0.0
            for j in T.unroll(C):
                acc[j % 4] += T.if_then_else(j <= tx, g_sh[j], 0.0)
            if tx < n:
                gamma[s0 + tx, bh] = acc[0] + acc[1] + acc[2] + acc[3]

            # column tx of (I + L)^-1: x_r = [r == tx] - sum_{m < r} L[r, m] x_m  (x_m = 0 for m < tx)
            for r in T.unroll(C):
                x[r] = 0.0
            for rb in T.unroll(C // PANEL):
                for rr in T.unroll(PANEL):
                    for a in T.unroll(4):
                        acc[a] = 0.0
                    for m in T.unroll(PANEL * (rb + 1)):
                        acc[m % 4] += l_sh[rb * PANEL + rr, m] * x[m]
                    x[rb * PANEL + rr] = T.if_then_else(rb * PANEL + rr == tx, 1.0,
                                                        -(acc[0] + acc[1] + acc[2] + acc[3]))
            for r in T.unroll(C):
                if r < n:
                    a0[s0 + r, bh, tx] = x[r]

    return gdn_prep


def prep(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunks: torch.Tensor, Hv: int):
    """Run the prep stage.

    Args:
        k: [T, Hk, K] bf16/fp16 contiguous. g, beta: [T, Hv] fp32 contiguous. chunks: [NC, 2] int32 (start, end).
        Hv: value heads.

    Returns:
        gamma [T, Hv] fp32 (chunk-local cumsum of g) and A0 [T, Hv, 64] in k's dtype.
    """
    Tn, Hk, K = k.shape
    kernel = compile_kernel(build_prep, Hk, Hv, K, tl_dtype(k.dtype))
    gamma = torch.empty((Tn, Hv), dtype=torch.float32, device=k.device)
    a0 = torch.empty((Tn, Hv, CHUNK), dtype=torch.float16, device=k.device)
    if chunks.shape[0] > 0:
        kernel(k, g, beta, chunks, gamma, a0)
    return gamma, a0
