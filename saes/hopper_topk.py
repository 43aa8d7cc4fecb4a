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
selected key) and recomputed by the caller. ``merge_candidates_kernel`` does the same in one TileLang kernel, one warp
a row with the row's keys in registers (the k-th key by a bitwise search of warp-reduced counts, a ballot compaction,
a rank placement; ``merge_candidates_twin`` is that algorithm in torch, for CPU tests).

Every kernel compiles through ``flashqla_kernels.toolkit.compile_kernel`` (sm_90a, cached per argument tuple) with
fast math off: nvcc's fast math flushes denormals to zero, which would change the keys of tiny pre-activations.
Importing this module does not import tilelang.
"""

import math

import torch

from flashqla_kernels import toolkit

BLOCK_M, BLOCK_N, THREADS = 128, 256, 256
# (BLOCK_K, pipeline stages): the mainloop knobs; 64 x 3 stages = 144 KiB of shared memory.
DEFAULT_CONFIG = (64, 3)
BLOCK_K = DEFAULT_CONFIG[0]
# The operand dtypes the kernels read (TileLang's names from ``toolkit.tl_dtype``).
DTYPES = (torch.bfloat16, torch.float16)
# The column of a positive key sits in its 8 low mantissa bits.
_LOW_BITS = 8
assert BLOCK_N <= 1 << _LOW_BITS


def _compile(builder, *args):
    """``toolkit.compile_kernel(builder, *args)`` with fast math off (the builder's ``pass_configs``, set on its
    first compile: the key is tilelang's, so it waits until tilelang is imported)."""
    if not hasattr(builder, "pass_configs"):
        import tilelang

        builder.pass_configs = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}
    return toolkit.compile_kernel(builder, *args)


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
               Bias: T.Tensor((d_sae,), T.float32), Cand: T.Tensor((n_tok, n_tiles, c), T.int32)):
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
    def sae_topk_epilogue(Pre: T.Tensor((n_tok, d_sae), dtype), Cand: T.Tensor((n_tok, n_tiles, c), T.int32)):
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


def compile_topk_candidates_from_preacts(d_sae: int, c: int, dtype: str = "bfloat16"):
    """Compile the unfused candidate kernel for sm_90a (cached like ``compile_topk_candidates``)."""
    return _compile(build_topk_candidates_from_preacts, d_sae, c, dtype)


def topk_candidates_from_preacts(pre: torch.Tensor, c: int) -> torch.Tensor:
    """Launch the unfused kernel on ``pre [N, d_sae]`` (bf16/fp16, bias included); returns ``cand [N, NT, c]`` int32."""
    n, d_sae = pre.shape
    kernel = compile_topk_candidates_from_preacts(d_sae, c, toolkit.tl_dtype(pre.dtype))
    cand = toolkit.empty((n, d_sae // BLOCK_N, c), torch.int32, pre.device)
    if n:
        kernel(pre, cand)
    return cand


def compile_topk_candidates(d_model: int, d_sae: int, c: int, dtype: str = "bfloat16",
                            config: tuple[int, int] = DEFAULT_CONFIG):
    """Compile (JIT, cached per process by the toolkit and on disk by tilelang) the candidate kernel for sm_90a;
    works without a GPU."""
    return _compile(build_topk_candidates, d_model, d_sae, c, dtype, tuple(config))


def precompile(variants: list[tuple], workers: int = 8) -> None:
    """Compile many ``compile_topk_candidates(*variant)`` in parallel processes, filling tilelang's disk cache.

    Each variant is ``(d_model, d_sae, c[, dtype[, config]])`` for the fused kernel, ``("preacts", d_sae, c[, dtype])``
    for the unfused one or ``("merge", NT * c, c, k)`` for the merge kernel; later compiles of the same variant load
    from the cache.
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
    if variant[0] == "merge":
        return len(compile_merge_candidates(*variant[1:]).get_kernel_source())
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
    kernel = compile_topk_candidates(d_model, d_sae, c, toolkit.tl_dtype(x.dtype), tuple(config or DEFAULT_CONFIG))
    cand = toolkit.empty((n, d_sae // BLOCK_N, c), torch.int32, x.device)
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


# ------------------------------------------------------------------------------------------------ the merge kernel
# One warp merges one row: its NT * c keys sit in registers, MERGE_MAX_SLOTS / 32 = 128 a lane at most (245
# registers at k = 100, no spills: the 4c = 32 re-run of flagged rows at d_sae = 32768 still fits; wider candidate
# lists go through the torch merge). The first pass of the shipped shapes holds 32 to 48 keys a lane (86 registers).
MERGE_WARPS, MERGE_MAX_SLOTS = 8, 4096


def _merge_selection(T, n_slots: int, c: int, k: int):
    """The merge kernel's selection as macros over one warp's keys (``keys``: slot ``e * 32 + lane`` in register
    ``e``): ``threshold`` (steps 1 and 2 of ``merge_candidates_twin``) and ``compact`` (step 3)."""
    per_lane = -(-n_slots // 32)
    slot_bits = max(1, (n_slots - 1).bit_length())

    @T.macro
    def count(keys, lane, pred, total):
        """``total[0]`` = the number of the warp's keys (slot ``e * 32 + lane``) for which ``pred(key, slot)`` holds."""
        total[0] = 0
        for e in T.unroll(per_lane):
            total[0] += T.if_then_else(pred(keys[e], e * 32 + lane), 1, 0)
        total[0] = T.warp_reduce_sum(total[0])

    @T.macro
    def count_at_least(keys, t, part, total):
        """``total[0]`` = the number of the warp's keys >= ``t`` (> 0): the sign bit of ``t - 1 - key`` (no overflow:
        keys lie in [-1, 2^31)), summed into 4 independent partial counts (2 instructions a key, not a chain)."""
        for q in T.unroll(4):
            part[q] = 0
        for e in T.unroll(per_lane):
            part[e % 4] += T.cast(T.shift_right(T.cast(t - 1 - keys[e], "uint32"), T.uint32(31)), "int32")
        total[0] = T.warp_reduce_sum(part[0] + part[1] + part[2] + part[3])

    @T.macro
    def threshold(keys, lane, st, total, part):
        """``st[0]`` = T, the k-th largest key, one bit at a time from bit 30 (keys are non-negative int32);
        ``st[1]`` = the bound below which slots holding T are kept: exactly k keys are then selected."""
        st[0] = 0
        for b in T.serial(31):
            count_at_least(keys, T.bitwise_or(st[0], T.shift_left(1, 30 - b)), part, total)
            if total[0] >= k:
                st[0] = T.bitwise_or(st[0], T.shift_left(1, 30 - b))
        count(keys, lane, lambda key, s: key > st[0], total)
        st[2] = k - total[0]
        count(keys, lane, lambda key, s: key == st[0], total)
        st[1] = n_slots
        # More keys equal T than places left (equal keys of different tiles): keep the first st[2] of them in slot
        # order, the last slot bound with fewer than st[2] of them below it, one bit at a time.
        if total[0] > st[2]:
            st[1] = 0
            for b in T.serial(slot_bits):
                count(keys, lane,
                      lambda key, s: (key == st[0]) & (s < T.bitwise_or(st[1], T.shift_left(1, slot_bits - 1 - b))),
                      total)
                if total[0] < st[2]:
                    st[1] = T.bitwise_or(st[1], T.shift_left(1, slot_bits - 1 - b))
            st[1] = st[1] + 1

    @T.macro
    def compact(keys, lane, st, picked, picked_slot, w):
        """Selected keys to ``picked[w, :k]`` in slot order (ballot + popcount: the exclusive prefix count), and
        ``st[2]`` = 1 when a tile's c-th key is positive and selected (the row is flagged)."""
        below = T.shift_left(T.uint32(1), T.cast(lane, "uint32")) - T.uint32(1)
        st[3] = 0
        st[2] = 0
        for e in T.unroll(per_lane):
            sel = (keys[e] > st[0]) | ((keys[e] == st[0]) & (e * 32 + lane < st[1]))
            mask = T.cast(T.ballot(sel), "uint32")
            pos = st[3] + T.cast(T.popcount(T.bitwise_and(mask, below)), "int32")
            if sel and pos < k:
                picked[w, pos] = keys[e]
                picked_slot[w, pos] = e * 32 + lane
            st[3] += T.cast(T.popcount(mask), "int32")
            if (e * 32 + lane) % c == c - 1 and keys[e] >= 1 << _LOW_BITS and keys[e] > st[0]:
                st[2] = 1
        st[2] = T.warp_reduce_max(st[2])

    return threshold, compact


def _merge_placement(T, k: int):
    """Step 4 of ``merge_candidates_twin`` as a macro: each of the warp's k picked keys (shared row ``w``, lane + 32 m
    in register m) to its rank, written to the shared rows ``out_keys`` / ``out_slot``."""
    per_out = -(-k // 32)

    @T.macro
    def place(picked, picked_slot, lane, mine, rank, out_keys, out_slot, w):
        """Each picked key to its rank among the k (the number of picked keys above it, equal ones by slot order)."""
        for m in T.unroll(per_out):
            mine[m] = -1
            rank[m] = 0
            if m * 32 + lane < k:
                mine[m] = picked[w, m * 32 + lane]
        # Unrolled: the k shared loads are independent (H200, 32768 rows of 1024 keys: 0.24 ms, 0.27 with a loop).
        for j in T.unroll(k):
            for m in T.unroll(per_out):
                rank[m] += T.if_then_else((picked[w, j] > mine[m]) | ((picked[w, j] == mine[m]) & (j < m * 32 + lane)),
                                          1, 0)
        for m in T.unroll(per_out):
            if m * 32 + lane < k:
                out_keys[w, rank[m]] = mine[m]
                out_slot[w, rank[m]] = picked_slot[w, m * 32 + lane]

    return place


def build_merge_candidates(n_slots: int, c: int, k: int):
    """The prim_func ``sae_merge_candidates(cand int32 [N, n_slots], values fp32 [N, k], indices int64 [N, k],
    flagged uint8 [N])``: ``merge_candidates`` on the GPU, one warp a row (``merge_candidates_twin`` is its algorithm
    in torch). ``n_slots = NT * c`` at most ``MERGE_MAX_SLOTS``; N is dynamic."""
    import tilelang.language as T

    assert k <= n_slots <= MERGE_MAX_SLOTS
    n_tok = T.dynamic("N")
    per_lane, per_out = -(-n_slots // 32), -(-k // 32)
    threshold, compact = _merge_selection(T, n_slots, c, k)
    place = _merge_placement(T, k)

    @T.prim_func
    def sae_merge_candidates(Cand: T.Tensor((n_tok, n_slots), T.int32), Values: T.Tensor((n_tok, k), T.float32),
                             Indices: T.Tensor((n_tok, k), T.int64), Flagged: T.Tensor((n_tok,), T.uint8)):
        with T.Kernel(T.ceildiv(n_tok, MERGE_WARPS), threads=32 * MERGE_WARPS) as bx:
            lane = T.get_thread_binding() % 32
            w = T.get_thread_binding() // 32
            row = bx * MERGE_WARPS + w
            keys = T.alloc_local((per_lane,), "int32")
            mine = T.alloc_local((per_out,), "int32")
            rank = T.alloc_local((per_out,), "int32")
            # st: T, the slot bound for keys equal to T, the flag, the running compaction offset
            st = T.alloc_local((4,), "int32")
            total = T.alloc_local((1,), "int32")
            part = T.alloc_local((4,), "int32")
            picked = T.alloc_shared((MERGE_WARPS, k), "int32")
            picked_slot = T.alloc_shared((MERGE_WARPS, k), "int32")
            out_keys = T.alloc_shared((MERGE_WARPS, k), "int32")
            out_slot = T.alloc_shared((MERGE_WARPS, k), "int32")
            # Rows past N hold -1 everywhere: nothing is selected, nothing is stored.
            for e in T.unroll(per_lane):
                keys[e] = -1
                if row < n_tok and e * 32 + lane < n_slots:
                    keys[e] = Cand[row, e * 32 + lane]
            threshold(keys, lane, st, total, part)
            compact(keys, lane, st, picked, picked_slot, w)
            T.sync_warp()
            place(picked, picked_slot, lane, mine, rank, out_keys, out_slot, w)
            T.sync_warp()
            for m in T.unroll(per_out):
                if row < n_tok and m * 32 + lane < k:
                    Values[row, m * 32 + lane] = T.reinterpret(
                        T.bitwise_and(out_keys[w, m * 32 + lane], -(1 << _LOW_BITS)), "float32")
                    Indices[row, m * 32 + lane] = T.cast(
                        out_slot[w, m * 32 + lane] // c * BLOCK_N + (BLOCK_N - 1)
                        - T.bitwise_and(out_keys[w, m * 32 + lane], BLOCK_N - 1), "int64")
            if row < n_tok and lane == 0:
                Flagged[row] = T.cast(st[2], "uint8")

    return sae_merge_candidates


def compile_merge_candidates(n_slots: int, c: int, k: int):
    """Compile the merge kernel for sm_90a (cached like ``compile_topk_candidates``; works without a GPU)."""
    return _compile(build_merge_candidates, n_slots, c, k)


def merge_candidates_kernel(cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``merge_candidates`` as one TileLang kernel: the same outputs, equal keys ordered by slot (tile) order.

    Args:
        cand: ``[N, NT, c]`` int32 keys on an sm_90 GPU, ``k <= NT * c <= MERGE_MAX_SLOTS``.
        k: features kept per token.
    Returns:
        ``(values [N, k] fp32 sorted descending, indices [N, k] int64, flagged [N] bool)`` as ``merge_candidates``;
        bit for bit ``merge_candidates_twin``.
    """
    n, n_tiles, c = cand.shape
    if not k <= n_tiles * c <= MERGE_MAX_SLOTS:
        raise ValueError(f"merge_candidates_kernel needs k <= NT * c <= {MERGE_MAX_SLOTS}, got k={k}, NT={n_tiles}, "
                         f"c={c}; use merge_candidates")
    kernel = compile_merge_candidates(n_tiles * c, c, k)
    values = toolkit.empty((n, k), torch.float32, cand.device)
    indices = toolkit.empty((n, k), torch.long, cand.device)
    flagged = toolkit.empty((n,), torch.bool, cand.device)
    if n:
        kernel(cand.reshape(n, n_tiles * c).contiguous(), values, indices, flagged.view(torch.uint8))
    return values, indices, flagged


def merge_candidates_twin(cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merge kernel's algorithm in torch, step for step (any device): what ``merge_candidates_kernel`` returns.

    1. T = the k-th largest key, found one bit at a time (bit 30 down: keep the bit if at least k keys are >= it);
    2. if more keys equal T than the ``need = k - #(keys > T)`` places left, keep the first ``need`` in slot order
       (a slot bound found one bit at a time): exactly k keys are selected;
    3. compact them in slot order (each one's exclusive prefix count of selected slots: the kernel's ballot);
    4. place each at its rank (the number of selected keys above it, equal keys by slot order) and decode.
    Args and Returns as ``merge_candidates``.
    """
    n, n_tiles, c = cand.shape
    keys = cand.reshape(n, n_tiles * c)
    slot = torch.arange(n_tiles * c, device=cand.device)
    thr = torch.zeros(n, 1, device=cand.device, dtype=torch.int32)
    for bit in range(30, -1, -1):
        trial = thr | (1 << bit)
        thr = torch.where((keys >= trial).sum(1, keepdim=True) >= k, trial, thr)
    ties = keys == thr
    need = k - (keys > thr).sum(1, keepdim=True)
    bound = torch.zeros_like(need)
    for bit in range(max(1, (n_tiles * c - 1).bit_length()) - 1, -1, -1):
        trial = bound | (1 << bit)
        bound = torch.where((ties & (slot < trial)).sum(1, keepdim=True) < need, trial, bound)
    bound = torch.where(ties.sum(1, keepdim=True) > need, bound + 1, n_tiles * c)
    selected = (keys > thr) | (ties & (slot < bound))
    pos = torch.where(selected, selected.cumsum(1) - selected.long(), k)  # k: a bin for the unselected
    picked = keys.new_full((n, k + 1), -1).scatter_(1, pos, keys)[:, :k]
    picked_slot = pos.new_zeros(n, k + 1).scatter_(1, pos, slot.expand(n, -1))[:, :k]
    j = torch.arange(k, device=cand.device)
    above = (picked[:, None, :] > picked[:, :, None]) | ((picked[:, None, :] == picked[:, :, None]) & (j < j[:, None]))
    rank = above.sum(2)
    out_keys = torch.empty_like(picked).scatter_(1, rank, picked)
    out_slot = torch.empty_like(picked_slot).scatter_(1, rank, picked_slot)
    values = (out_keys & -(1 << _LOW_BITS)).view(torch.float32)
    column = (BLOCK_N - 1) - (out_keys & (BLOCK_N - 1))
    indices = torch.div(out_slot, c, rounding_mode="floor") * BLOCK_N + column.long()
    last = cand[:, :, c - 1]
    flagged = ((last >= 1 << _LOW_BITS) & (last > thr)).any(dim=1)
    return values, indices, flagged
