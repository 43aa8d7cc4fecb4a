"""A piece shared by the row-normalising glue kernels (``rms_norm``, ``gated_norm``): rows of a 2-D tensor into fp32
fragments, and the inverse RMS of each row. A TileLang macro, so the kernels' generated CUDA is what it was when
each wrote these lines itself. ``load_sum_rows_inverse_rms`` is its form for the decoder's residual add: the rows of
two tensors added and rounded to their dtype first (what ``a + b`` in that dtype writes), then normalised."""


def load_rows_inverse_rms(T, BR: int, D: int, eps: float):
    """The macro ``(src [rows, D], r0, rows, xf [BR, D], sq [BR, D], ss [BR])``: ``xf`` = rows ``r0 ..`` of ``src``
    in fp32 (0 past ``rows``), ``ss`` = ``rsqrt(mean(xf^2) + eps)`` per row; ``sq`` is scratch."""
    inv_d = 1.0 / D

    @T.macro
    def load(src, r0, rows, xf, sq, ss):
        for i, d in T.Parallel(BR, D):
            xf[i, d] = T.if_then_else(r0 + i < rows, T.cast(src[T.min(r0 + i, rows - 1), d], "float32"), 0.0)
            sq[i, d] = xf[i, d] * xf[i, d]
        T.reduce_sum(sq, ss, dim=1)
        for i in T.Parallel(BR):
            ss[i] = T.rsqrt(ss[i] * inv_d + eps)

    return load


def load_sum_rows_inverse_rms(T, BR: int, D: int, eps: float, dtype: str):
    """The macro ``(a [rows, D], b [rows, D], r0, rows, xf [BR, D], sq [BR, D], ss [BR])``: ``xf`` = rows ``r0 ..``
    of ``a + b`` rounded to ``dtype`` (as the framework's own add in that dtype rounds it), in fp32 (0 past
    ``rows``); ``ss`` = ``rsqrt(mean(xf^2) + eps)`` per row; ``sq`` is scratch."""
    inv_d = 1.0 / D

    @T.macro
    def load(a, b, r0, rows, xf, sq, ss):
        for i, d in T.Parallel(BR, D):
            r = T.min(r0 + i, rows - 1)
            xf[i, d] = T.if_then_else(
                r0 + i < rows,
                T.cast(T.cast(T.cast(a[r, d], "float32") + T.cast(b[r, d], "float32"), dtype), "float32"), 0.0)
            sq[i, d] = xf[i, d] * xf[i, d]
        T.reduce_sum(sq, ss, dim=1)
        for i in T.Parallel(BR):
            ss[i] = T.rsqrt(ss[i] * inv_d + eps)

    return load
