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
