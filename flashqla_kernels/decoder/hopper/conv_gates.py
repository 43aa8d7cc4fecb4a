"""Glue stage 1 on sm_90a: causal depthwise conv1d + SiLU + split + q/k l2norm + gates, token-major, one pass.

Reads the input projection's output x [B, T, C] (C = (2*Hk + Hv) * D, order [q | k | v]) exactly once, plus a
(Kc-1)-token halo per tile, and writes q, k [B, T, Hk, D] (l2-normalised) and v [B, T, Hv, D] as separate
contiguous tensors in the model dtype: the layout the chunk kernels read, so no transpose, no ``.contiguous()``
and no separate l2norm pass follow. The CTAs of value heads also turn the raw ``a``/``b`` projections into the
fp32 gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``.

Grid (ceil(T / BT), 2*Hk + Hv, B): one CTA per (token tile, head block of D channels, sequence). Math in fp32:
the conv accumulates in registers, SiLU and the row sum of squares for the l2norm (a row = one head) stay there.
Tokens before t = 0 come from ``prefix`` (the cache's conv state, token-major) or are zero. The same builder with
``tiles = N`` gives the pipelined kernel (grid ceil(T / (N BT)): each CTA walks N tiles, loading the next one while it
computes the current one), the launcher's default; see ``build_conv_qkv_gates``.
"""
import tilelang
import tilelang.language as T
import torch

from flashqla_kernels.toolkit import compile_kernel, empty, tl_dtype, unread

THREADS = 128
# The pipelined kernel is the default: on the H200 (benchmarks/glue_kernels.py) 4 tiles of 32 tokens
# a CTA took the 2B layer's stage from 0.376 ms (plain kernel, 16 tokens a CTA) to 0.282 ms, 68% of a copy's
# bandwidth; 8 or 16 tiles of 16 tokens 0.311 ms. False = the plain kernel everywhere.
PIPELINED = True
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus's default: x above it is returned as is
L2NORM_EPS = 1e-6


def _epilogue(T, Hk: int, D: int, BT: int, dtype: str):
    """The macro ``(y, sq, ss, t0, hb, bb, seqlen, q, k, v)`` both conv builders end with: SiLU of the conv sums
    ``y [BT, D]``, the l2norm of q/k rows, and the stores of the tile's tokens ``t0 ..`` into q, k or v."""

    @T.macro
    def epilogue(y, sq, ss, t0, hb, bb, seqlen, q, k, v):
        for i, d in T.Parallel(BT, D):
            y[i, d] = y[i, d] * T.sigmoid(y[i, d])
            sq[i, d] = y[i, d] * y[i, d]
        T.reduce_sum(sq, ss, dim=1)
        # q and k blocks are l2-normalised per head (one row of D channels); v blocks pass through
        for i in T.Parallel(BT):
            ss[i] = T.if_then_else(hb < 2 * Hk, T.rsqrt(ss[i] + L2NORM_EPS), 1.0)

        for i, d in T.Parallel(BT, D):
            if t0 + i < seqlen:
                if hb < Hk:
                    q[bb, t0 + i, hb, d] = T.cast(y[i, d] * ss[i], dtype)
                elif hb < 2 * Hk:
                    k[bb, t0 + i, hb - Hk, d] = T.cast(y[i, d] * ss[i], dtype)
                else:
                    v[bb, t0 + i, hb - 2 * Hk, d] = T.cast(y[i, d], dtype)

    return epilogue


def _gates(T, Hk: int, BT: int):
    """The macro ``(t0, hb, bb, seqlen, a, b, A_log, dt_bias, g, beta)``: the value-head CTAs turn the tile's raw
    ``a``/``b`` into ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``."""

    @T.macro
    def gates(t0, hb, bb, seqlen, a, b, A_log, dt_bias, g, beta):
        if hb >= 2 * Hk:
            for i in T.Parallel(BT):
                if t0 + i < seqlen:
                    g[bb, t0 + i, hb - 2 * Hk] = -T.exp(A_log[hb - 2 * Hk]) * T.if_then_else(
                        T.cast(a[bb, t0 + i, hb - 2 * Hk], "float32") + dt_bias[hb - 2 * Hk] > SOFTPLUS_THRESHOLD,
                        T.cast(a[bb, t0 + i, hb - 2 * Hk], "float32") + dt_bias[hb - 2 * Hk],
                        T.log1p(T.exp(T.cast(a[bb, t0 + i, hb - 2 * Hk], "float32") + dt_bias[hb - 2 * Hk])))
                    beta[bb, t0 + i, hb - 2 * Hk] = T.sigmoid(T.cast(b[bb, t0 + i, hb - 2 * Hk], "float32"))

    return gates


def _halo_and_taps(T, D: int, Kc: int, BT: int, dtype: str, has_prefix: bool, has_bias: bool):
    """Two macros both conv kernels use. ``halo(win, t0, bb, c0, x, prefix)``: rows 0 .. Kc-2 of ``win`` = the
    tokens ``t0 - (Kc-1) .. t0 - 1`` from x, from the conv state (before token 0) or zeros. ``taps(y, win, w_sh,
    bias, c0)``: ``y [BT, D]`` = bias + the causal conv of the tile whose rows sit at ``win[Kc-1 ..]``."""
    P = Kc - 1

    @T.macro
    def halo(win, t0, bb, c0, x, prefix):
        for i, d in T.Parallel(P, D):
            if has_prefix:
                win[i, d] = T.if_then_else(t0 > 0, x[bb, T.max(t0 + i - P, 0), c0 + d], prefix[bb, i, c0 + d])
            else:
                win[i, d] = T.if_then_else(t0 > 0, x[bb, T.max(t0 + i - P, 0), c0 + d], T.cast(0, dtype))

    @T.macro
    def taps(y, win, w_sh, bias, c0):
        for i, d in T.Parallel(BT, D):
            if has_bias:
                y[i, d] = T.cast(bias[c0 + d], "float32")
            else:
                y[i, d] = 0.0
        for j in T.unroll(Kc):
            for i, d in T.Parallel(BT, D):
                y[i, d] += w_sh[j, d] * T.cast(win[i + j, d], "float32")

    return halo, taps


def build_conv_qkv_gates(Hk: int, Hv: int, D: int, Kc: int, dtype: str, has_prefix: bool, has_bias: bool,
                         BT: int = 0, threads: int = THREADS, tiles: int = 0, stages: int = 2,
                         update_prefix: bool = False):
    """The conv + gates kernel for head dim D (= K = V) and conv width Kc >= 2.

    ``tiles = 0``: one CTA a tile of BT tokens, its rows and halo loaded, then computed and stored. ``tiles = N``:
    the pipelined kernel, each CTA walking N consecutive tiles with the next tile's rows loaded asynchronously
    (``T.Pipelined``, ``stages`` buffers) while the current one is computed; the plain kernel's load-then-compute
    leaves an SM few bytes in flight (52% of a copy's bandwidth on the H200). A tile's (Kc-1)-token halo is then the
    previous tile's last rows, kept in a shared window in front of the tile's rows; only a CTA's first tile reads its
    halo from x, the conv state or zeros (BT >= Kc - 1). Same contract and result either way, bit for bit (the GPU
    tests); ``conv_qkv_gates`` runs the pipelined kernel by default (``PIPELINED``, ``pipelined_shape``).

    ``update_prefix`` (the decode step: T = 1, the plain kernel, ``prefix`` given): the CTA also shifts its channels
    of ``prefix`` in place to the last Kc - 1 tokens including the new one, after its halo is in shared memory; each
    CTA owns its channels of its row, so no CTA reads what another writes.
    """
    # tokens per CTA: 16 for D <= 128 (77 registers, 6 CTAs an SM: 0.374 ms for the 2B layer on the H200, against
    # 0.408 ms for 64 tokens at 186 registers; benchmarks/glue_kernels.py); D = 256 keeps 32 to bound the halo re-read
    BT = BT or (16 if D <= 128 else 32)
    NB = 2 * Hk + Hv
    C = NB * D
    P = Kc - 1
    assert not tiles or BT >= P, f"tiles of {BT} tokens cannot hold the {P}-token halo"
    assert not update_prefix or (has_prefix and not tiles), "update_prefix needs the plain kernel and a prefix"
    span = BT * max(tiles, 1)
    batch = T.dynamic("batch")
    seqlen = T.dynamic("seqlen")
    num_prefix = T.dynamic("num_prefix")
    epilogue, gates = _epilogue(T, Hk, D, BT, dtype), _gates(T, Hk, BT)
    halo, taps = _halo_and_taps(T, D, Kc, BT, dtype, has_prefix, has_bias)

    @T.prim_func
    def gdn_conv_qkv_gates(
        x: T.Tensor((batch, seqlen, C), dtype),
        w: T.Tensor((C, Kc), dtype),
        bias: T.Tensor((C,), dtype),
        prefix: T.Tensor((num_prefix, P, C), dtype),
        a: T.Tensor((batch, seqlen, Hv), dtype),
        b: T.Tensor((batch, seqlen, Hv), dtype),
        A_log: T.Tensor((Hv,), T.float32),
        dt_bias: T.Tensor((Hv,), T.float32),
        q: T.Tensor((batch, seqlen, Hk, D), dtype),
        k: T.Tensor((batch, seqlen, Hk, D), dtype),
        v: T.Tensor((batch, seqlen, Hv, D), dtype),
        g: T.Tensor((batch, seqlen, Hv), T.float32),
        beta: T.Tensor((batch, seqlen, Hv), T.float32),
    ):
        with T.Kernel(T.ceildiv(seqlen, span), NB, batch, threads=threads) as (bt, hb, bb):
            t0 = bt * span
            c0 = hb * D
            if tiles:
                ld_sh = T.alloc_shared((BT, D), dtype)
            # the window: rows i <-> tokens t0 + i - P of the current tile (the plain kernel: the whole tile)
            x_sh = T.alloc_shared((BT + P, D), dtype)
            w_sh = T.alloc_shared((Kc, D), "float32")
            y = T.alloc_fragment((BT, D), "float32")
            sq = T.alloc_fragment((BT, D), "float32")
            ss = T.alloc_fragment((BT,), "float32")

            if not tiles:
                # the tile's own tokens (vectorised loads), then its halo
                for i, d in T.Parallel(BT, D):
                    x_sh[i + P, d] = T.if_then_else(t0 + i < seqlen, x[bb, T.min(t0 + i, seqlen - 1), c0 + d],
                                                   T.cast(0, dtype))
            halo(x_sh, t0, bb, c0, x, prefix)
            for j, d in T.Parallel(Kc, D):
                w_sh[j, d] = T.cast(w[c0 + d, j], "float32")
            if not tiles:
                T.sync_threads()
                if update_prefix:
                    # window rows 1 .. P are the tokens -P+1 .. 0: the conv state after this token
                    for i, d in T.Parallel(P, D):
                        prefix[bb, i, c0 + d] = x_sh[i + 1, d]
                taps(y, x_sh, w_sh, bias, c0)
                epilogue(y, sq, ss, t0, hb, bb, seqlen, q, k, v)
                gates(t0, hb, bb, seqlen, a, b, A_log, dt_bias, g, beta)
            else:
                for tj in T.Pipelined(tiles, num_stages=stages):
                    # the tile's own rows, asynchronously (rows past the sequence are never stored)
                    T.copy(x[bb, t0 + tj * BT:t0 + tj * BT + BT, c0:c0 + D], ld_sh)
                    for i, d in T.Parallel(BT, D):
                        x_sh[P + i, d] = ld_sh[i, d]
                    taps(y, x_sh, w_sh, bias, c0)
                    # the next tile's halo: this tile's last P rows (BT >= P: the two row ranges do not overlap)
                    for i, d in T.Parallel(P, D):
                        x_sh[i, d] = x_sh[BT + i, d]
                    epilogue(y, sq, ss, t0 + tj * BT, hb, bb, seqlen, q, k, v)
                    gates(t0 + tj * BT, hb, bb, seqlen, a, b, A_log, dt_bias, g, beta)

    return gdn_conv_qkv_gates


# The pipelined kernel runs on cp.async double buffering with predicated (zero-fill) loads at the sequence tail:
# TileLang's automatic warp specialisation (TMA producer warps) replicated its fragments across the consumer threads
# (128 fp32 values a thread where 16 belong). The plain kernel has no async copy, and its CUDA is the same either way.
build_conv_qkv_gates.pass_configs = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
                                     tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True}


def pipelined_shape(D: int) -> tuple[int, int]:
    """(BT, tiles) of the default pipelined kernel for head dim D: tokens a tile, tiles a CTA walks."""
    # D = 256 halves the tile to keep y / sq at 64 fp32 registers a thread each (128 threads)
    return (32, 4) if D <= 128 else (16, 4)


def conv_qkv_gates(qkv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                   b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, Hk: int, Hv: int, D: int,
                   prefix: torch.Tensor | None = None, tiles: int | None = None, BT: int | None = None,
                   update_prefix: bool = False):
    """Run the conv + gates stage.

    Args:
        qkv: [B, T, (2*Hk + Hv) * D] bf16/fp16. weight: [C, Kc]. bias: [C] or None. a, b: [B, T, Hv].
        A_log, dt_bias: [Hv]. prefix: [B, Kc-1, C] tokens before qkv, or None for zeros.
        tiles: token tiles a CTA walks with the pipelined kernel (``build_conv_qkv_gates(tiles=N)``); 0 runs the
            plain kernel; None: ``pipelined_shape(D)`` when ``PIPELINED``, else the plain kernel.
        BT: tokens a tile of the pipelined kernel; None: ``pipelined_shape(D)``'s.
        update_prefix: the decode step (T = 1): ``prefix`` (contiguous, qkv's dtype) becomes the conv state after
            this token, in place; runs the plain kernel.

    Returns:
        (q [B, T, Hk, D], k [B, T, Hk, D], v [B, T, Hv, D] in qkv's dtype, g [B, T, Hv] fp32, beta [B, T, Hv] fp32).
    """
    B, Tn, C = qkv.shape
    Kc = weight.shape[-1]
    dtype = qkv.dtype
    default_bt, default_tiles = pipelined_shape(D)
    if update_prefix:
        if Tn != 1 or prefix is None or not prefix.is_contiguous() or prefix.dtype != dtype:
            raise ValueError(f"update_prefix is the decode step: T must be 1 (got {Tn}) and prefix a contiguous "
                             f"{dtype} tensor (got {None if prefix is None else (prefix.dtype, prefix.stride())})")
        tiles = 0
    elif tiles is None:
        tiles = default_tiles if PIPELINED else 0
    extra = (BT or default_bt, THREADS, tiles) if tiles else ((0, THREADS, 0, 2, True) if update_prefix else ())
    kernel = compile_kernel(build_conv_qkv_gates, Hk, Hv, D, Kc, tl_dtype(dtype), prefix is not None, bias is not None,
                            *extra)
    x = qkv.contiguous()
    w = weight.to(dtype).contiguous()
    bias_t = bias.to(dtype).contiguous() if bias is not None else w.new_empty(C)
    pre = (prefix if update_prefix else prefix.to(dtype).contiguous()) if prefix is not None else \
        x.new_empty((1, Kc - 1, C))
    a_, b_ = a.to(dtype).contiguous(), b.to(dtype).contiguous()
    A32, dt32 = A_log.to(torch.float32).contiguous(), dt_bias.to(torch.float32).contiguous()
    q = empty((B, Tn, Hk, D), dtype, x.device)
    k = empty((B, Tn, Hk, D), dtype, x.device)
    v = empty((B, Tn, Hv, D), dtype, x.device)
    g = empty((B, Tn, Hv), torch.float32, x.device)
    beta = empty((B, Tn, Hv), torch.float32, x.device)
    if B * Tn > 0:
        kernel(x, w, bias_t, pre, a_, b_, A32, dt32, q, k, v, g, beta)
    return q, k, v, g, beta


# The backward's tile: BT tokens of du are formed, the first BT - (Kc - 1) of them own their dx row and their share
# of dw (dx of token t reads du of t .. t + Kc - 1); the last Kc - 1 rows are the next tile's, recomputed.


def bwd_tile(D: int) -> int:
    """Tokens a backward tile forms du for: 32, or 16 for D = 256 (its fp32 rows, 64 a thread, are twice as wide)."""
    return 32 if D <= 128 else 16


def build_conv_qkv_gates_bwd(Hk: int, Hv: int, D: int, Kc: int, dtype: str, has_bias: bool, BT: int = 0,
                             threads: int = THREADS):
    """The backward of the conv + SiLU + q/k l2norm part of ``build_conv_qkv_gates`` (no conv state: a fresh
    sequence), from the gradients of q, k and v:

        dy  = r * dout - y * r^3 * sum_d(dout * y)     q / k heads (r = rsqrt(sum_d y^2 + eps)); v heads: dy = dout
        du  = dy * silu'(u)                            u = bias + causal conv of x, y = silu(u), recomputed from x
        dx[t] = sum_j w[j] du[t + Kc - 1 - j]          (du past the sequence's end is 0)
        dw[j], dbias: per-CTA partial sums over the CTA's tokens, summed by the launcher (a fixed order: the same
                      bits every run)

    Grid (ceil(T / (BT - Kc + 1)), 2*Hk + Hv, B). Each CTA recomputes u for BT tokens from its window of BT + Kc - 1
    rows of x, forms du for all BT of them, and writes dx and the partial sums for its first BT - Kc + 1 tokens.
    """
    BT = BT or bwd_tile(D)
    NB = 2 * Hk + Hv
    C = NB * D
    P = Kc - 1
    span = BT - P
    assert span > 0, f"a backward tile of {BT} tokens cannot cover a {P}-token halo"
    batch = T.dynamic("batch")
    seqlen = T.dynamic("seqlen")
    tiles_t = T.dynamic("tiles_t")
    halo, taps = _halo_and_taps(T, D, Kc, BT, dtype, False, has_bias)

    @T.prim_func
    def gdn_conv_qkv_gates_bwd(
        x: T.Tensor((batch, seqlen, C), dtype),
        w: T.Tensor((C, Kc), dtype),
        bias: T.Tensor((C,), dtype),
        dq: T.Tensor((batch, seqlen, Hk, D), dtype),
        dk: T.Tensor((batch, seqlen, Hk, D), dtype),
        dv: T.Tensor((batch, seqlen, Hv, D), dtype),
        dx: T.Tensor((batch, seqlen, C), dtype),
        dw_part: T.Tensor((batch, tiles_t, Kc, C), T.float32),
        db_part: T.Tensor((batch, tiles_t, C), T.float32),
    ):
        with T.Kernel(tiles_t, NB, batch, threads=threads) as (bt, hb, bb):
            t0 = bt * span
            c0 = hb * D
            x_sh = T.alloc_shared((BT + P, D), dtype)
            w_sh = T.alloc_shared((Kc, D), "float32")
            du_sh = T.alloc_shared((BT + P, D), "float32")
            u = T.alloc_fragment((BT, D), "float32")
            go = T.alloc_fragment((BT, D), "float32")
            sq = T.alloc_fragment((BT, D), "float32")
            ss = T.alloc_fragment((BT,), "float32")
            dot = T.alloc_fragment((BT,), "float32")
            acc = T.alloc_fragment((BT, D), "float32")
            col = T.alloc_fragment((D,), "float32")

            for i, d in T.Parallel(BT, D):
                x_sh[i + P, d] = T.if_then_else(t0 + i < seqlen, x[bb, T.min(t0 + i, seqlen - 1), c0 + d],
                                               T.cast(0, dtype))
            halo(x_sh, t0, bb, c0, x, x)
            for j, d in T.Parallel(Kc, D):
                w_sh[j, d] = T.cast(w[c0 + d, j], "float32")
            # the gradient of this head's rows (0 past the sequence's end)
            for i, d in T.Parallel(BT, D):
                r = T.min(t0 + i, seqlen - 1)
                if hb < Hk:
                    go[i, d] = T.if_then_else(t0 + i < seqlen, T.cast(dq[bb, r, hb, d], "float32"), 0.0)
                elif hb < 2 * Hk:
                    go[i, d] = T.if_then_else(t0 + i < seqlen, T.cast(dk[bb, r, hb - Hk, d], "float32"), 0.0)
                else:
                    go[i, d] = T.if_then_else(t0 + i < seqlen, T.cast(dv[bb, r, hb - 2 * Hk, d], "float32"), 0.0)
            T.sync_threads()
            taps(u, x_sh, w_sh, bias, c0)
            # y = silu(u) in sq's place; the l2norm's row sums
            for i, d in T.Parallel(BT, D):
                sq[i, d] = u[i, d] * T.sigmoid(u[i, d])
                acc[i, d] = sq[i, d] * sq[i, d]
            T.reduce_sum(acc, ss, dim=1)
            for i, d in T.Parallel(BT, D):
                acc[i, d] = go[i, d] * sq[i, d]
            T.reduce_sum(acc, dot, dim=1)
            for i in T.Parallel(BT):
                ss[i] = T.if_then_else(hb < 2 * Hk, T.rsqrt(ss[i] + L2NORM_EPS), 1.0)
                dot[i] = T.if_then_else(hb < 2 * Hk, dot[i] * ss[i] * ss[i] * ss[i], 0.0)
            # du = dy * silu'(u), silu'(u) = s (1 + u (1 - s)); rows past the sequence hold 0 (go is 0 there)
            for i, d in T.Parallel(BT, D):
                du_sh[i, d] = (go[i, d] * ss[i] - sq[i, d] * dot[i]) * T.sigmoid(u[i, d]) * (
                    1.0 + u[i, d] * (1.0 - T.sigmoid(u[i, d])))
            for i, d in T.Parallel(P, D):
                du_sh[BT + i, d] = 0.0
            T.sync_threads()
            # dx of the tile's own tokens: dx[t0 + i] = sum_j w[j] du[i + P - j]
            for i, d in T.Parallel(BT, D):
                acc[i, d] = 0.0
            for j in T.unroll(Kc):
                for i, d in T.Parallel(BT, D):
                    acc[i, d] += w_sh[j, d] * du_sh[i + P - j, d]
            for i, d in T.Parallel(BT, D):
                if i < span and t0 + i < seqlen:
                    dx[bb, t0 + i, c0 + d] = T.cast(acc[i, d], dtype)
            # the partial sums over the tile's own tokens: dw[j] = sum_i du[i] x[t0 + i - P + j], dbias = sum_i du[i]
            for j in T.unroll(Kc):
                for i, d in T.Parallel(BT, D):
                    acc[i, d] = T.if_then_else(i < span, du_sh[i, d] * T.cast(x_sh[i + j, d], "float32"), 0.0)
                T.reduce_sum(acc, col, dim=0)
                for d in T.Parallel(D):
                    dw_part[bb, bt, j, c0 + d] = col[d]
            if has_bias:
                for i, d in T.Parallel(BT, D):
                    acc[i, d] = T.if_then_else(i < span, du_sh[i, d], 0.0)
                T.reduce_sum(acc, col, dim=0)
                for d in T.Parallel(D):
                    db_part[bb, bt, c0 + d] = col[d]

    return gdn_conv_qkv_gates_bwd


build_conv_qkv_gates_bwd.pass_configs = build_conv_qkv_gates.pass_configs


def conv_qkv_bwd(qkv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dq: torch.Tensor,
                 dk: torch.Tensor, dv: torch.Tensor, *, Hk: int, Hv: int, D: int):
    """Run the conv + SiLU + l2norm backward (no conv state).

    Args:
        qkv: [B, T, (2*Hk + Hv) * D] bf16/fp16, the forward's input. weight: [C, Kc] (rounded to qkv's dtype, as
            the forward reads it). bias: [C] or None. dq, dk: [B, T, Hk, D]; dv: [B, T, Hv, D] (any float dtype;
            read in qkv's).

    Returns:
        (dqkv [B, T, C] in qkv's dtype, dweight [C, Kc] fp32, dbias [C] fp32 or None).
    """
    B, Tn, C = qkv.shape
    Kc = weight.shape[-1]
    dtype = qkv.dtype
    kernel = compile_kernel(build_conv_qkv_gates_bwd, Hk, Hv, D, Kc, tl_dtype(dtype), bias is not None)
    span = bwd_tile(D) - (Kc - 1)
    tiles_t = -(-Tn // span)
    x = qkv.contiguous()
    w = weight.to(dtype).contiguous()
    bias_t = bias.to(dtype).contiguous() if bias is not None else w.new_empty(C)
    dx = empty((B, Tn, C), dtype, x.device)
    dw_part = empty((B, tiles_t, Kc, C), torch.float32, x.device)
    # without a bias the kernel never touches db_part; its shape still binds the kernel's batch and tiles_t
    db_part = (empty if bias is not None else unread)((B, tiles_t, C), torch.float32, x.device)
    if B * Tn == 0:
        return x.new_zeros(x.shape), w.new_zeros(w.shape, dtype=torch.float32), \
            (None if bias is None else bias_t.new_zeros(C, dtype=torch.float32))
    kernel(x, w, bias_t, dq.to(dtype).contiguous(), dk.to(dtype).contiguous(), dv.to(dtype).contiguous(), dx,
           dw_part, db_part)
    dw = dw_part.sum((0, 1)).t().contiguous()
    return dx, dw, (db_part.sum((0, 1)) if bias is not None else None)
