"""The LM head's cross entropy on sm_90a: each row's loss, and the row overwritten with the loss's gradient.

    loss_i = logsumexp(x_i) - x_i[t_i]            x_i[c] <- softmax(x_i)[c] - [c == t_i]      fp32 math

One CTA walks one row of V logits twice: first each thread keeps a running max and a running sum of exponentials
for its own columns (no cross-thread exchange inside the walk), merged across the CTA once at the end; then it
reads the row again and writes softmax - onehot over it in the row's dtype. Three passes over the bf16 logits (read,
read, write: 6 bytes a logit) where the torch formulation of a block (an fp32 softmax written and read back, its
row max, two gathers, a scatter and the copy into the bf16 buffer) moves about 26. At Qwen3.5's 248 320-entry
vocabulary a 4 096-token row block is 2 GB of bf16 logits: the bytes take ~1.9 ms on an H100.

``scale_`` multiplies a buffer in place by a device fp32 scalar: the loss's backward scales the gradient held in the
logits by its incoming gradient over the row count (torch runs a bf16 tensor times an fp32 0-dim tensor on its
non-vectorised mixed-dtype kernel, ~3x the bytes' time).

The kernels index with 64-bit offsets (a 4 096-token block of Qwen3.5 logits is 1.0e9 of them). V must be a multiple
of 8, so a thread's columns are whole vectors (``ops`` sends other widths to torch and says why).
"""
import tilelang.language as T
import torch

from flashqla_kernels.toolkit import LOG2E, compile_kernel, empty, tl_dtype

THREADS = 512
VECTOR_BYTES = 16
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def tile(dtype: str) -> int:
    """Columns a CTA reads per step: one 16-byte vector per thread."""
    return THREADS * VECTOR_BYTES // _BYTES[dtype]


def build_cross_entropy(V: int, dtype: str):
    """The kernel ``(logits [rows, V] dtype, in place; targets [rows] int64; loss [rows] fp32)`` for rows of V
    logits, V a multiple of 8."""
    BV = tile(dtype)
    n_tiles = (V + BV - 1) // BV
    rows = T.dynamic("rows")
    ninf = -T.infinity("float32")

    @T.prim_func
    def lm_cross_entropy(
        logits: T.Tensor((rows, V), dtype),
        targets: T.Tensor((rows,), "int64"),
        loss: T.Tensor((rows,), "float32"),
    ):
        with T.Kernel(rows, threads=THREADS) as r:
            m_f = T.alloc_fragment((1, BV), "float32")
            s_f = T.alloc_fragment((1, BV), "float32")
            m_row = T.alloc_fragment((1,), "float32")
            s_row = T.alloc_fragment((1,), "float32")
            tgt = T.alloc_var("int32")
            x_t = T.alloc_var("float32")
            # the target logit is read before any thread overwrites the row (the reductions below are barriers)
            tgt = T.cast(targets[r], "int32")
            x_t = T.cast(logits[r, tgt], "float32")
            T.fill(m_f, ninf)
            T.fill(s_f, 0.0)
            # each column slot keeps its own running max and sum of exp (x - max); a slot past V never updates
            for t in T.serial(n_tiles):
                for i, j in T.Parallel(1, BV):
                    if t * BV + j < V:
                        x = T.cast(logits[r, t * BV + j], "float32")
                        mx = T.max(m_f[i, j], x)
                        s_f[i, j] = (s_f[i, j] * T.exp2((m_f[i, j] - mx) * LOG2E)
                                     + T.exp2((x - mx) * LOG2E))
                        m_f[i, j] = mx
            T.reduce_max(m_f, m_row, dim=1)
            # an unused slot has max -inf and sum 0: exp2(-inf) * 0 = 0
            for i, j in T.Parallel(1, BV):
                s_f[i, j] = s_f[i, j] * T.exp2((m_f[i, j] - m_row[i]) * LOG2E)
            T.reduce_sum(s_f, s_row, dim=1)
            for t in T.serial(n_tiles):
                for i, j in T.Parallel(1, BV):
                    if t * BV + j < V:
                        logits[r, t * BV + j] = T.cast(
                            T.exp2((T.cast(logits[r, t * BV + j], "float32") - m_row[i]) * LOG2E) / s_row[i], dtype)
            # the onehot after a barrier, by one thread: a column test inside the walk above costs its vector
            # accesses (TileLang then moves one 16-bit value an instruction)
            T.sync_threads()
            for i in T.Parallel(1):
                loss[r] = m_row[i] + T.log(s_row[i]) - x_t
                logits[r, tgt] = T.cast(T.exp2((x_t - m_row[i]) * LOG2E) / s_row[i] - 1.0, dtype)

    return lm_cross_entropy


def build_scale(V: int, dtype: str):
    """The kernel ``(x [rows, V] dtype, in place; s [1] fp32)``: ``x <- x * s`` in fp32, rounded once."""
    BV = tile(dtype)
    rows = T.dynamic("rows")

    @T.prim_func
    def scale_rows(
        x: T.Tensor((rows, V), dtype),
        s: T.Tensor((1,), "float32"),
    ):
        with T.Kernel(T.ceildiv(V, BV), rows, threads=THREADS) as (bv, r):
            for i, j in T.Parallel(1, BV):
                if bv * BV + j < V:
                    x[r, bv * BV + j] = T.cast(T.cast(x[r, bv * BV + j], "float32") * s[0], dtype)

    return scale_rows



def cross_entropy_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's cross entropy, with ``logits`` overwritten by ``softmax - onehot`` (module doc).

    Args:
        logits: [N, V] bf16 / fp16 / fp32, contiguous, V a multiple of 8. targets: [N] int64 in [0, V).

    Returns:
        [N] fp32.
    """
    N, V = logits.shape
    kernel = compile_kernel(build_cross_entropy, V, tl_dtype(logits.dtype))
    loss = empty((N,), torch.float32, logits.device)
    if N:
        kernel(logits, targets, loss)
    return loss


def scale_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x *= s`` in place (fp32 math, one rounding): x [N, V] contiguous, V a multiple of 8; s a 1-element fp32
    tensor on x's device. Returns x."""
    N, V = x.shape
    kernel = compile_kernel(build_scale, V, tl_dtype(x.dtype))
    if N:
        kernel(x, s.reshape(1))
    return x
