"""Stage 1, variant ``prep2``: the prep stage (gate cumsum + gate-free UT inverse) with K K^T shared across a GVA group.

Same outputs as ``prep.prep`` (gamma [T, Hv] fp32, A0 [T, Hv, 64] fp16), same exact forward substitution, different
work split. The default runs one 64-thread CTA per (chunk, value head): every value head of a GVA group reloads the
same K tile and recomputes the same K K^T, and 2 warps per CTA leave the SM latency-bound in the substitution.
Here one CTA per (chunk, key head, slice of G value heads) loads K once, computes S = StrictLower(K K^T) once (fp32,
shared memory) and runs 64 * G threads, one column of one head's inverse each, with beta factored out of the rows:

    x_r = [r == c] - beta_r * sum_{m < r} S[r, m] x_m           (column c of (I + diag(beta) S)^-1)

so no per-head L matrix is stored (one 16 KB S serves G heads) and the CTA carries 2G warps (8 for G = 4).
Warps whose columns all lie right of a 16-row panel skip it (x = 0 there): warp-uniform, no divergence.
Grid (chunks, Hk, group / G) with G = min(group, MAX_HEADS_PER_CTA).

``inverse="blocks"`` (variant ``prep3``) replaces the 64-row substitution chain by the hierarchical inverse FLA's
``solve_tril`` and FlashQLA's ``kkt_solve`` use, on CUDA cores in fp32. With L = diag(beta) S and X = (I + L)^-1:

    1. the four 16 x 16 diagonal blocks by substitution (one column of one block a thread: a 16-row chain);
    2. X[i, j] = -X[i, i] (L[i, j] X[j, j]) for the blocks (1, 0) and (3, 2);
    3. X[B, A] = -X[B, B] (L[B, A] X[A, A]) for the 32 x 32 halves A = rows/columns 0-31, B = 32-63;

steps 2 and 3 as two small products each (a scratch tile between them), every thread a row and 8 or 16 columns.
S and X live in shared memory with rows padded to 65 floats, so the 16 rows a warp reads sit in distinct banks.

``gated=True`` (variant part ``agp``) writes the gated matrix the chunk step multiplies by instead of A0:

    Ag[r, c] = A0[r, c] * exp(gamma_r - gamma_c) * beta_c      (c <= r; 0 above the diagonal)

every factor <= 1 in size next to A0 (gamma is non-increasing, beta <= 1), so fp16 holds it as well as A0. The
fused stage and the segment maps then use the tile as TMA brings it, instead of re-gating 64 x 64 elements per
chunk and V slice (on the H200 the output warpgroup spent ~4300 of a 10900-cycle chunk step on that loop).
"""
import tilelang.language as T
import torch

from flashqla_kernels.gated_delta_rule.hopper._common import CHUNK, LOG2E, compile_kernel, tl_dtype

PANEL = 16
MAX_HEADS_PER_CTA = 4


def heads_per_cta(group: int) -> int:
    """Value heads one CTA solves: the largest divisor of ``group`` up to MAX_HEADS_PER_CTA."""
    return max(d for d in range(1, MAX_HEADS_PER_CTA + 1) if group % d == 0)


INVERSES = ("substitution", "blocks")


def build_prep_v2(Hk: int, Hv: int, K: int, dtype: str, inverse: str = "substitution", gated: bool = False):
    """The grouped prep kernel: grid (chunks, Hk, group / G), 64 * G threads; ``inverse`` and ``gated`` as in the
    module doc."""
    if inverse not in INVERSES:
        raise ValueError(f"inverse must be one of {INVERSES}, got {inverse!r}")
    blocks = inverse == "blocks"
    C = CHUNK
    group = Hv // Hk
    G = heads_per_cta(group)
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_prep_v2(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        g: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        a0: T.Tensor((num_tokens, Hv, C), "float16"),
    ):
        with T.Kernel(num_chunks, Hk, group // G, threads=C * G) as (bc, hk, bg):
            # 16 warps per SM (2 * G per CTA) at <= 128 registers a thread; the default prep holds 228 (4 CTAs of
            # 2 warps per SM)
            T.annotate_min_blocks_per_sm(max(1, 8 // G))
            tx = T.get_thread_binding()
            hl = tx // C
            col = tx % C
            # first column this thread's warp owns: panels entirely above it are zero for the whole warp
            wcol = (tx % C) // 32 * 32
            bh = hk * group + bg * G + hl
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            s0 = chunks[bc, 0]
            s1 = chunks[bc, 1]
            n = s1 - s0

            k_sh = T.alloc_shared((C, K), dtype)
            s_sh = T.alloc_shared((C, C + 1) if blocks else (C, C), "float32")
            g_sh = T.alloc_shared((G, C), "float32")
            b_sh = T.alloc_shared((G, C), "float32")
            kk = T.alloc_fragment((C, C), "float32")
            x = T.alloc_local((C,), "float32")
            acc = T.alloc_local((4,), "float32")

            if n == C:
                T.copy(k[s0:s0 + C, hk, :], k_sh)
            else:
                for i, j in T.Parallel(C, K):
                    k_sh[i, j] = T.if_then_else(i < n, k[T.min(s0 + i, s1 - 1), hk, j], T.cast(0, dtype))
            for h, i in T.Parallel(G, C):
                g_sh[h, i] = T.if_then_else(i < n, g[T.min(s0 + i, s1 - 1), hk * group + bg * G + h], 0.0)
                b_sh[h, i] = T.if_then_else(i < n, beta[T.min(s0 + i, s1 - 1), hk * group + bg * G + h], 0.0)

            # S = StrictLower(K K^T), once for the G heads
            T.gemm(k_sh, k_sh, kk, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                s_sh[i, j] = T.if_then_else(j < i, kk[i, j], 0.0)

            # gamma: chunk-local inclusive cumsum of head hl, row col
            for a in T.unroll(4):
                acc[a] = 0.0
            for j in T.unroll(C):
                acc[j % 4] += T.if_then_else(j <= col, g_sh[hl, j], 0.0)
            gam = T.alloc_var("float32")
            gam = acc[0] + acc[1] + acc[2] + acc[3]
            if col < n:
                gamma[s0 + col, bh] = gam
            # gated: every row's gamma for the write, where no tile of its own is needed (one would not fit beside the
            # inverse's: at G = 4 it cost the SM its second CTA, and the stage 1.75x its time): in the padding
            # column of x_sh (blocks), in g_sh once every thread's cumsum has read it (substitution; TileLang's
            # sync pass puts the barrier in)
            if gated and not blocks:
                g_sh[hl, col] = gam

            if blocks:
                x_sh = T.alloc_shared((G, C, C + 1), "float32")
                t_sh = T.alloc_shared((G, 32, 33), "float32")
                row = T.alloc_local((32,), "float32")
                out = T.alloc_local((16,), "float32")
                if gated:
                    x_sh[hl, col, C] = gam
                T.sync_threads()
                # 1. diagonal block db, its column c: x_r = [r == c] - beta_r sum_{m < r} S[r, m] x_m (16 rows)
                db = col // PANEL
                c = col % PANEL
                for r in T.unroll(PANEL):
                    x[r] = 0.0
                for r in T.unroll(PANEL):
                    for a in T.unroll(4):
                        acc[a] = 0.0
                    for m in T.unroll(r):
                        acc[m % 4] += s_sh[db * PANEL + r, db * PANEL + m] * x[m]
                    x[r] = T.if_then_else(r == c, 1.0, -b_sh[hl, db * PANEL + r] * (acc[0] + acc[1] + acc[2] + acc[3]))
                for r in T.unroll(PANEL):
                    x_sh[hl, db * PANEL + r, db * PANEL + c] = x[r]
                if db % 2 == 0:  # the upper blocks (0, 1) and (2, 3): zero, read by the products of step 3
                    for r in T.unroll(PANEL):
                        x_sh[hl, db * PANEL + r, (db + 1) * PANEL + c] = 0.0
                T.sync_threads()
                # 2. blocks (1, 0) and (3, 2): thread -> pair p, row r of the block, 8 columns from c8
                p = col // 32
                r16 = (col % 32) // 2
                c8 = (col % 2) * 8
                bi = (2 * p + 1) * PANEL
                bj = 2 * p * PANEL
                for m in T.unroll(PANEL):
                    row[m] = s_sh[bi + r16, bj + m]
                for j in T.unroll(8):  # T1 = L[i, j] X[j, j] (X[j, j] lower: m >= column)
                    for a in T.unroll(4):
                        acc[a] = 0.0
                    for m in T.unroll(PANEL):
                        acc[m % 4] += row[m] * x_sh[hl, bj + m, bj + c8 + j]
                    out[j] = b_sh[hl, bi + r16] * (acc[0] + acc[1] + acc[2] + acc[3])
                for j in T.unroll(8):
                    t_sh[hl, p * PANEL + r16, c8 + j] = out[j]
                T.sync_threads()
                for m in T.unroll(PANEL):
                    row[m] = x_sh[hl, bi + r16, bi + m]
                for j in T.unroll(8):  # X[i, j] = -X[i, i] T1 (X[i, i] lower: m <= r16)
                    for a in T.unroll(4):
                        acc[a] = 0.0
                    for m in T.unroll(PANEL):
                        acc[m % 4] += row[m] * t_sh[hl, p * PANEL + m, c8 + j]
                    x_sh[hl, bi + r16, bj + c8 + j] = -(acc[0] + acc[1] + acc[2] + acc[3])
                T.sync_threads()
                # 3. the lower-left 32 x 32 half: thread -> row r32 of B, 16 columns from c16
                r32 = col // 2
                c16 = (col % 2) * 16
                for m in T.unroll(32):
                    row[m] = s_sh[32 + r32, m]
                for j in T.unroll(16):  # T2 = L[B, A] X[A, A]
                    for a in T.unroll(4):
                        acc[a] = 0.0
                    for m in T.unroll(32):
                        acc[m % 4] += row[m] * x_sh[hl, m, c16 + j]
                    out[j] = b_sh[hl, 32 + r32] * (acc[0] + acc[1] + acc[2] + acc[3])
                for j in T.unroll(16):
                    t_sh[hl, r32, c16 + j] = out[j]
                T.sync_threads()
                for m in T.unroll(32):
                    row[m] = x_sh[hl, 32 + r32, 32 + m]
                for j in T.unroll(16):  # X[B, A] = -X[B, B] T2
                    for a in T.unroll(4):
                        acc[a] = 0.0
                    for m in T.unroll(32):
                        acc[m % 4] += row[m] * t_sh[hl, m, c16 + j]
                    x_sh[hl, 32 + r32, c16 + j] = -(acc[0] + acc[1] + acc[2] + acc[3])
                T.sync_threads()
                # A0 rows: thread = column, consecutive threads write consecutive fp16 of a row
                # gated: c <= r only (the gate factor exp(gamma_r - gamma_c) overflows above the diagonal)
                for r in T.unroll(C):
                    if r < n:
                        if gated:
                            a0[s0 + r, bh, col] = T.if_then_else(
                                col <= r, x_sh[hl, r, col] * T.exp2((x_sh[hl, r, C] - gam) * LOG2E)
                                * b_sh[hl, col], 0.0)
                        else:
                            a0[s0 + r, bh, col] = T.if_then_else(col <= r, x_sh[hl, r, col], 0.0)
            else:
                for r in T.unroll(C):
                    x[r] = 0.0
                for rb in T.unroll(C // PANEL):
                    if (rb + 1) * PANEL > wcol:
                        for rr in T.unroll(PANEL):
                            for a in T.unroll(4):
                                acc[a] = 0.0
                            for m in T.unroll(PANEL * (rb + 1)):
                                acc[m % 4] += s_sh[rb * PANEL + rr, m] * x[m]
                            x[rb * PANEL + rr] = T.if_then_else(
                                rb * PANEL + rr == col, 1.0,
                                -b_sh[hl, rb * PANEL + rr] * (acc[0] + acc[1] + acc[2] + acc[3]))
                if gated:
                    T.sync_threads()  # every column's gamma in g_sh
                for r in T.unroll(C):
                    if r < n:
                        if gated:
                            a0[s0 + r, bh, col] = T.if_then_else(
                                col <= r, x[r] * T.exp2((g_sh[hl, r] - gam) * LOG2E) * b_sh[hl, col],
                                0.0)
                        else:
                            a0[s0 + r, bh, col] = x[r]

    return gdn_prep_v2


def prep_v2(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunks: torch.Tensor, Hv: int,
            inverse: str = "substitution", gated: bool = False):
    """Run the grouped prep stage; same contract as ``prep.prep`` (with ``gated``: Ag in place of A0).

    Args:
        k: [T, Hk, K] bf16/fp16 contiguous. g, beta: [T, Hv] fp32 contiguous. chunks: [NC, 2] int32 (start, end).
        Hv: value heads. inverse: "substitution" (``prep2``) or "blocks" (``prep3``); gated: see the module doc.

    Returns:
        gamma [T, Hv] fp32 (chunk-local cumsum of g) and A0 (or Ag) [T, Hv, 64] fp16.
    """
    Tn, Hk, K = k.shape
    args = (Hk, Hv, K, tl_dtype(k.dtype))
    if gated:
        args += (inverse, True)
    elif inverse != "substitution":  # the older kernels keep their cache keys
        args += (inverse,)
    kernel = compile_kernel(build_prep_v2, *args)
    gamma = torch.empty((Tn, Hv), dtype=torch.float32, device=k.device)
    a0 = torch.empty((Tn, Hv, CHUNK), dtype=torch.float16, device=k.device)
    if chunks.shape[0] > 0:
        kernel(k, g, beta, chunks, gamma, a0)
    return gamma, a0
