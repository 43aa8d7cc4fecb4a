"""Glue around the layers on sm_90a: the MLP's gated activation, bf16/fp16 in and out, fp32 math, one pass.

    out = silu(gate) * up = gate * sigmoid(gate) * up          elementwise over [rows, D], rounded once

The dense MLP's ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` runs ``silu`` and the product as two elementwise
kernels (silu reads gate and writes silu(gate), the product reads that and up and writes: 5 passes over [rows, D])
against two reads and one write here. Memory-bound: every access moves 16 bytes (8 bf16/fp16 values, ``uint4``
loads and stores in the generated CUDA); ptxas gives a thread 32 registers (D = 6144, bf16), so 8 CTAs of 256
threads fit an SM, each thread with at least a 16-byte load of gate and one of up in flight (64 KB per SM).
Grid ceil(rows / BR) x D / BD, a tile of BR rows x BD channels per CTA (BD the largest of 1024 ... 64 dividing D,
BR * BD = TILE_ELEMS).
"""
import tilelang.language as T
import torch

from flashqla_kernels.toolkit import compile_kernel, empty_like, tl_dtype

THREADS = 256
TILE_ELEMS = 8192  # BR * BD per CTA: 4 accesses of 16 bytes per thread to each of gate, up and out
BLOCK_D = (1024, 512, 256, 128, 64)


def tile(D: int) -> tuple[int, int]:
    """(BR, BD): the rows and channels of one CTA's tile for rows of D channels (D a multiple of 64)."""
    BD = next(b for b in BLOCK_D if D % b == 0)
    return TILE_ELEMS // BD, BD


def build_silu_mul(D: int, dtype: str):
    """The fused ``silu(gate) * up`` kernel for rows of D channels (D a multiple of 64)."""
    BR, BD = tile(D)
    rows = T.dynamic("rows")

    @T.prim_func
    def mlp_silu_mul(
        gate: T.Tensor((rows, D), dtype),
        up: T.Tensor((rows, D), dtype),
        out: T.Tensor((rows, D), dtype),
    ):
        with T.Kernel(T.ceildiv(rows, BR), D // BD, threads=THREADS) as (br, bd):
            r0 = br * BR
            d0 = bd * BD
            # The row guard is uniform over a thread's 8 contiguous channels, so the accesses stay 16-byte vectors.
            for i, d in T.Parallel(BR, BD):
                if r0 + i < rows:
                    g = T.cast(gate[r0 + i, d0 + d], "float32")
                    out[r0 + i, d0 + d] = T.cast(g * T.sigmoid(g) * T.cast(up[r0 + i, d0 + d], "float32"), dtype)

    return mlp_silu_mul


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Run the fused gated activation ``silu(gate) * up``.

    Args:
        gate: [..., D] bf16/fp16, D a multiple of 64 (``gate_proj``'s output). up: same shape and dtype.

    Returns:
        out with gate's shape and dtype.
    """
    D = gate.shape[-1]
    kernel = compile_kernel(build_silu_mul, D, tl_dtype(gate.dtype))
    g2 = gate.reshape(-1, D).contiguous()
    u2 = up.reshape(-1, D).contiguous()
    out = empty_like(g2)
    if g2.shape[0] > 0:
        kernel(g2, u2, out)
    return out.view(gate.shape)


def build_silu_mul_bwd(D: int, dtype: str):
    """The backward of ``out = silu(gate) * up``: ``dgate = dout up silu'(gate)`` (silu'(g) = s (1 + g (1 - s)),
    s = sigmoid(g)) and ``dup = dout silu(gate)``, fp32 math, one read of each input and one write of each output;
    the forward's tiling."""
    BR, BD = tile(D)
    rows = T.dynamic("rows")

    @T.prim_func
    def mlp_silu_mul_bwd(
        gate: T.Tensor((rows, D), dtype),
        up: T.Tensor((rows, D), dtype),
        dout: T.Tensor((rows, D), dtype),
        dgate: T.Tensor((rows, D), dtype),
        dup: T.Tensor((rows, D), dtype),
    ):
        with T.Kernel(T.ceildiv(rows, BR), D // BD, threads=THREADS) as (br, bd):
            r0 = br * BR
            d0 = bd * BD
            for i, d in T.Parallel(BR, BD):
                if r0 + i < rows:
                    g = T.cast(gate[r0 + i, d0 + d], "float32")
                    s = T.sigmoid(g)
                    go = T.cast(dout[r0 + i, d0 + d], "float32")
                    dgate[r0 + i, d0 + d] = T.cast(go * T.cast(up[r0 + i, d0 + d], "float32") * s
                                                   * (1.0 + g * (1.0 - s)), dtype)
                    dup[r0 + i, d0 + d] = T.cast(go * g * s, dtype)

    return mlp_silu_mul_bwd


def silu_mul_bwd(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the backward of ``silu(gate) * up``.

    Args:
        gate, up: [..., D] bf16/fp16, D a multiple of 64, the forward's inputs. dout: the output's gradient (read
            in gate's dtype).

    Returns:
        (dgate, dup), each gate's shape and dtype.
    """
    D = gate.shape[-1]
    kernel = compile_kernel(build_silu_mul_bwd, D, tl_dtype(gate.dtype))
    g2 = gate.reshape(-1, D).contiguous()
    u2 = up.reshape(-1, D).contiguous()
    dgate, dup = empty_like(g2), empty_like(g2)
    if g2.shape[0] > 0:
        kernel(g2, u2, dout.reshape(-1, D).to(gate.dtype).contiguous(), dgate, dup)
    return dgate.view(gate.shape), dup.view(gate.shape)
