"""The MLP's gate and up projections with the SwiGLU in the epilogue, one TileLang GEMM for sm_90a.

    out = silu(x @ Wg^T) * (x @ Wu^T),   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

x [M, K] and the nn.Linear weights Wg, Wu [N, K] are bf16/fp16; both products accumulate in fp32, the SwiGLU runs
in fp32 and out [M, N] is rounded once to x's dtype. The unfused path (two cuBLAS GEMMs, then ``silu_mul``) writes
both [M, N] pre-activations to HBM and reads them back; here they never leave the registers.

One CTA owns a BM x BN tile of out, so it computes the BM x BN tiles of g and of u: at the defaults an effective
128 x 256 GEMM tile, the shape of cuBLAS's fastest Hopper kernels. Each K step the producer warpgroup loads by TMA a
[BM, BK] tile of x and a [BN, BK] tile of each weight (two separate tensors, no concatenated copy; their tiles sit
side by side in one [2 BN, BK] shared buffer, so one mbarrier covers the three loads) into a ring of ``stages``
buffers. The consumer warpgroups (``threads`` / 128; TileLang's warp specialisation adds the producer's 128) each
own BM * 128 / threads rows and issue per K step the wgmmas of g (64 x BN x 16, no wait), then those of u, then one
wait: both products' wgmmas run back to back and the slot is released once. The epilogue applies the SwiGLU to the
two fp32 accumulators (2 x 64 registers a thread), stores the rounded tile to shared memory (stmatrix) and writes
it with a TMA store, which clips the rows past M (rows of x past M load as zeros); the store's issuing thread
waits for it only before the next tile's epilogue.

Tile order (L2 reuse): panels of ``panel`` BM-row blocks, each walked down its rows, then across the N tiles, so
the ~132 tiles in flight share a few x row blocks and weight column blocks. With ``ctas`` = 0 the grid holds one
CTA per tile (``T.use_swizzle``); with ``ctas`` > 0 (the SM count) the kernel is persistent: each CTA walks tiles
``cta, cta + ctas, ...`` (``T.Persistent``), the producer loads the next tile's first K steps while the consumers
run the epilogue, and the launch and pipeline fill are paid once per CTA instead of once per tile.

Shared memory at the defaults (BM = BN = 128, BK = 64, 4 stages, persistent): a 4 x 48 KiB ring + a 32 KiB output
tile = 224 KiB, one CTA an SM (the output tile shares the ring when the grid is not persistent). ptxas: 168
registers a thread, no spills.
"""
from dataclasses import dataclass

import tilelang.language as T
import torch
from tilelang import PassConfigKey

from flashqla_kernels.toolkit import compile_kernel, empty, tl_dtype

# A named barrier of the consumer warpgroups alone (0 is __syncthreads).
EPILOGUE_BARRIER = 1


@dataclass(frozen=True)
class SwigluGemmConfig:
    """Tile and schedule of the fused kernel: a BM x BN tile of out (BM x BN of g and of u) a CTA, BK-deep K
    steps through ``stages`` shared buffers, ``threads`` consumer threads (128 a warpgroup), ``panel`` BM-row blocks
    per rasterisation panel, persistent (one CTA an SM walking the tiles) or one CTA a tile."""

    BM: int = 128
    BN: int = 128
    BK: int = 64
    stages: int = 4
    threads: int = 256
    panel: int = 16
    persistent: bool = True


DEFAULT_CONFIG = SwigluGemmConfig()


def build_swiglu_gemm(N: int, K: int, dtype: str, BM: int = 128, BN: int = 128, BK: int = 64, stages: int = 4,
                      threads: int = 256, panel: int = 16, ctas: int = 0):
    """The prim_func ``swiglu_gemm(X [M, K], Wg [N, K], Wu [N, K], Out [M, N])``, M dynamic.

    N must be a multiple of BN and K of BK; ``ctas`` = 0 launches one CTA per tile, ``ctas`` > 0 that many
    persistent CTAs (the SM count). Each consumer thread holds 2 * BM * BN / threads fp32 accumulators.
    """
    assert N % BN == 0 and K % BK == 0, (N, BN, K, BK)
    assert threads % 128 == 0 and BM % (threads // 128 * 64) == 0, (BM, threads)
    # TileLang 0.1.15 lowers a TMA load into half of the [2 BN, BK] weight buffer only while a row fits one 128-byte
    # swizzle atom (with BK = 128 the half is not contiguous in the swizzled layout).
    assert BK <= 64, BK
    M = T.dynamic("M")
    accum = "float32"

    @T.macro
    def tile(X, Wg, Wu, Out, x_s, w_s, out_s, acc_g, acc_u, bx, by):
        T.clear(acc_g)
        T.clear(acc_u)
        for ko in T.Pipelined(K // BK, num_stages=stages):
            T.copy(X[by * BM, ko * BK], x_s)
            T.copy(Wg[bx * BN, ko * BK], w_s[0:BN, :])
            T.copy(Wu[bx * BN, ko * BK], w_s[BN:2 * BN, :])
            # FullRow: each consumer warpgroup owns whole rows, so each wgmma is 64 x BN (not 64 x BN / 2).
            # g's wgmmas are issued without a wait and u's wait for both, so one wait and one slot release a step.
            T.wgmma_gemm(x_s, w_s[0:BN, :], acc_g, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.gemm(x_s, w_s[BN:2 * BN, :], acc_u, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        for i, j in T.Parallel(BM, BN):
            acc_g[i, j] = acc_g[i, j] * acc_u[i, j] / (1.0 + T.exp(-acc_g[i, j]))
        # The consumers' own barrier (the producer never reaches it): before the stores to out_s, every warpgroup's
        # wgmmas are done (out_s may share the ring) and the last tile's TMA store has read out_s (its issuing
        # thread waits here, not right after issuing it, so its warpgroup starts the next tile at once); after
        # them, the tile is whole for the TMA store.
        T.tma_store_wait(0)
        T.sync_threads(EPILOGUE_BARRIER, threads)
        T.copy(acc_g, out_s)
        T.sync_threads(EPILOGUE_BARRIER, threads)
        T.tma_copy(out_s, Out[by * BM, bx * BN])

    if ctas:
        @T.prim_func
        def swiglu_gemm_persistent(X: T.Tensor((M, K), dtype), Wg: T.Tensor((N, K), dtype),
                                   Wu: T.Tensor((N, K), dtype), Out: T.Tensor((M, N), dtype)):
            with T.Kernel(ctas, threads=threads) as cta:
                x_s = T.alloc_shared((BM, BK), dtype)
                w_s = T.alloc_shared((2 * BN, BK), dtype)
                out_s = T.alloc_shared((BM, BN), dtype)
                acc_g = T.alloc_fragment((BM, BN), accum)
                acc_u = T.alloc_fragment((BM, BN), accum)
                for bx, by in T.Persistent([N // BN, T.ceildiv(M, BM)], ctas, cta, group_size=panel):
                    tile(X, Wg, Wu, Out, x_s, w_s, out_s, acc_g, acc_u, bx, by)
                # the last store reads out_s before the CTA's shared memory is released
                T.tma_store_wait(0)

        return swiglu_gemm_persistent

    @T.prim_func
    def swiglu_gemm(X: T.Tensor((M, K), dtype), Wg: T.Tensor((N, K), dtype), Wu: T.Tensor((N, K), dtype),
                    Out: T.Tensor((M, N), dtype)):
        with T.Kernel(N // BN, T.ceildiv(M, BM), threads=threads) as (bx, by):
            x_s = T.alloc_shared((BM, BK), dtype)
            w_s = T.alloc_shared((2 * BN, BK), dtype)
            out_s = T.alloc_shared((BM, BN), dtype)
            acc_g = T.alloc_fragment((BM, BN), accum)
            acc_u = T.alloc_fragment((BM, BN), accum)
            T.use_swizzle(panel)
            tile(X, Wg, Wu, Out, x_s, w_s, out_s, acc_g, acc_u, bx, by)
            T.tma_store_wait(0)

    return swiglu_gemm


# TileLang's ThreadSync pass cannot see that the mbarriers order the producer's TMA writes of the next tile after
# the consumers' wgmma reads of this one, and puts a __syncthreads at the top of each persistent tile: the producer
# would then wait for the epilogue instead of prefetching. The kernel places the syncs it needs (the consumers' two
# epilogue barriers) itself.
build_swiglu_gemm.pass_configs = {PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def builder_args(N: int, K: int, dtype: str, config: SwigluGemmConfig, sms: int) -> tuple:
    """``build_swiglu_gemm``'s arguments for ``config`` on a GPU of ``sms`` SMs (the compile-cache key)."""
    return (N, K, dtype, config.BM, config.BN, config.BK, config.stages, config.threads, config.panel,
            sms if config.persistent else 0)


def _check_inputs(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, config: SwigluGemmConfig) -> None:
    K, N = x.shape[-1], w_gate.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"swiglu_gemm takes bfloat16 or float16 activations, got x {x.dtype}")
    if w_gate.dtype != x.dtype or w_up.dtype != x.dtype:
        raise ValueError(f"swiglu_gemm needs the weights in x's dtype {x.dtype}; got w_gate {w_gate.dtype}, "
                         f"w_up {w_up.dtype} (cast them once at load time)")
    if w_gate.dim() != 2 or w_gate.shape[1] != K or w_up.shape != w_gate.shape:
        raise ValueError(f"swiglu_gemm needs w_gate and w_up both [N, K] with K = x.shape[-1] = {K}; got w_gate "
                         f"{tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}")
    if N % config.BN or K % config.BK:
        raise ValueError(f"swiglu_gemm tiles N by BN={config.BN} and K by BK={config.BK}; got N={N}, K={K} "
                         f"(use the torch path for these shapes)")
    if not (x.is_cuda and w_gate.device == x.device and w_up.device == x.device):
        raise ValueError(f"swiglu_gemm runs on one CUDA device; got x on {x.device}, w_gate on {w_gate.device}, "
                         f"w_up on {w_up.device}")


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t contiguous with a 16-byte aligned base (TMA's requirement), copied only if it is not already."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def swiglu_gemm(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, *,
                config: SwigluGemmConfig | None = None) -> torch.Tensor:
    """Run the fused ``silu(x @ w_gate^T) * (x @ w_up^T)``.

    Args:
        x: [..., K] bf16/fp16 on an sm_90 GPU (made contiguous if it is not).
        w_gate: [N, K] (``gate_proj.weight``), x's dtype and device; N a multiple of ``config.BN``, K of
            ``config.BK``. w_up: [N, K] (``up_proj.weight``), likewise.
        config: tile and schedule; None = ``DEFAULT_CONFIG``.

    Returns:
        out [..., N] in x's dtype (fp32 accumulation and SwiGLU, one rounding).

    Example:
        >>> out = swiglu_gemm(x, mlp.gate_proj.weight, mlp.up_proj.weight)  # then mlp.down_proj(out)
    """
    config = config or DEFAULT_CONFIG
    _check_inputs(x, w_gate, w_up, config)
    K, N = x.shape[-1], w_gate.shape[0]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    kernel = compile_kernel(build_swiglu_gemm, *builder_args(N, K, tl_dtype(x.dtype), config, sms))
    x2 = _tma_ready(x.reshape(-1, K))
    out = empty((x2.shape[0], N), x2.dtype, x2.device)
    if x2.shape[0] > 0:
        kernel(x2, _tma_ready(w_gate), _tma_ready(w_up), out)
    return out.view(*x.shape[:-1], N)


def swiglu_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in plain torch: ``silu(x @ w_gate^T) * (x @ w_up^T)`` in fp32 (float64 if the
    inputs are float64), not rounded back. Same Args as ``swiglu_gemm``, any device; returns [..., N]."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    return torch.nn.functional.silu(xf @ w_gate.to(dtype).T) * (xf @ w_up.to(dtype).T)
