"""TileLang kernel for sm_90a: TopK-SAE pre-activations with ReLU and a per-tile top-c selection in the epilogue.

One CTA computes a ``[BLOCK_M tokens, BLOCK_N features]`` tile of ``x @ W_enc^T + b_enc`` with wgmma (fp32 accumulators,
bf16/fp16 operands) and never writes it to memory. Its epilogue turns each accumulator into a *key* and writes only the
``c`` largest keys of every (token, tile) row to ``cand [N, d_sae / BLOCK_N, c]``:

- a positive pre-activation ``v`` becomes ``v`` with its 8 low mantissa bits replaced by ``255 - j`` (``j`` = column in
  the tile), still a positive float and ordered like ``v`` (to 2^-15 relative); the bits give back the column;
- a pre-activation ``<= 0`` (zero after ReLU) becomes ``-(1 + j)``: below every positive key, and still unique.

Keys are unique within a tile, so ``c`` rounds of (row max, drop the max) extract the tile's top-c in descending order.
``merge_candidates`` (plain torch) turns ``cand`` into the exact top-k: the global top-k lies in the union of per-tile
top-k's, and a row whose top-k could need a (c+1)-th element of some tile is flagged (its c-th key beats the k-th
selected key) and recomputed by the caller. Importing this module does not import tilelang.
"""

import functools
import math

import torch

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
NUM_STAGES, THREADS = 3, 256
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


def build_topk_candidates(d_model: int, d_sae: int, c: int, dtype: str = "bfloat16"):
    """The TileLang prim_func ``kernel(X [N, d_model], W_enc [d_sae, d_model], b_enc fp32 [d_sae], cand fp32 [N, NT, c])``.

    N (tokens) is dynamic; d_model must be a multiple of BLOCK_K and d_sae of BLOCK_N.
    """
    import tilelang.language as T

    n_tiles = d_sae // BLOCK_N
    n_tok = T.dynamic("N")
    keep_mask = -(1 << _LOW_BITS)

    @T.prim_func
    def kernel(X: T.Tensor((n_tok, d_model), dtype), W: T.Tensor((d_sae, d_model), dtype),
               Bias: T.Tensor((d_sae,), "float32"), Cand: T.Tensor((n_tok, n_tiles, c), "float32")):
        with T.Kernel(n_tiles, T.ceildiv(n_tok, BLOCK_M), threads=THREADS) as (bx, by):
            x_s = T.alloc_shared((BLOCK_M, BLOCK_K), dtype)
            w_s = T.alloc_shared((BLOCK_N, BLOCK_K), dtype)
            acc = T.alloc_fragment((BLOCK_M, BLOCK_N), "float32")
            row_max = T.alloc_fragment((BLOCK_M,), "float32")
            T.use_swizzle(10)
            T.clear(acc)
            for ko in T.Pipelined(T.ceildiv(d_model, BLOCK_K), num_stages=NUM_STAGES):
                T.copy(X[by * BLOCK_M, ko * BLOCK_K], x_s)
                T.copy(W[bx * BLOCK_N, ko * BLOCK_K], w_s)
                # FullRow: every warp holds whole tile rows, so the row reductions below stay inside a warp.
                T.gemm(x_s, w_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                v = acc[i, j] + Bias[bx * BLOCK_N + j]
                packed = T.bitwise_or(T.bitwise_and(T.reinterpret(v, "int32"), keep_mask), BLOCK_N - 1 - j)
                acc[i, j] = T.if_then_else(v > 0, T.reinterpret(packed, "float32"), T.cast(-1 - j, "float32"))
            for r in T.serial(c):
                T.reduce_max(acc, row_max, dim=1)
                for i in T.Parallel(BLOCK_M):
                    if by * BLOCK_M + i < n_tok:
                        Cand[by * BLOCK_M + i, bx, r] = row_max[i]
                for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                    acc[i, j] = T.if_then_else(acc[i, j] == row_max[i], -T.infinity("float32"), acc[i, j])

    return kernel


@functools.lru_cache(maxsize=None)
def compile_topk_candidates(d_model: int, d_sae: int, c: int, dtype: str = "bfloat16"):
    """Compile (JIT, cached on disk by tilelang) the candidate kernel for sm_90a; works without a GPU."""
    import tilelang

    return tilelang.compile(build_topk_candidates(d_model, d_sae, c, dtype), target=TARGET)


def topk_candidates(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, c: int) -> torch.Tensor:
    """Launch the kernel: per-(token, tile) top-c keys of ``ReLU(x @ W_enc^T + b_enc)``.

    Args:
        x: ``[N, d_model]`` bf16/fp16, contiguous, on an sm_90 GPU.
        W_enc: ``[d_sae, d_model]``, same dtype and device.
        b_enc: ``[d_sae]`` fp32.
        c: candidates per (token, tile).
    Returns:
        ``cand [N, d_sae // BLOCK_N, c]`` fp32 keys, descending along the last dim.
    """
    n, d_model = x.shape
    d_sae = W_enc.shape[0]
    kernel = compile_topk_candidates(d_model, d_sae, c, _TL_DTYPES[x.dtype])
    cand = torch.empty(n, d_sae // BLOCK_N, c, device=x.device, dtype=torch.float32)
    if n:
        kernel(x, W_enc, b_enc, cand)
    return cand


def topk_candidates_reference(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, c: int) -> torch.Tensor:
    """What the kernel computes, in torch (fp32 math): the same keys, the same ``cand`` layout. For tests on CPU."""
    n, d_sae = x.shape[0], W_enc.shape[0]
    pre = (x.float() @ W_enc.float().T + b_enc.float()).reshape(n, d_sae // BLOCK_N, BLOCK_N)
    j = torch.arange(BLOCK_N, device=x.device, dtype=torch.int32)
    packed = ((pre.view(torch.int32) & -(1 << _LOW_BITS)) | (BLOCK_N - 1 - j)).view(torch.float32)
    keys = torch.where(pre > 0, packed, (-1 - j).float())
    return keys.topk(c, dim=-1, sorted=True).values


def merge_candidates(cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k of each row from its per-tile candidates, and which rows must be recomputed.

    Args:
        cand: ``[N, NT, c]`` fp32 keys from ``topk_candidates`` (``NT * c >= k``).
        k: features kept per token.
    Returns:
        ``(values [N, k] fp32 sorted descending (0 for padding), indices [N, k] int64, flagged [N] bool)``. A flagged
        row had a tile whose c-th positive candidate beats the row's k-th pick: its (c+1)-th might too, so the row is
        not certain and must be recomputed. Unflagged rows are exact (to the 2^-15 key precision).
    """
    n, n_tiles, c = cand.shape
    top, slot = cand.reshape(n, n_tiles * c).topk(k, dim=1, sorted=True)
    bits = top.view(torch.int32)
    positive = top > 0
    column = torch.where(positive, (BLOCK_N - 1) - (bits & (BLOCK_N - 1)), (-1 - top).to(torch.int32))
    indices = torch.div(slot, c, rounding_mode="floor") * BLOCK_N + column.long()
    values = torch.where(positive, (bits & -(1 << _LOW_BITS)).view(torch.float32), torch.zeros_like(top))
    last = cand[:, :, c - 1]
    flagged = ((last > 0) & (last > top[:, k - 1 : k])).any(dim=1)
    return values, indices, flagged
