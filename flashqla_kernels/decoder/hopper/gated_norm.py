"""Glue stage 2 on sm_90a: the gated RMSNorm after the chunk op, bf16/fp16 in and out, fp32 math.

    y = o * rsqrt(mean(o^2) + eps) * weight * silu(z)         per row of V channels (one value head of one token)

Reads o [rows, V] (the chunk op's output, rows = B*T*Hv) and z (``in_proj_z``'s output viewed as [rows, V]) once
and writes y once: transformers' version makes fp32 copies of o and z, a model-dtype copy of the normalised o and
two more products on the way. Grid ceil(rows / BR), one row per 16 threads.
"""
import tilelang.language as T
import torch

from flashqla_kernels.decoder.hopper._rows import load_rows_inverse_rms
from flashqla_kernels.toolkit import compile_kernel, empty_like, tl_dtype

# 16 rows of 128 threads: 0.111 ms for the 2B layer's [524288, 128] rows on the H200 (86% of a device copy's
# bandwidth), against 0.140 ms for 64 rows (benchmarks/glue_kernels.py)
BR = 16
THREADS = 128


def build_gated_rms_norm(V: int, dtype: str, eps: float, rows_per_cta: int = BR, threads: int = THREADS):
    """The gated RMSNorm kernel for rows of V channels; ``eps`` is baked in (the model's ``rms_norm_eps``);
    ``rows_per_cta`` / ``threads`` size the CTA."""
    rows = T.dynamic("rows")
    load = load_rows_inverse_rms(T, rows_per_cta, V, eps)

    @T.prim_func
    def gdn_gated_rms_norm(
        o: T.Tensor((rows, V), dtype),
        z: T.Tensor((rows, V), dtype),
        weight: T.Tensor((V,), dtype),
        y: T.Tensor((rows, V), dtype),
    ):
        with T.Kernel(T.ceildiv(rows, rows_per_cta), threads=threads) as br:
            r0 = br * rows_per_cta
            x = T.alloc_fragment((rows_per_cta, V), "float32")
            sq = T.alloc_fragment((rows_per_cta, V), "float32")
            ss = T.alloc_fragment((rows_per_cta,), "float32")
            load(o, r0, rows, x, sq, ss)
            for i, d in T.Parallel(rows_per_cta, V):
                if r0 + i < rows:
                    y[r0 + i, d] = T.cast(
                        x[i, d] * ss[i] * T.cast(weight[d], "float32")
                        * T.cast(z[r0 + i, d], "float32") * T.sigmoid(T.cast(z[r0 + i, d], "float32")), dtype)

    return gdn_gated_rms_norm


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Run the gated RMSNorm stage.

    Args:
        o: [..., V] bf16/fp16. z: same number of elements as o (e.g. [B, T, Hv*V]), same dtype. weight: [V].
        eps: float.

    Returns:
        y with o's shape and dtype.
    """
    V = o.shape[-1]
    dtype = o.dtype
    kernel = compile_kernel(build_gated_rms_norm, V, tl_dtype(dtype), float(eps))
    o2 = o.reshape(-1, V).contiguous()
    z2 = z.reshape(-1, V).to(dtype).contiguous()
    y = empty_like(o2)
    if o2.shape[0] > 0:
        kernel(o2, z2, weight.to(dtype).contiguous(), y)
    return y.view(o.shape)


# The backward's CTAs walk rows r0 = (step * CTAS + cta) * BR, each keeping its share of the weight's gradient in
# registers: the launcher sums CTAS partial rows (a fixed order: the same bits every run), not one per row.
BWD_CTAS = 528  # 4 an SM of an H100 / H200 (111 registers a thread, 128 threads)


def build_gated_rms_norm_bwd(V: int, dtype: str, eps: float, rows_per_cta: int = BR, threads: int = THREADS):
    """The backward of ``y = o r w silu(z)``, ``r = rsqrt(mean(o^2) + eps)``, per row of V channels:

        g = dy w silu(z);  do = r g - o r^3 mean(g o);  dz = dy o r w silu'(z);  dw = sum over rows of dy o r silu(z)

    (silu'(z) = s (1 + z (1 - s)), s = sigmoid(z); dw as per-CTA partial rows). Grid ``ctas`` (dynamic).
    """
    rows = T.dynamic("rows")
    ctas = T.dynamic("ctas")
    load = load_rows_inverse_rms(T, rows_per_cta, V, eps)
    inv_v = 1.0 / V

    @T.prim_func
    def gdn_gated_rms_norm_bwd(
        o: T.Tensor((rows, V), dtype),
        z: T.Tensor((rows, V), dtype),
        weight: T.Tensor((V,), dtype),
        dy: T.Tensor((rows, V), dtype),
        do: T.Tensor((rows, V), dtype),
        dz: T.Tensor((rows, V), dtype),
        dw_part: T.Tensor((ctas, V), T.float32),
    ):
        with T.Kernel(ctas, threads=threads) as cta:
            x = T.alloc_fragment((rows_per_cta, V), "float32")
            sq = T.alloc_fragment((rows_per_cta, V), "float32")
            ss = T.alloc_fragment((rows_per_cta,), "float32")
            gf = T.alloc_fragment((rows_per_cta, V), "float32")
            zf = T.alloc_fragment((rows_per_cta, V), "float32")
            dot = T.alloc_fragment((rows_per_cta,), "float32")
            wacc = T.alloc_fragment((rows_per_cta, V), "float32")
            col = T.alloc_fragment((V,), "float32")
            T.clear(wacc)
            for step in T.serial(T.ceildiv(rows, rows_per_cta * ctas)):
                r0 = (step * ctas + cta) * rows_per_cta
                load(o, r0, rows, x, sq, ss)
                for i, d in T.Parallel(rows_per_cta, V):
                    r = T.min(r0 + i, rows - 1)
                    gf[i, d] = T.if_then_else(r0 + i < rows, T.cast(dy[r, d], "float32"), 0.0)
                    zf[i, d] = T.cast(z[r, d], "float32")
                    # dz first, while gf is still dy: dy o r w silu'(z)
                    sq[i, d] = gf[i, d] * x[i, d] * ss[i] * T.cast(weight[d], "float32") * T.sigmoid(zf[i, d]) * (
                        1.0 + zf[i, d] * (1.0 - T.sigmoid(zf[i, d])))
                    wacc[i, d] += gf[i, d] * x[i, d] * ss[i] * zf[i, d] * T.sigmoid(zf[i, d])
                    gf[i, d] = gf[i, d] * T.cast(weight[d], "float32") * zf[i, d] * T.sigmoid(zf[i, d])
                for i, d in T.Parallel(rows_per_cta, V):
                    if r0 + i < rows:
                        dz[r0 + i, d] = T.cast(sq[i, d], dtype)
                for i, d in T.Parallel(rows_per_cta, V):
                    sq[i, d] = gf[i, d] * x[i, d]
                T.reduce_sum(sq, dot, dim=1)
                for i in T.Parallel(rows_per_cta):
                    dot[i] = dot[i] * ss[i] * ss[i] * ss[i] * inv_v
                for i, d in T.Parallel(rows_per_cta, V):
                    if r0 + i < rows:
                        do[r0 + i, d] = T.cast(gf[i, d] * ss[i] - x[i, d] * dot[i], dtype)
            T.reduce_sum(wacc, col, dim=0)
            for d in T.Parallel(V):
                dw_part[cta, d] = col[d]

    return gdn_gated_rms_norm_bwd


def gated_rms_norm_bwd(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor):
    """Run the gated RMSNorm's backward.

    Args:
        o: [..., V] bf16/fp16 (the norm's input). z: same number of elements (read in o's dtype). weight: [V] (read
            in o's dtype, as the forward reads it). eps: float. dy: the gradient of the output (o's shape).

    Returns:
        (do in o's shape and dtype, dz in z's shape and o's dtype, dweight [V] fp32).
    """
    V = o.shape[-1]
    dtype = o.dtype
    kernel = compile_kernel(build_gated_rms_norm_bwd, V, tl_dtype(dtype), float(eps))
    o2 = o.reshape(-1, V).contiguous()
    z2 = z.reshape(-1, V).to(dtype).contiguous()
    rows = o2.shape[0]
    ctas = max(1, min(BWD_CTAS, -(-rows // BR)))
    do, dz = empty_like(o2), empty_like(o2)
    dw_part = torch.empty((ctas, V), dtype=torch.float32, device=o.device)
    if rows == 0:
        return do.view(o.shape), dz.view(z.shape), torch.zeros(V, dtype=torch.float32, device=o.device)
    kernel(o2, z2, weight.to(dtype).contiguous(), dy.reshape(-1, V).to(dtype).contiguous(), do, dz, dw_part)
    return do.view(o.shape), dz.view(z.shape), dw_part.sum(0)
