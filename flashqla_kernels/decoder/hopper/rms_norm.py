"""Glue around the layers on sm_90a: Qwen's zero-centred RMSNorm, bf16/fp16/fp32 in and out, fp32 math, one pass.

    y = x * rsqrt(mean(x^2) + eps) * (1 + weight)          per row of D channels

fp32 rows may also write y in bf16 / fp16 (``ydtype``): under autocast with fp32 weights the residual stream stays
fp32 while every projection the norm feeds casts its input to autocast's dtype, each on its own; one rounding here
replaces those casts (and the backward reads dy in that dtype).

The decoder's input / post-attention norms, the final norm and the attention layers' q/k norms. ``add_rms_norm`` is
the decoder's mid-layer step in one pass: ``s = residual + mixer_out`` (rounded as the framework's add rounds it)
and ``y = rms_norm(s)``, both written; against an add kernel then this norm it saves one read of ``s``. transformers'
version writes an fp32 copy of x, its square, the normalised fp32 rows and their product with (1 + w) before the
cast back: ~8 passes over an fp32 tensor against one read and one write here. Grid ceil(rows / BR).
"""
import tilelang.language as T
import torch

from flashqla_kernels.decoder.hopper._rows import load_rows_inverse_rms, load_sum_rows_inverse_rms
from flashqla_kernels.toolkit import compile_kernel, empty, empty_like, tl_dtype

# BR * D = 2048 per CTA of 128 threads (one 2048-wide row, 16 values a thread): 0.073 ms a [32768, 2048] bf16 norm
# on the H200, 88% of a device copy's bandwidth, against 0.111 ms for 8192 / 256 (benchmarks/glue_kernels.py)
THREADS = 128
TILE_ELEMS = 2048


def rows_per_cta(D: int, tile_elems: int = TILE_ELEMS) -> int:
    return max(1, tile_elems // D)


def build_rms_norm(D: int, dtype: str, eps: float, wdtype: str = "float32", tile_elems: int = TILE_ELEMS,
                   threads: int = THREADS, ydtype: str | None = None):
    """The zero-centred RMSNorm kernel for rows of D channels (D a multiple of 64); eps baked in. The weight is read
    in its own dtype ``wdtype`` (no cast kernel before each call); ``tile_elems`` / ``threads`` size the CTA;
    ``ydtype``: y's dtype where it differs from the rows' (fp32 rows written in autocast's bf16 / fp16)."""
    ydtype = ydtype or dtype
    BR = rows_per_cta(D, tile_elems)
    rows = T.dynamic("rows")
    load = load_rows_inverse_rms(T, BR, D, eps)

    @T.prim_func
    def qwen_rms_norm(
        x: T.Tensor((rows, D), dtype),
        weight: T.Tensor((D,), wdtype),
        y: T.Tensor((rows, D), ydtype),
    ):
        with T.Kernel(T.ceildiv(rows, BR), threads=threads) as br:
            r0 = br * BR
            xf = T.alloc_fragment((BR, D), "float32")
            sq = T.alloc_fragment((BR, D), "float32")
            ss = T.alloc_fragment((BR,), "float32")
            load(x, r0, rows, xf, sq, ss)
            for i, d in T.Parallel(BR, D):
                if r0 + i < rows:
                    y[r0 + i, d] = T.cast(xf[i, d] * ss[i] * (1.0 + T.cast(weight[d], "float32")), ydtype)

    return qwen_rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Run the zero-centred RMSNorm.

    Args:
        x: [..., D] bf16/fp16/fp32. weight: [D] (fp32/bf16/fp16 read as is, other float dtypes cast; math in fp32).
            eps: float. out_dtype: y's dtype (None: x's; bf16/fp16 for fp32 x, rounded once from the fp32 math).

    Returns:
        y with x's shape, in ``out_dtype``.
    """
    D = x.shape[-1]
    w = weight if weight.dtype in (torch.float32, torch.bfloat16, torch.float16) else weight.float()
    wdtype = tl_dtype(w.dtype)
    out_dtype = out_dtype or x.dtype
    # a float32 weight and y in x's dtype keep the kernel's original compile-cache keys
    extra = () if wdtype == "float32" else (wdtype,)
    if out_dtype != x.dtype:
        extra = (wdtype, TILE_ELEMS, THREADS, tl_dtype(out_dtype))
    kernel = compile_kernel(build_rms_norm, D, tl_dtype(x.dtype), float(eps), *extra)
    x2 = x.reshape(-1, D).contiguous()
    y = empty_like(x2, out_dtype)
    if x2.shape[0] > 0:
        kernel(x2, w.contiguous(), y)
    return y.view(x.shape)


def build_add_rms_norm(D: int, dtype: str, eps: float, wdtype: str = "float32", tile_elems: int = TILE_ELEMS,
                       threads: int = THREADS, bdtype: str = "", ydtype: str | None = None):
    """The residual add + zero-centred RMSNorm kernel for rows of D channels: writes ``s = a + b`` (rounded to
    ``dtype``) and ``y = rms_norm(s)``, y equal bit for bit to ``build_rms_norm``'s output for the rounded s.
    ``bdtype``: b's dtype where it differs from a's (an fp32 residual stream, as fp32 weights under bf16 autocast
    keep it, plus a bf16 mixer output: the sum in fp32, as torch's promoting add computes it). ``ydtype``: y's
    dtype where it differs from a's (as ``build_rms_norm``'s); s stays in a's dtype, the residual stream's."""
    bdtype = bdtype or dtype
    ydtype = ydtype or dtype
    BR = rows_per_cta(D, tile_elems)
    rows = T.dynamic("rows")
    load = load_sum_rows_inverse_rms(T, BR, D, eps, dtype)

    @T.prim_func
    def qwen_add_rms_norm(
        a: T.Tensor((rows, D), dtype),
        b: T.Tensor((rows, D), bdtype),
        weight: T.Tensor((D,), wdtype),
        s: T.Tensor((rows, D), dtype),
        y: T.Tensor((rows, D), ydtype),
    ):
        with T.Kernel(T.ceildiv(rows, BR), threads=threads) as br:
            r0 = br * BR
            xf = T.alloc_fragment((BR, D), "float32")
            sq = T.alloc_fragment((BR, D), "float32")
            ss = T.alloc_fragment((BR,), "float32")
            load(a, b, r0, rows, xf, sq, ss)
            for i, d in T.Parallel(BR, D):
                if r0 + i < rows:
                    s[r0 + i, d] = T.cast(xf[i, d], dtype)
                    y[r0 + i, d] = T.cast(xf[i, d] * ss[i] * (1.0 + T.cast(weight[d], "float32")), ydtype)

    return qwen_add_rms_norm


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out_dtype: torch.dtype | None = None):
    """Run the residual add + zero-centred RMSNorm.

    Args:
        a, b: [..., D], same shape: a bf16/fp16 and b alike, or a fp32 (the residual stream under autocast) and b
            bf16/fp16/fp32. weight: [D] (read as ``rms_norm`` reads it). eps: float. out_dtype: y's dtype (None:
            a's; bf16/fp16 for fp32 a).

    Returns:
        (s, y): ``s = a + b`` with a's shape and dtype and ``y = rms_norm(s)`` with a's shape, in ``out_dtype``.
    """
    D = a.shape[-1]
    w = weight if weight.dtype in (torch.float32, torch.bfloat16, torch.float16) else weight.float()
    out_dtype = out_dtype or a.dtype
    # b and y in a's dtype keep the kernel's original compile-cache key
    extra = () if b.dtype == a.dtype else (TILE_ELEMS, THREADS, tl_dtype(b.dtype))
    if out_dtype != a.dtype:
        extra = (TILE_ELEMS, THREADS, tl_dtype(b.dtype), tl_dtype(out_dtype))
    kernel = compile_kernel(build_add_rms_norm, D, tl_dtype(a.dtype), float(eps), tl_dtype(w.dtype), *extra)
    a2, b2 = a.reshape(-1, D).contiguous(), b.reshape(-1, D).contiguous()
    s, y = empty_like(a2), empty_like(a2, out_dtype)
    if a2.shape[0] > 0:
        kernel(a2, b2, w.contiguous(), s, y)
    return s.view(a.shape), y.view(a.shape)


# The backward's CTAs: each walks rows r0 = (step * CTAS + cta) * BR and keeps its share of the weight's gradient in
# registers, so the launcher sums CTAS partial rows (a fixed order: the same bits every run), not one per row.
BWD_CTAS = 792  # 6 an SM of an H100 / H200 (80 registers a thread, 128 threads)


def build_rms_norm_bwd(D: int, dtype: str, eps: float, wdtype: str = "float32", with_residual: bool = False,
                       tile_elems: int = TILE_ELEMS, threads: int = THREADS, dydtype: str | None = None):
    """The backward of the zero-centred RMSNorm ``y = x r (1 + w)``, ``r = rsqrt(mean(x^2) + eps)``:

        dx = r g - x r^3 mean(g x),  g = dy (1 + w);   dw = sum over rows of dy x r (per-CTA partials)

    ``with_residual``: the decoder's mid-layer sum ``s``, which the residual path also reads, so its gradient
    ``ds`` (the residual path's) is added: dx = ds + the norm's part (the backward of ``add_rms_norm``).
    ``dydtype``: dy's dtype where it differs from x's (the gradient of a y written in autocast's dtype from fp32
    rows), read as is and widened to fp32 in registers. Grid ``ctas`` (dynamic); each CTA walks its rows and
    writes one partial row of dw.
    """
    dydtype = dydtype or dtype
    BR = rows_per_cta(D, tile_elems)
    rows = T.dynamic("rows")
    ctas = T.dynamic("ctas")
    load = load_rows_inverse_rms(T, BR, D, eps)
    inv_d = 1.0 / D

    @T.prim_func
    def qwen_rms_norm_bwd(
        x: T.Tensor((rows, D), dtype),
        weight: T.Tensor((D,), wdtype),
        dy: T.Tensor((rows, D), dydtype),
        ds: T.Tensor((rows, D), dtype),
        dx: T.Tensor((rows, D), dtype),
        dw_part: T.Tensor((ctas, D), T.float32),
    ):
        with T.Kernel(ctas, threads=threads) as cta:
            xf = T.alloc_fragment((BR, D), "float32")
            sq = T.alloc_fragment((BR, D), "float32")
            ss = T.alloc_fragment((BR,), "float32")
            gf = T.alloc_fragment((BR, D), "float32")
            dot = T.alloc_fragment((BR,), "float32")
            wacc = T.alloc_fragment((BR, D), "float32")
            col = T.alloc_fragment((D,), "float32")
            T.clear(wacc)
            for step in T.serial(T.ceildiv(rows, BR * ctas)):
                r0 = (step * ctas + cta) * BR
                load(x, r0, rows, xf, sq, ss)
                for i, d in T.Parallel(BR, D):
                    gf[i, d] = T.if_then_else(r0 + i < rows, T.cast(dy[T.min(r0 + i, rows - 1), d], "float32"), 0.0)
                    wacc[i, d] += gf[i, d] * xf[i, d] * ss[i]
                    gf[i, d] = gf[i, d] * (1.0 + T.cast(weight[d], "float32"))
                    sq[i, d] = gf[i, d] * xf[i, d]
                T.reduce_sum(sq, dot, dim=1)
                for i in T.Parallel(BR):
                    dot[i] = dot[i] * ss[i] * ss[i] * ss[i] * inv_d
                for i, d in T.Parallel(BR, D):
                    if r0 + i < rows:
                        if with_residual:
                            dx[r0 + i, d] = T.cast(gf[i, d] * ss[i] - xf[i, d] * dot[i]
                                                   + T.cast(ds[r0 + i, d], "float32"), dtype)
                        else:
                            dx[r0 + i, d] = T.cast(gf[i, d] * ss[i] - xf[i, d] * dot[i], dtype)
            T.reduce_sum(wacc, col, dim=0)
            for d in T.Parallel(D):
                dw_part[cta, d] = col[d]

    return qwen_rms_norm_bwd


def rms_norm_bwd(x: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor,
                 ds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the zero-centred RMSNorm's backward.

    Args:
        x: [..., D] bf16/fp16/fp32, the norm's input. weight: [D] (read as ``rms_norm`` reads it). eps: float.
        dy: the gradient of the norm's output (x's shape; read in x's dtype, or in its own bf16 / fp16 for fp32 x:
            the gradient of ``rms_norm(..., out_dtype=)``). ds: None, or the gradient x also receives from elsewhere
            (the residual path of ``add_rms_norm``'s sum), added to dx.

    Returns:
        (dx in x's shape and dtype, dweight [D] fp32).
    """
    D = x.shape[-1]
    w = weight if weight.dtype in (torch.float32, torch.bfloat16, torch.float16) else weight.float()
    dy_dtype = dy.dtype if x.dtype == torch.float32 and dy.dtype in (torch.bfloat16, torch.float16) else x.dtype
    # dy in x's dtype keeps the kernel's original compile-cache key
    extra = () if dy_dtype == x.dtype else (TILE_ELEMS, THREADS, tl_dtype(dy_dtype))
    kernel = compile_kernel(build_rms_norm_bwd, D, tl_dtype(x.dtype), float(eps), tl_dtype(w.dtype), ds is not None,
                            *extra)
    x2 = x.reshape(-1, D).contiguous()
    rows = x2.shape[0]
    dy2 = dy.reshape(-1, D).to(dy_dtype).contiguous()
    # without ds the kernel never reads that argument: x stands in (its dtype and shape)
    ds2 = ds.reshape(-1, D).to(x.dtype).contiguous() if ds is not None else x2
    ctas = max(1, min(BWD_CTAS, -(-rows // rows_per_cta(D))))
    dx = empty_like(x2)
    dw_part = torch.empty((ctas, D), dtype=torch.float32, device=x.device)
    if rows == 0:
        return dx.view(x.shape), torch.zeros(D, dtype=torch.float32, device=x.device)
    kernel(x2, w.contiguous(), dy2, ds2, dx, dw_part)
    return dx.view(x.shape), dw_part.sum(0)
