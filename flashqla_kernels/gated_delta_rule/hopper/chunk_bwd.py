"""The chunked gated delta rule's backward on sm_90a: the stages, their math, and the small kernels at either end.

Notation as in the README (Hk key heads, Hv value heads, K, V head dims, C = 64). Per chunk of one sequence and one
value head: S the state entering it, dS' the gradient of the state leaving it, gamma the chunk-local cumsum of g,
e = exp(gamma), e_C = exp(gamma_C) (the last valid token's), r = exp(gamma_C - gamma), Gamma_ij = exp(gamma_i -
gamma_j) for i >= j (else 0), X = Ag = Gamma * A0 * beta_col as ``kkt_solve`` writes it (X = A diag(beta), A the
gated inverse). q and k are the normalised keys when ``use_qk_l2norm_in_kernel``.

    l2norm fwd   (this file)     qn = rq q, kn = rk k, r = rsqrt(|x|^2 + 1e-6)                       [T, Hk, K], [T, Hk]
    kkt_solve    (forward's)     gamma [T, Hv], X [T, Hv, C] on kn
    states       (chunk_fwd's    per chunk, walking forward: h_c = S, W = V - diag(e) K S, v_new = X W,
                 chunk_states)   S <- e_C S + K^T diag(r) v_new                          h [NC, Hv, K, V], v_new
    dh           (bwd_dh)        per chunk, walking backward from dht: dh_c = dS',
                                 dv = diag(r) K dS' + (scale Q K^T * Gamma)^T dO           (dv_local fused in)
                                 dS = e_C dS' + scale Q^T diag(e) dO - K^T diag(e) X^T dv   (= w^T dv, w = X diag(e) K)
                                 and dh0 = dS of each sequence's first chunk
    dqkwg        (bwd_dqkwg)     dP = scale dO v_new^T * Gamma, dq = scale diag(e) dO S^T + dP K,
                                 dk = diag(r) v_new dS'^T + dP^T Q, dw = -dv S^T,
                                 dgamma_i = dq_i.q_i - dk_i.k_i (+ e_C <S, dS'> + sum_j r_j k_j.(v_new dS'^T)_j on
                                 the last token), per 64-wide block of K (partial sums over K blocks)
    wy           (bwd_wy)        A = I - X StrictLower(K K^T * Gamma)  (from (I + L) A = I: A L = X SL(K K^T * Gamma)),
                                 dA = dw (diag(beta e) K)^T + du (diag(beta) V)^T, dM = StrictLower(-A^T dA A^T),
                                 dk += diag(beta e) A^T dw + dKK K + dKK^T K, dKK = dM * beta_row * Gamma,
                                 dv = diag(beta) A^T du, dbeta = e (A^T dw).k + (A^T du).v + rowsum(dM * KKg),
                                 dgamma += beta e (A^T dw).k + rowsum(E) - colsum(E), E = dM * beta_row * KKg;
                                 then dg = reverse cumsum of all dgamma within the chunk
    gva + l2norm (this file)     dq, dk summed over the Hv / Hk value heads of each key head, in head order, then
                                 dx = r (dy - (y.dy) y), y = r x, when use_qk_l2norm_in_kernel     [T, Hk, K]

Context parallelism (few long sequences): the states and dh walks run per segment instead of per sequence, each
exact. A segment's forward map is affine, S_end = M S_start + H, so
    states       as in the forward (its plan and split rule): segment_states gives every segment's M and H,
                 state_scan every segment's start state, and chunk_states walks all segments at once from them;
    dh           over ``plan.choose_bwd_segment_chunks``' segments, segment_states gives their maps M, bwd_dh
                 walks every segment but each sequence's first from dS_end = 0 (its own start gradient c),
                 state_scan_bwd carries dS_end[i - 1] = M_i^T dS_end[i] + c_i back from dht, and bwd_dh walks all
                 segments again from their true dS_end (dh, dv; the first segments' start gradients are dh0).

Determinism: every output element is written by exactly one CTA; sums across CTAs (the GVA group, the K blocks of
dgamma) are fixed-order loops over fp32 partials in HBM, never atomics. Tokens of a padded tail (after
cu_seqlens[-1]) are in no chunk: no kernel writes them, the launcher zeroes them.

The kernels are verified on a GPU by ``tests/flashqla_kernels/test_hopper_bwd_gpu.py`` (each stage against its float64
reference in ``reference_bwd.py``, the whole against ``chunk_gated_delta_rule_bwd_ref``);
``tests/flashqla_kernels/test_hopper_bwd_build.py`` compiles every stage for sm_90a on CPU.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper.plan import CHUNK

C = CHUNK
LOG2E = toolkit.LOG2E
# the column block of K and V the per-chunk stages loop over (shared memory and registers stay flat up to 256)
TILE = 64
L2NORM_EPS = 1e-6
THREADS = 256
# pad of the fp32 [C, K] tiles the grouped kernels keep in accumulator layout (each thread its own elements): a row of
# K = 64 or 128 floats is a multiple of 128 bytes, so the 8 rows a warp touches at once fall on the same banks (4x
# conflicts on every 8-byte access); 8 more floats shift each row by 32 bytes, and the four rows of a half-warp cover
# all 32 banks
ACC_PAD = 8


@T.macro
def load_rows(src, dst, cs, n, head, col0, width):
    """Rows ``cs .. cs + n`` of ``src[:, head, col0:col0 + width]`` into ``dst`` [C, width] in its dtype; rows past
    ``n`` (a ragged tail chunk) are 0, so they add nothing to any product."""
    for i, j in T.Parallel(C, width):
        dst[i, j] = T.if_then_else(i < n, T.cast(src[cs + T.min(i, n - 1), head, col0 + j], dst.dtype),
                                   T.cast(0, dst.dtype))


@T.macro
def load_gates(gamma, g_sh, eg_sh, er_sh, cs, n, bh):
    """gamma of the chunk's rows (padded rows repeat the last valid one, so every padded gate is <= 1),
    ``eg = exp(gamma)`` and ``er = exp(gamma_C - gamma)``, read from HBM so no loop waits on another."""
    for i in T.Parallel(C):
        g_sh[i] = gamma[cs + T.min(i, n - 1), bh]
        eg_sh[i] = T.exp2(gamma[cs + T.min(i, n - 1), bh] * LOG2E)
        er_sh[i] = T.exp2((gamma[cs + n - 1, bh] - gamma[cs + T.min(i, n - 1), bh]) * LOG2E)


@T.macro
def store_rows(frag, dst, cs, n, head, col0, width):
    """The first ``n`` rows of ``frag`` [C, width] to ``dst[cs:cs + n, head, col0:col0 + width]``."""
    for i, j in T.Parallel(C, width):
        if i < n:
            dst[cs + i, head, col0 + j] = frag[i, j]


@T.macro
def l2norm_bwd_rows(dy_sh, out_f, red, x, r, cs, n, head, width):
    """The l2norm backward of a chunk's rows: ``out_f = r (dy - (y . dy) y)`` with y = r x recomputed from the raw
    rows ``x[cs:cs + n, head, :width]`` and their factors ``r`` (rows past ``n`` repeat the last). ``dy_sh`` [C, width]
    fp32 in shared memory is read at ``out_f``'s elements, each thread its own."""
    for i, j in T.Parallel(C, width):
        out_f[i, j] = dy_sh[i, j] * r[cs + T.min(i, n - 1), head] * T.cast(x[cs + T.min(i, n - 1), head, j], "float32")
    T.reduce_sum(out_f, red, dim=1, batch=2)  # each thread's 2 rows behind one pair of barriers
    for i, j in T.Parallel(C, width):
        out_f[i, j] = r[cs + T.min(i, n - 1), head] * (
            dy_sh[i, j] - red[i] * r[cs + T.min(i, n - 1), head] * T.cast(x[cs + T.min(i, n - 1), head, j], "float32"))


def build_l2norm_fwd(Hk: int, K: int, dtype: str):
    """The l2norm kernel: grid (chunks, Hk), 256 threads; ``y = x rsqrt(|x|^2 + eps)`` per row and the factor."""
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_bwd_l2norm_fwd(
        x: T.Tensor((num_tokens, Hk, K), dtype),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        y: T.Tensor((num_tokens, Hk, K), dtype),
        r: T.Tensor((num_tokens, Hk), "float32"),
    ):
        with T.Kernel(num_chunks, Hk, threads=THREADS) as (bc, hk):
            cs = chunks[bc, 0]
            n = chunks[bc, 1] - cs
            xf = T.alloc_fragment((C, K), "float32")
            sq = T.alloc_fragment((C, K), "float32")
            ss = T.alloc_fragment((C,), "float32")
            load_rows(x, xf, cs, n, hk, 0, K)
            for i, j in T.Parallel(C, K):
                sq[i, j] = xf[i, j] * xf[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(C):
                ss[i] = T.rsqrt(ss[i] + L2NORM_EPS)
            for i, j in T.Parallel(C, K):
                xf[i, j] = xf[i, j] * ss[i]
            store_rows(xf, y, cs, n, hk, 0, K)
            for i in T.Parallel(C):
                if i < n:
                    r[cs + i, hk] = ss[i]

    return gdn_bwd_l2norm_fwd


def build_gva_bwd(Hk: int, Hv: int, K: int, dtype: str, l2norm: bool, two_sources: bool, parts: str = "float32"):
    """The GVA reduction (and l2norm backward): grid (chunks, Hk), 256 threads. ``two_sources``: the per-value-head
    gradient is ``a + b`` (dk: the dqkwg and WY parts), else ``a``; ``l2norm``: apply the l2norm backward with the
    raw ``x`` and its factor ``r``; ``parts``: the dtype of ``a`` and ``b`` (summed in fp32 either way)."""
    group = Hv // Hk
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_b = T.dynamic("num_b")
    num_x = T.dynamic("num_x")

    @T.prim_func
    def gdn_bwd_gva(
        a: T.Tensor((num_tokens, Hv, K), parts),
        b: T.Tensor((num_b, Hv, K), parts),
        x: T.Tensor((num_x, Hk, K), dtype),
        r: T.Tensor((num_x, Hk), "float32"),
        chunks: T.Tensor((num_chunks, 2), "int32"),
        dx: T.Tensor((num_tokens, Hk, K), dtype),
    ):
        with T.Kernel(num_chunks, Hk, threads=THREADS) as (bc, hk):
            cs = chunks[bc, 0]
            n = chunks[bc, 1] - cs
            acc = T.alloc_fragment((C, K), "float32")
            T.clear(acc)
            # value heads in order: the sum is the same on every run
            for h in T.serial(group):
                for i, j in T.Parallel(C, K):
                    if two_sources:
                        acc[i, j] += (T.cast(a[cs + T.min(i, n - 1), hk * group + h, j], "float32")
                                      + T.cast(b[cs + T.min(i, n - 1), hk * group + h, j], "float32"))
                    else:
                        acc[i, j] += T.cast(a[cs + T.min(i, n - 1), hk * group + h, j], "float32")
            if l2norm:
                # y . dy with y = r x recomputed from the raw rows, then dx = r (dy - (y . dy) y)
                sq = T.alloc_fragment((C, K), "float32")
                ss = T.alloc_fragment((C,), "float32")
                for i, j in T.Parallel(C, K):
                    sq[i, j] = (acc[i, j] * r[cs + T.min(i, n - 1), hk]
                                * T.cast(x[cs + T.min(i, n - 1), hk, j], "float32"))
                T.reduce_sum(sq, ss, dim=1)
                for i, j in T.Parallel(C, K):
                    acc[i, j] = r[cs + T.min(i, n - 1), hk] * (
                        acc[i, j] - ss[i] * r[cs + T.min(i, n - 1), hk]
                        * T.cast(x[cs + T.min(i, n - 1), hk, j], "float32"))
            store_rows(acc, dx, cs, n, hk, 0, K)

    return gdn_bwd_gva


def l2norm_fwd(x: torch.Tensor, chunks: torch.Tensor):
    """Normalise the rows of ``x`` [T, Hk, K] (bf16/fp16) over K. Returns (y [T, Hk, K] in x's dtype, r [T, Hk] fp32);
    rows outside every chunk (a padded tail) are not written."""
    Tn, Hk, K = x.shape
    kernel = toolkit.compile_kernel(build_l2norm_fwd, Hk, K, toolkit.tl_dtype(x.dtype))
    y = toolkit.empty((Tn, Hk, K), x.dtype, x.device)
    r = toolkit.empty((Tn, Hk), torch.float32, x.device)
    kernel(x, chunks, y, r)
    return y, r


def gva_bwd(a: torch.Tensor, b: torch.Tensor | None, chunks: torch.Tensor, Hk: int, dtype: torch.dtype,
            x: torch.Tensor | None = None, r: torch.Tensor | None = None) -> torch.Tensor:
    """Sum per-value-head gradients over each key head's group, then the l2norm backward when ``x`` is given.

    Args:
        a, b: [T, Hv, K] per-value-head gradients, fp32 or (the fused walk's) in the output dtype (b may be None).
        chunks: [NC, 2] int32. Hk: key heads.
        dtype: the output dtype. x: [T, Hk, K] the raw (unnormalised) q or k, with r [T, Hk] fp32 its factor, or None.

    Returns:
        dx [T, Hk, K] in ``dtype``; rows outside every chunk are not written.
    """
    Tn, Hv, K = a.shape
    l2norm = x is not None
    parts = () if a.dtype == torch.float32 else (toolkit.tl_dtype(a.dtype),)
    kernel = toolkit.compile_kernel(build_gva_bwd, Hk, Hv, K, toolkit.tl_dtype(dtype), l2norm, b is not None, *parts)
    if b is None:
        b = toolkit.unread((1, Hv, K), a.dtype, a.device)
    if x is None:
        x, r = toolkit.unread((1, Hk, K), dtype, a.device), toolkit.unread((1, Hk), torch.float32, a.device)
    dx = toolkit.empty((Tn, Hk, K), dtype, a.device)
    kernel(a, b, x, r, chunks, dx)
    return dx
