"""Stage 1: per (chunk, value head), the chunk-local gate cumsum and the gate-free UT inverse.

    gamma_i = sum_{j <= i} g_j                               (within the chunk, natural-log units)
    A0      = (I + StrictLower(diag(beta) K K^T))^-1         (C x C, unit lower triangular)

A0 depends on k and beta only (FlashQLA's gate factoring): the fused stages re-apply the gate as
``Ag = Gamma * A0 * beta_col`` with Gamma_ij = exp(gamma_i - gamma_j) <= 1, which cannot overflow.
The inverse is hierarchical and exact in fp32 on CUDA cores: four 16 x 16 diagonal blocks by forward substitution,
then the block formula [[X, 0], [C, Y]]^-1 = [[X^-1, 0], [-Y^-1 C X^-1, Y^-1]] at 32 and at 64.
Padded rows of a ragged tail chunk are neither read nor written.
"""

import tilelang.language as T
import torch

from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK, compile_kernel, tl_dtype


def build_prep(Hk: int, Hv: int, K: int, dtype: str):
    """The prep kernel: grid (chunks, Hv), 128 threads. ``chunks[c] = (start, end)`` token offsets of chunk c."""
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
        a0: T.Tensor((num_tokens, Hv, C), dtype),
    ):
        with T.Kernel(num_chunks, Hv, threads=128) as (bc, bh):
            hk = bh // group
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            s0 = chunks[bc, 0]
            s1 = chunks[bc, 1]
            n = s1 - s0

            k_sh = T.alloc_shared((C, K), dtype)
            g_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            x_sh = T.alloc_shared((C, C + 1), "float32")
            l_sh = T.alloc_shared((C, C + 1), "float32")
            t_sh = T.alloc_shared((C // 2, C // 2 + 1), "float32")
            kk = T.alloc_fragment((C, C), "float32")
            acc16 = T.alloc_fragment((2, 16, 16), "float32")
            acc32 = T.alloc_fragment((C // 2, C // 2), "float32")
            cum = T.alloc_fragment((C,), "float32")

            if n == C:
                T.copy(k[s0:s0 + C, hk, :], k_sh)
            else:
                for i, j in T.Parallel(C, K):
                    k_sh[i, j] = T.if_then_else(i < n, k[s0 + i, hk, j], T.cast(0, dtype))
            for i in T.Parallel(C):
                g_sh[i] = T.if_then_else(i < n, g[s0 + i, bh], 0.0)
                b_sh[i] = T.if_then_else(i < n, beta[s0 + i, bh], 0.0)

            # gamma: chunk-local inclusive cumsum (64 x 64 masked sums; tiny next to the GEMM)
            T.clear(cum)
            for j in T.serial(C):
                for i in T.Parallel(C):
                    cum[i] += T.if_then_else(j <= i, g_sh[j], 0.0)
            for i in T.Parallel(C):
                if i < n:
                    gamma[s0 + i, bh] = cum[i]

            # L = StrictLower(diag(beta) K K^T)
            T.gemm(k_sh, k_sh, kk, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                l_sh[i, j] = T.if_then_else(j < i, kk[i, j] * b_sh[i], 0.0)
                x_sh[i, j] = T.if_then_else(i == j, 1.0, 0.0)

            # Level 1: the four 16 x 16 diagonal blocks, forward substitution row by row.
            # X[r, c] = -L[r, c] - sum_{c < m < r} L[r, m] X[m, c]   (block-local r > c)
            for r in T.serial(1, 16):
                for bb, c in T.Parallel(4, 16):
                    if c < r:
                        acc = T.alloc_var("float32")
                        acc = -l_sh[bb * 16 + r, bb * 16 + c]
                        for m in T.serial(c + 1, r):
                            acc -= l_sh[bb * 16 + r, bb * 16 + m] * x_sh[bb * 16 + m, bb * 16 + c]
                        x_sh[bb * 16 + r, bb * 16 + c] = acc

            # Level 2: X[16+r, c] (within each 32-block p) = -Y1 (L10 X0)
            T.clear(acc16)
            for m in T.serial(16):
                for p, r, c in T.Parallel(2, 16, 16):
                    acc16[p, r, c] += l_sh[p * 32 + 16 + r, p * 32 + m] * x_sh[p * 32 + m, p * 32 + c]
            for p, r, c in T.Parallel(2, 16, 16):
                t_sh[p * 16 + r, c] = acc16[p, r, c]
            T.clear(acc16)
            for m in T.serial(16):
                for p, r, c in T.Parallel(2, 16, 16):
                    acc16[p, r, c] -= x_sh[p * 32 + 16 + r, p * 32 + 16 + m] * t_sh[p * 16 + m, c]
            for p, r, c in T.Parallel(2, 16, 16):
                x_sh[p * 32 + 16 + r, p * 32 + c] = acc16[p, r, c]

            # Level 3: X[32+r, c] = -Y1 (L[32:, :32] Y0)
            T.clear(acc32)
            for m in T.serial(C // 2):
                for r, c in T.Parallel(C // 2, C // 2):
                    acc32[r, c] += l_sh[C // 2 + r, m] * x_sh[m, c]
            for r, c in T.Parallel(C // 2, C // 2):
                t_sh[r, c] = acc32[r, c]
            T.clear(acc32)
            for m in T.serial(C // 2):
                for r, c in T.Parallel(C // 2, C // 2):
                    acc32[r, c] -= x_sh[C // 2 + r, C // 2 + m] * t_sh[m, c]
            for r, c in T.Parallel(C // 2, C // 2):
                x_sh[C // 2 + r, c] = acc32[r, c]

            for i, j in T.Parallel(C, C):
                if i < n:
                    a0[s0 + i, bh, j] = x_sh[i, j]

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
    a0 = torch.empty((Tn, Hv, CHUNK), dtype=k.dtype, device=k.device)
    if chunks.shape[0] > 0:
        kernel(k, g, beta, chunks, gamma, a0)
    return gamma, a0
