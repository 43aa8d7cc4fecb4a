"""Stage 1: per (chunk, value head), the chunk-local gate cumsum and the gated UT inverse, with K K^T shared across a
GVA group and the block merges of the inverse on tensor cores.

    gamma_i = sum_{j <= i} g_j                                            (within the chunk, natural-log units)
    A0      = (I + StrictLower(diag(beta) K K^T))^-1                      (C x C, unit lower triangular, gate-free)
    Ag      = Gamma * A0 * beta_col,  Gamma_rc = exp(gamma_r - gamma_c)   (c <= r; 0 above the diagonal)

Ag is the matrix the chunk step multiplies by (Vd = Ag W, see ``chunk_fwd``). Every factor of the gate is <= 1 in size
(gamma is non-increasing, beta <= 1), so fp16 holds Ag as well as A0, and ``chunk_fwd`` and ``segment_states`` use
the tile as it is loaded instead of re-gating 64 x 64 elements per chunk and V slice. The gate is formed only on and
below the diagonal (exp(gamma_r - gamma_c) overflows above it).

Work split: one CTA per (chunk, key head, slice of G value heads), G = ``heads_per_cta(Hv // Hk)``, loads K once and
computes S = K K^T once for its G heads, then runs 64 * G threads, one column of one head's inverse each. The inverse
is the hierarchical one of FLA's ``solve_tril`` and FlashQLA's ``kkt_solve``; with L = diag(beta) S and X = (I + L)^-1:

    1. the four 16 x 16 diagonal blocks D0..D3 by substitution, one column of one block a thread, in fp32:
           x_r = [r == c] - beta_r sum_{m < r} S[r, m] x_m
    2. X10 and X32 together as one 32 x 32 x 32 tensor-core product pair on block-diagonal tiles:
           T1 = diag(beta) blockdiag(S10, S32) blockdiag(D0, D2),   blockdiag(X10, X32) = -blockdiag(D1, D3) T1
    3. X[B, A] for the 32 x 32 halves A = rows/columns 0-31, B = 32-63:
           T2 = diag(beta_B) S[B, A] X[A, A],                       X[B, A] = -X[B, B] T2

The merges run on tensor cores because on CUDA cores this stage was issue-bound on shared-memory reads (one load per
multiply-add). Products take fp16 operands with fp32 accumulation (FLA's ``solve_tril`` merges in tf32, which rounds
coarser); every block of the result is gated in fp32 and rounded to fp16 once, into a staged 64 x 64 tile per head
that the CTA then writes row by row. Each product is one ``T.gemm`` over all the CTA's warps, head after head.
A ragged tail chunk loads its padded rows as k = 0, beta = 0 and writes only its valid rows.

With ``l2norm`` (``use_qk_l2norm_in_kernel``) the keys are normalised inside the stage instead of in a separate pass
over q and k: the diagonal of K K^T holds every row's squared norm, so ``r_i = rsqrt(|k_i|^2 + eps)`` and the
normalised product is ``r_i S_ij r_j``, scaled in fp32 before the inverse; a Q Q^T product on the same tile gives the
queries' ``r``. Both go to ``rn [T, Hk, 2]`` (q, k) for the later stages, which fold them into their per-row scalings
(``chunk_fwd``, ``segment_states``); q and k themselves are never rewritten.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.plan import CHUNK, heads_per_cta

LOG2E = toolkit.LOG2E
PANEL = 16
HALF = CHUNK // 2
# the l2norm's epsilon, FLA's and transformers': x * rsqrt(sum(x^2) + 1e-6)
L2NORM_EPS = 1e-6


def build_kkt_solve(Hk: int, Hv: int, K: int, dtype: str, l2norm: bool = False):
    """The kkt_solve kernel: grid (chunks, Hk, group / G), 64 * G threads, G = ``heads_per_cta(Hv // Hk)``;
    ``l2norm``: normalise the keys inside the stage and write both inverse norms to ``rn`` (the module doc)."""
    C = CHUNK
    group = Hv // Hk
    G = heads_per_cta(group)
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    # q and rn are read / written only with l2norm; without it the launcher passes one-row placeholders
    num_rn = T.dynamic("num_rn")

    @T.prim_func
    def gdn_kkt_solve(
        k: T.Tensor((num_tokens, Hk, K), dtype),
        g: T.Tensor((num_tokens, Hv), "float32"),
        beta: T.Tensor((num_tokens, Hv), "float32"),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        gamma: T.Tensor((num_tokens, Hv), "float32"),
        a0: T.Tensor((num_tokens, Hv, C), "float16"),
        q: T.Tensor((num_rn, Hk, K), dtype),
        rn: T.Tensor((num_rn, Hk, 2), "float32"),
    ):
        with T.Kernel(num_chunks, Hk, group // G, threads=C * G) as (bc, hk, bg):
            # 16 warps per SM (2 * G per CTA) at <= 128 registers a thread
            T.annotate_min_blocks_per_sm(max(1, 8 // G))
            tx = T.get_thread_binding()
            hl = tx // C
            col = tx % C
            bh = hk * group + bg * G + hl
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            s0 = chunks[bc, 0]
            s1 = chunks[bc, 1]
            n = s1 - s0

            k_sh = T.alloc_shared((C, K), dtype)
            g_sh = T.alloc_shared((G, C), "float32")
            b_sh = T.alloc_shared((G, C), "float32")
            gm_sh = T.alloc_shared((G, C), "float32")  # gamma of every row, for the gate of each element
            # row i: S[i, 16 * (i // 16) + m], the diagonal blocks; rows of 20 floats: 16-byte aligned for the
            # substitution's 4-wide loads, and the scatter's 8 rows a store fall at most two to a bank
            sd_sh = T.alloc_shared((C, PANEL + 4), "float32")
            # product operands (fp16): S's blocks (shared by the heads), then per head X's diagonal halves,
            # blockdiag(D0, D2) / blockdiag(D1, D3), and a scratch tile for T1 / T2
            sbd = T.alloc_shared((HALF, HALF), "float16")  # blockdiag(S10, S32)
            sba = T.alloc_shared((HALF, HALF), "float16")  # S[B, A]
            xaa = T.alloc_shared((G, HALF, HALF), "float16")
            xbb = T.alloc_shared((G, HALF, HALF), "float16")
            d02 = T.alloc_shared((G, HALF, HALF), "float16")
            d13 = T.alloc_shared((G, HALF, HALF), "float16")
            t_sh = T.alloc_shared((G, HALF, HALF), "float16")
            # the tile each head writes, gated and rounded once; rows padded by 16 bytes, so the 8 rows of a fragment
            # store fall in distinct banks
            out_sh = T.alloc_shared((G, C, C + 8), "float16")
            rk_sh = T.alloc_shared((C,), "float32") if l2norm else None
            kk = T.alloc_fragment((C, C), "float32")
            f = T.alloc_fragment((HALF, HALF), "float32")
            x = T.alloc_local((PANEL,), "float32")
            acc = T.alloc_local((4,), "float32")
            quad = T.alloc_local((4,), "float32")

            if n == C:
                T.copy(k[s0:s0 + C, hk, :], k_sh)
            else:
                for i, j in T.Parallel(C, K):
                    k_sh[i, j] = T.if_then_else(i < n, k[T.min(s0 + i, s1 - 1), hk, j], T.cast(0, dtype))
            for h, i in T.Parallel(G, C):
                g_sh[h, i] = T.if_then_else(i < n, g[T.min(s0 + i, s1 - 1), hk * group + bg * G + h], 0.0)
                b_sh[h, i] = T.if_then_else(i < n, beta[T.min(s0 + i, s1 - 1), hk * group + bg * G + h], 0.0)

            # S = K K^T once for the G heads, scattered into the diagonal blocks and the two product operands
            T.gemm(k_sh, k_sh, kk, transpose_B=True, clear_accum=True)
            if l2norm:
                # the keys' inverse norms from S's diagonal, then S of the normalised keys (padded rows: k = 0)
                for i, j in T.Parallel(C, C):
                    if i == j:
                        rk_sh[i] = T.rsqrt(kk[i, j] + L2NORM_EPS)
                T.sync_threads()
                for i, j in T.Parallel(C, C):
                    kk[i, j] = kk[i, j] * rk_sh[i] * rk_sh[j]
            for i, j in T.Parallel(C, C):
                if i // PANEL == j // PANEL:
                    sd_sh[i, j % PANEL] = T.if_then_else(j < i, kk[i, j], 0.0)
                if i >= HALF and j < HALF:
                    sba[i - HALF, j] = kk[i, j]
                if (i // PANEL) % 2 == 1 and j // PANEL == i // PANEL - 1:
                    sbd[i // HALF * PANEL + i % PANEL, j // HALF * PANEL + j % PANEL] = kk[i, j]
            for i, j in T.Parallel(PANEL, PANEL):
                sbd[i, PANEL + j] = 0.0
                sbd[PANEL + i, j] = 0.0
            for h, i, j in T.Parallel(G, PANEL, PANEL):  # the zero blocks of X's halves and of the D tiles
                xaa[h, i, PANEL + j] = 0.0
                xbb[h, i, PANEL + j] = 0.0
                d02[h, i, PANEL + j] = 0.0
                d02[h, PANEL + i, j] = 0.0
                d13[h, i, PANEL + j] = 0.0
                d13[h, PANEL + i, j] = 0.0
            for h, i, j in T.Parallel(G, HALF, HALF):  # the zero blocks of the written tile (above the diagonal)
                out_sh[h, i, HALF + j] = T.cast(0, "float16")
            for h, i, j in T.Parallel(G, PANEL, PANEL):
                out_sh[h, i, PANEL + j] = T.cast(0, "float16")
                out_sh[h, HALF + i, HALF + PANEL + j] = T.cast(0, "float16")

            # gamma: chunk-local inclusive cumsum of head hl, row col
            # (four columns a 16-byte load: the head's g row is the same for the whole warp, one broadcast each)
            for a in T.unroll(4):
                acc[a] = 0.0
            for j4 in T.unroll(C // 4):
                for a in T.vectorized(4):
                    quad[a] = g_sh[hl, j4 * 4 + a]
                for a in T.unroll(4):
                    acc[a] += T.if_then_else(j4 * 4 + a <= col, quad[a], 0.0)
            gam = T.alloc_var("float32")
            gam = acc[0] + acc[1] + acc[2] + acc[3]
            if col < n:
                gamma[s0 + col, bh] = gam
            gm_sh[hl, col] = gam
            bcol = T.alloc_var("float32")
            bcol = b_sh[hl, col]
            T.sync_threads()

            # 1. diagonal block db, its column c: x_r = [r == c] - beta_r sum_{m < r} S[r, m] x_m (16 rows)
            db = col // PANEL
            c = col % PANEL
            for r in T.unroll(PANEL):
                x[r] = 0.0
            # row r's entries come four at a time (16-byte loads; half a warp shares the address)
            for r in T.unroll(PANEL):
                for a in T.unroll(4):
                    acc[a] = 0.0
                for m4 in T.unroll((r + 3) // 4):
                    for a in T.vectorized(4):
                        quad[a] = sd_sh[db * PANEL + r, m4 * 4 + a]
                    for a in T.unroll(4):
                        if m4 * 4 + a < r:
                            acc[a] += quad[a] * x[m4 * 4 + a]
                x[r] = T.if_then_else(r == c, 1.0, -b_sh[hl, db * PANEL + r] * (acc[0] + acc[1] + acc[2] + acc[3]))
            # rows/columns of the block inside its half (warp-uniform: a warp's 32 columns are one half)
            ro = (db % 2) * PANEL
            for r in T.unroll(PANEL):
                if db < 2:
                    xaa[hl, ro + r, ro + c] = T.cast(x[r], "float16")
                else:
                    xbb[hl, ro + r, ro + c] = T.cast(x[r], "float16")
                if db % 2 == 0:
                    d02[hl, db // 2 * PANEL + r, db // 2 * PANEL + c] = T.cast(x[r], "float16")
                else:
                    d13[hl, db // 2 * PANEL + r, db // 2 * PANEL + c] = T.cast(x[r], "float16")
                out_sh[hl, db * PANEL + r, col] = T.cast(T.if_then_else(
                    r >= c, x[r] * T.exp2((gm_sh[hl, db * PANEL + r] - gam) * LOG2E) * bcol, 0.0), "float16")
            T.sync_threads()

            # 2. X10 and X32: T1 = diag(beta) blockdiag(S10, S32) blockdiag(D0, D2); then -blockdiag(D1, D3) T1.
            # Row i of the 32-row tiles is matrix row 16 + i (i < 16) or 48 + (i - 16) = 32 + i (i >= 16).
            for h in T.serial(G):
                T.gemm(sbd, d02[h, :, :], f, clear_accum=True)
                for i, j in T.Parallel(HALF, HALF):
                    t_sh[h, i, j] = T.cast(f[i, j] * b_sh[h, PANEL + i + i // PANEL * PANEL], "float16")
                T.sync_threads()
                T.gemm(d13[h, :, :], t_sh[h, :, :], f, clear_accum=True)
                for i, j in T.Parallel(HALF, HALF):
                    if i // PANEL == j // PANEL:
                        if i < PANEL:
                            xaa[h, PANEL + i, j] = T.cast(-f[i, j], "float16")
                        else:
                            xbb[h, i, j - PANEL] = T.cast(-f[i, j], "float16")
                        out_sh[h, PANEL + i + i // PANEL * PANEL, j + j // PANEL * PANEL] = T.cast(
                            -f[i, j] * T.exp2((gm_sh[h, PANEL + i + i // PANEL * PANEL]
                                               - gm_sh[h, j + j // PANEL * PANEL]) * LOG2E)
                            * b_sh[h, j + j // PANEL * PANEL], "float16")
                T.sync_threads()

            # 3. X[B, A] = -X[B, B] (diag(beta_B) S[B, A] X[A, A])
            for h in T.serial(G):
                T.gemm(sba, xaa[h, :, :], f, clear_accum=True)
                for i, j in T.Parallel(HALF, HALF):
                    t_sh[h, i, j] = T.cast(f[i, j] * b_sh[h, HALF + i], "float16")
                T.sync_threads()
                T.gemm(xbb[h, :, :], t_sh[h, :, :], f, clear_accum=True)
                for i, j in T.Parallel(HALF, HALF):
                    out_sh[h, HALF + i, j] = T.cast(
                        -f[i, j] * T.exp2((gm_sh[h, HALF + i] - gm_sh[h, j]) * LOG2E) * b_sh[h, j], "float16")
            T.sync_threads()

            # the tiles to HBM: 16 bytes (8 fp16 of a row) a thread per step, a row of one head in 8 threads
            for it in T.unroll(C // 8):
                idx = it * C * G + tx
                h = idx // (C * 8)
                r = idx // 8 % C
                seg = idx % 8 * 8
                if r < n:
                    for v in T.vectorized(8):
                        a0[s0 + r, hk * group + bg * G + h, seg + v] = out_sh[h, r, seg + v]

            if l2norm:
                # the queries' inverse norms from the diagonal of Q Q^T on the key tile's buffer (its product is
                # done); one CTA of each key head writes rn
                T.sync_threads()
                if n == C:
                    T.copy(q[s0:s0 + C, hk, :], k_sh)
                else:
                    for i, j in T.Parallel(C, K):
                        k_sh[i, j] = T.if_then_else(i < n, q[T.min(s0 + i, s1 - 1), hk, j], T.cast(0, dtype))
                T.gemm(k_sh, k_sh, kk, transpose_B=True, clear_accum=True)
                if bg == 0:
                    for i, j in T.Parallel(C, C):
                        if i == j and i < n:
                            rn[s0 + i, hk, 0] = T.rsqrt(kk[i, j] + L2NORM_EPS)
                    for i in T.Parallel(C):
                        if i < n:
                            rn[s0 + i, hk, 1] = rk_sh[i]

    return gdn_kkt_solve



def kkt_solve(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunks: torch.Tensor, Hv: int,
              q: torch.Tensor | None = None):
    """Run the kkt_solve stage.

    Args:
        k: [T, Hk, K] bf16/fp16 contiguous. g, beta: [T, Hv] fp32 contiguous. chunks: [NC, 2] int32 (start, end).
        Hv: value heads. q: [T, Hk, K] like k to l2-normalise q and k inside the stages, or None.

    Returns:
        gamma [T, Hv] fp32 (chunk-local cumsum of g), Ag [T, Hv, 64] fp16 (row t: token t's row of its chunk's Ag)
        and, with q, rn [T, Hk, 2] fp32 (the inverse l2 norms of q and k; else None).
    """
    Tn, Hk, K = k.shape
    l2norm = q is not None
    kernel = toolkit.compile_kernel(build_kkt_solve, Hk, Hv, K, toolkit.tl_dtype(k.dtype), l2norm)
    gamma = toolkit.empty((Tn, Hv), torch.float32, k.device)
    ag = toolkit.empty((Tn, Hv, CHUNK), torch.float16, k.device)
    rn = toolkit.empty((Tn, Hk, 2), torch.float32, k.device) if l2norm else None
    if chunks.shape[0] > 0:
        kernel(k, g, beta, chunks, gamma, ag, *((q, rn) if l2norm else placeholders(k)))
    return gamma, ag, rn


def placeholders(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-row q / rn arguments of stages built without l2norm (never read)."""
    Hk = k.shape[1]
    return k[:1], toolkit.unread((1, Hk, 2), torch.float32, k.device)
