"""TileLang kernel for sm_90a: TopK-SAE pre-activations with ReLU and a per-tile top-c selection in the epilogue.

One CTA computes a ``[BLOCK_M tokens, BLOCK_N features]`` tile of ``x @ W_enc^T + b_enc`` with wgmma (fp32 accumulators,
bf16/fp16 operands) and never writes it to memory. Its epilogue turns each accumulator into a *key* and writes only the
``c`` largest keys of every (token, tile) row to ``cand [N, d_sae / BLOCK_N, c]`` (int32):

- a key is the int32 bit pattern of ``max(v, +0.0)`` with its 8 low mantissa bits replaced by ``255 - j`` (``j`` = the
  column in the tile): positive floats order like their bit patterns, so keys order like ``ReLU(v)`` (to 2^-15
  relative), every key is unique within its tile, ``key >> 8 == 0`` means ``ReLU(v) == 0``, and the low byte gives back
  the column;
- ``c`` rounds of (row max, then subtract it from every key mod 2^32) extract the tile's top-c in descending order: after
  the subtraction the extracted keys are small and the rest wrap to ``>= 2^31``, so the next unsigned max is the next
  key down — two integer operations per element per round, no masks.
``merge_candidates`` (plain torch) turns ``cand`` into the exact top-k: the global top-k lies in the union of per-tile
top-k's, and a row whose top-k could need a (c+1)-th element of some tile is flagged (its c-th key beats the k-th
selected key) and recomputed by the caller. Importing this module does not import tilelang.
"""

import functools
import math

import torch

BLOCK_M, BLOCK_N, THREADS = 128, 256, 256
# (BLOCK_K, pipeline stages): the mainloop knobs; 64 x 3 stages = 144 KiB of shared memory.
DEFAULT_CONFIG = (64, 3)
BLOCK_K = DEFAULT_CONFIG[0]
TARGET = {"kind": "cuda", "arch": "sm_90a"}
_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The column of a positive key sits in its 8 low mantissa bits.
_LOW_BITS = 8
assert BLOCK_N <= 1 << _LOW_BITS


def candidates_per_tile(k: int, d_sae: int, flag_rate: float = 1e-3) -> int:
    """Candidates kept per (token, tile): the smallest ``c`` whose expected rate of flagged rows is below ``flag_rate``.

    Models the number of a token's top-k features that land in one tile as Poisson(k * BLOCK_N / d_sae) — right for
    features in random order; structured rows are flagged and recomputed, so this only sets the speed, never the result.
    """
    n_tiles = d_sae // BLOCK_N
    lam = k / n_tiles
    for c in range(2, BLOCK_N + 1):
        tail = 1.0 - sum(math.exp(-lam) * lam**i / math.factorial(i) for i in range(c))
        if n_tiles * tail <= flag_rate and n_tiles * c >= k:
            return c
    return BLOCK_N


def _select_top_c(T, block_m: int, c: int, n_tok):
    """The epilogue shared by both kernels: the top-c keys of each row of ``keys [block_m, BLOCK_N]`` into ``Cand``."""

    @T.macro
    def select(keys, step, last, Cand, bx, by):
        T.fill(last, 0)
        for r in T.serial(c):
            # keys hold (key - last extracted key) mod 2^32: extracted ones are small, the rest >= 2^31, so the
            # unsigned max is the next key down. One max and one subtract per element per round.
            T.reduce_max(keys, step, dim=1)
            for i in T.Parallel(block_m):
                last[i] = last[i] + step[i]
                if by * block_m + i < n_tok:
                    Cand[by * block_m + i, bx, r] = T.reinterpret(last[i], "int32")
            if r < c - 1:
                for i, j in T.Parallel(block_m, BLOCK_N):
                    keys[i, j] = keys[i, j] - step[i]

    return select


def build_topk_candidates(d_model: int, d_sae: int, c: int, dtype: str = "bfloat16",
                          config: tuple[int, int] = DEFAULT_CONFIG):
    """The fused prim_func ``sae_topk_candidates(X [N, d_model], W_enc [d_sae, d_model], b_enc fp32 [d_sae], cand int32 [N, NT, c])``.

    N (tokens) is dynamic; d_model must be a multiple of BLOCK_K and d_sae of BLOCK_N. ``config`` = (block_K, stages).
    """
    import tilelang.language as T

    block_k, num_stages = config
    n_tiles = d_sae // BLOCK_N
    n_tok = T.dynamic("N")
    keep_mask = -(1 << _LOW_BITS)
    select = _select_top_c(T, BLOCK_M, c, n_tok)

    @T.prim_func
    def sae_topk_candidates(X: T.Tensor((n_tok, d_model), dtype), W: T.Tensor((d_sae, d_model), dtype),
               Bias: T.Tensor((d_sae,), "float32"), Cand: T.Tensor((n_tok, n_tiles, c), "int32")):
        with T.Kernel(n_tiles, T.ceildiv(n_tok, BLOCK_M), threads=THREADS) as (bx, by):
            x_s = T.alloc_shared((BLOCK_M, block_k), dtype)
            w_s = T.alloc_shared((BLOCK_N, block_k), dtype)
            acc = T.alloc_fragment((BLOCK_M, BLOCK_N), "float32")
            # acc is dead once the keys exist, so nvcc gives keys the same registers.
            keys = T.alloc_fragment((BLOCK_M, BLOCK_N), "uint32")
            step = T.alloc_fragment((BLOCK_M,), "uint32")
            last = T.alloc_fragment((BLOCK_M,), "uint32")
            T.use_swizzle(10)
            T.clear(acc)
            for ko in T.Pipelined(T.ceildiv(d_model, block_k), num_stages=num_stages):
                T.copy(X[by * BLOCK_M, ko * block_k], x_s)
                T.copy(W[bx * BLOCK_N, ko * block_k], w_s)
                # FullRow: every warp holds whole tile rows, so the row reductions below stay inside a warp.
                T.gemm(x_s, w_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                bits = T.max(T.reinterpret(acc[i, j] + Bias[bx * BLOCK_N + j], "int32"), 0)
                keys[i, j] = T.cast(T.bitwise_or(T.bitwise_and(bits, keep_mask), BLOCK_N - 1 - j), "uint32")
            select(keys, step, last, Cand, bx, by)

    return sae_topk_candidates


SPLIT_BLOCK_M, SPLIT_THREADS = 64, 256


def build_topk_candidates_from_preacts(d_sae: int, c: int, dtype: str = "bfloat16"):
    """The unfused prim_func ``sae_topk_epilogue(Pre [N, d_sae], cand int32 [N, NT, c])``: the same epilogue on pre-activations
    already in memory (``addmm`` output, bias included). Same keys up to the rounding of ``Pre``."""
    import tilelang.language as T

    n_tiles = d_sae // BLOCK_N
    n_tok = T.dynamic("N")
    keep_mask = -(1 << _LOW_BITS)
    select = _select_top_c(T, SPLIT_BLOCK_M, c, n_tok)

    @T.prim_func
    def sae_topk_epilogue(Pre: T.Tensor((n_tok, d_sae), dtype), Cand: T.Tensor((n_tok, n_tiles, c), "int32")):
        with T.Kernel(n_tiles, T.ceildiv(n_tok, SPLIT_BLOCK_M), threads=SPLIT_THREADS) as (bx, by):
            tile = T.alloc_fragment((SPLIT_BLOCK_M, BLOCK_N), dtype)
            keys = T.alloc_fragment((SPLIT_BLOCK_M, BLOCK_N), "uint32")
            step = T.alloc_fragment((SPLIT_BLOCK_M,), "uint32")
            last = T.alloc_fragment((SPLIT_BLOCK_M,), "uint32")
            T.copy(Pre[by * SPLIT_BLOCK_M, bx * BLOCK_N], tile)
            for i, j in T.Parallel(SPLIT_BLOCK_M, BLOCK_N):
                bits = T.max(T.reinterpret(T.cast(tile[i, j], "float32"), "int32"), 0)
                keys[i, j] = T.cast(T.bitwise_or(T.bitwise_and(bits, keep_mask), BLOCK_N - 1 - j), "uint32")
            select(keys, step, last, Cand, bx, by)

    return sae_topk_epilogue


@functools.lru_cache(maxsize=None)
def compile_topk_candidates_from_preacts(d_sae: int, c: int, dtype: str = "bfloat16"):
    """Compile the unfused candidate kernel for sm_90a (cached like ``compile_topk_candidates``)."""
    import tilelang

    return tilelang.compile(build_topk_candidates_from_preacts(d_sae, c, dtype), target=TARGET)


def topk_candidates_from_preacts(pre: torch.Tensor, c: int) -> torch.Tensor:
    """Launch the unfused kernel on ``pre [N, d_sae]`` (bf16/fp16, bias included); returns ``cand [N, NT, c]`` int32."""
    n, d_sae = pre.shape
    kernel = compile_topk_candidates_from_preacts(d_sae, c, _TL_DTYPES[pre.dtype])
    cand = torch.empty(n, d_sae // BLOCK_N, c, device=pre.device, dtype=torch.int32)
    if n:
        kernel(pre, cand)
    return cand


@functools.lru_cache(maxsize=None)
def compile_topk_candidates(d_model: int, d_sae: int, c: int, dtype: str = "bfloat16",
                            config: tuple[int, int] = DEFAULT_CONFIG):
    """Compile (JIT, cached on disk by tilelang) the candidate kernel for sm_90a; works without a GPU."""
    import tilelang

    return tilelang.compile(build_topk_candidates(d_model, d_sae, c, dtype, config), target=TARGET)


def precompile(variants: list[tuple], workers: int = 8) -> None:
    """Compile many ``compile_topk_candidates(*variant)`` in parallel processes, filling tilelang's disk cache.

    Each variant is ``(d_model, d_sae, c[, dtype[, config]])`` for the fused kernel or ``("preacts", d_sae, c[, dtype])``
    for the unfused one; later compiles of the same variant load from the cache.
    """
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for future in [pool.submit(_compile_source, tuple(v)) for v in variants]:
            future.result()


def _compile_source(variant: tuple) -> int:
    if variant[0] == "preacts":
        return len(compile_topk_candidates_from_preacts(*variant[1:]).get_kernel_source())
    return len(compile_topk_candidates(*variant).get_kernel_source())


def topk_candidates(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, c: int,
                    config: tuple[int, int] | None = None) -> torch.Tensor:
    """Launch the kernel: per-(token, tile) top-c keys of ``ReLU(x @ W_enc^T + b_enc)``.

    Args:
        x: ``[N, d_model]`` bf16/fp16, contiguous, on an sm_90 GPU.
        W_enc: ``[d_sae, d_model]``, same dtype and device.
        b_enc: ``[d_sae]`` fp32.
        c: candidates per (token, tile).
        config: (block_K, pipeline stages) of the mainloop; None = ``DEFAULT_CONFIG`` (read at call time).
    Returns:
        ``cand [N, d_sae // BLOCK_N, c]`` int32 keys, descending along the last dim.
    """
    n, d_model = x.shape
    d_sae = W_enc.shape[0]
    kernel = compile_topk_candidates(d_model, d_sae, c, _TL_DTYPES[x.dtype], tuple(config or DEFAULT_CONFIG))
    cand = torch.empty(n, d_sae // BLOCK_N, c, device=x.device, dtype=torch.int32)
    if n:
        kernel(x, W_enc, b_enc, cand)
    return cand


def topk_candidates_reference(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, c: int) -> torch.Tensor:
    """What the kernel computes, in torch (fp32 math): the same keys, the same ``cand`` layout. For tests on CPU."""
    n, d_sae = x.shape[0], W_enc.shape[0]
    pre = (x.float() @ W_enc.float().T + b_enc.float()).reshape(n, d_sae // BLOCK_N, BLOCK_N)
    j = torch.arange(BLOCK_N, device=x.device, dtype=torch.int32)
    keys = (pre.view(torch.int32).clamp_min(0) & -(1 << _LOW_BITS)) | (BLOCK_N - 1 - j)
    return keys.topk(c, dim=-1, sorted=True).values


def merge_candidates(cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k of each row from its per-tile candidates, and which rows must be recomputed.

    Args:
        cand: ``[N, NT, c]`` int32 keys from ``topk_candidates`` (``NT * c >= k``).
        k: features kept per token.
    Returns:
        ``(values [N, k] fp32 sorted descending (0 for padding), indices [N, k] int64, flagged [N] bool)``. A flagged
        row had a tile whose c-th candidate is positive and beats the row's k-th pick: that tile's (c+1)-th might too,
        so the row is not certain and must be recomputed. Unflagged rows are exact (to the 2^-15 key precision).
    """
    n, n_tiles, c = cand.shape
    # An unsorted top-k then a sort of the k winners is cheaper than a sorted top-k (H200: 0.51 + ~0.05 vs 0.61 ms
    # for 16384 x 1024 candidates).
    top, slot = cand.reshape(n, n_tiles * c).topk(k, dim=1, sorted=False)
    top, order = top.sort(dim=1, descending=True)
    slot = slot.gather(1, order)
    column = (BLOCK_N - 1) - (top & (BLOCK_N - 1))
    indices = torch.div(slot, c, rounding_mode="floor") * BLOCK_N + column.long()
    values = (top & -(1 << _LOW_BITS)).view(torch.float32)
    last = cand[:, :, c - 1]
    flagged = ((last >= 1 << _LOW_BITS) & (last > top[:, k - 1 : k])).any(dim=1)
    return values, indices, flagged
