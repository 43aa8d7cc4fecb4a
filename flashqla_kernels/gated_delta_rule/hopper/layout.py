"""Token-major q, k, v from the channels-first buffer transformers' Gated DeltaNet layer passes the op.

transformers runs the layer's short convolution on a [B, C, T] buffer (channels first) and hands the op q, k and v as
views of it: consecutive channel slices (q, then k, then v, C = 2 Hk K + Hv V), each [B, T, H, D] with strides
(C T, 1, D T, T). The stage kernels read 64-token tiles of token-major rows, so the launcher needs each as
[B T, H, D]. torch's ``.contiguous()`` transposes such a view with its generic strided copy: on the H200 the three
copies took 28 ms of a 330 ms Qwen3.5-2B-shaped forward at 8 x 4096 tokens (about 0.5 TB/s). This kernel makes all
three in one pass over the buffer: each CTA reads a 64-channel x 64-token tile (runs of consecutive tokens), writes it
transposed into shared memory and stores whole rows of channels into q, k or v.

Grid (ceil(T / 64), C / 64, B), 128 threads. A tail tile (T not a multiple of 64) reads and writes only its T % 64
tokens, so no CTA touches another sequence's rows.

transformers before 5.23 repeats q and k to the value heads when Hv > Hk (Qwen3.5-9B and up): q and k then arrive as
new contiguous tensors and v alone is a channels-first view. ``build_channel_slice_to_tokens`` makes that one slice
token-major the same way (grid over its own channels only).
"""

import tilelang.language as T
import torch

from flashqla_kernels import toolkit

TILE = 64
# pad of the transposed tile's rows: 66 two-byte elements are 33 words, so a column read falls in 32 distinct banks
PAD = 2


def build_channels_first_to_tokens(Fq: int, Fv: int, dtype: str):
    """The transpose kernel for q / k channel counts ``Fq`` (= Hk K) and v's ``Fv`` (= Hv V), both multiples of 64."""
    C = 2 * Fq + Fv
    batch = T.dynamic("batch")
    tokens = T.dynamic("tokens")
    rows = T.dynamic("rows")

    @T.prim_func
    def gdn_channels_first_to_tokens(
        src: T.Tensor((batch, C, tokens), dtype),
        q: T.Tensor((rows, Fq), dtype),
        k: T.Tensor((rows, Fq), dtype),
        v: T.Tensor((rows, Fv), dtype),
    ):
        with T.Kernel(T.ceildiv(tokens, TILE), C // TILE, batch, threads=128) as (bt, bc, b):
            tt = T.alloc_shared((TILE, TILE + PAD), dtype)  # [token, channel]
            t0 = bt * TILE
            c0 = bc * TILE
            n = T.min(TILE, tokens - t0)
            r0 = b * tokens + t0
            _load_tile(src, tt, b, c0, t0, n, tokens, dtype)
            # the tile lies wholly in one of q, k, v (each is a multiple of 64 channels)
            if c0 < Fq:
                for i, j in T.Parallel(TILE, TILE):
                    if i < n:
                        q[r0 + i, c0 + j] = tt[i, j]
            elif c0 < 2 * Fq:
                for i, j in T.Parallel(TILE, TILE):
                    if i < n:
                        k[r0 + i, c0 - Fq + j] = tt[i, j]
            else:
                for i, j in T.Parallel(TILE, TILE):
                    if i < n:
                        v[r0 + i, c0 - 2 * Fq + j] = tt[i, j]

    return gdn_channels_first_to_tokens


def build_channel_slice_to_tokens(C: int, c_first: int, F: int, dtype: str):
    """The transpose kernel for one slice of a [B, C, T] buffer: channels ``c_first`` to ``c_first + F`` (F a
    multiple of 64) as token-major rows [B T, F]."""
    batch = T.dynamic("batch")
    tokens = T.dynamic("tokens")
    rows = T.dynamic("rows")

    @T.prim_func
    def gdn_channel_slice_to_tokens(
        src: T.Tensor((batch, C, tokens), dtype),
        out: T.Tensor((rows, F), dtype),
    ):
        with T.Kernel(T.ceildiv(tokens, TILE), F // TILE, batch, threads=128) as (bt, bc, b):
            tt = T.alloc_shared((TILE, TILE + PAD), dtype)  # [token, channel]
            t0 = bt * TILE
            n = T.min(TILE, tokens - t0)
            r0 = b * tokens + t0
            _load_tile(src, tt, b, c_first + bc * TILE, t0, n, tokens, dtype)
            for i, j in T.Parallel(TILE, TILE):
                if i < n:
                    out[r0 + i, bc * TILE + j] = tt[i, j]

    return gdn_channel_slice_to_tokens


@T.macro
def _load_tile(src, tt, b, c0, t0, n, tokens, dtype):
    """Channels c0..c0+63 x tokens t0..t0+n-1 of ``src`` [B, C, T] into ``tt`` [token, channel]: a warp reads 32
    consecutive tokens of one channel and writes them down a column of the tile (rows past n are zero)."""
    if n == TILE:
        for i, j in T.Parallel(TILE, TILE):
            tt[j, i] = src[b, c0 + i, t0 + j]
    else:
        for i, j in T.Parallel(TILE, TILE):
            tt[j, i] = T.if_then_else(j < n, src[b, c0 + i, T.min(t0 + j, tokens - 1)], T.cast(0, dtype))


def channels_first_buffer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The [B, C, T] buffer that q, k, v are consecutive channel slices of (transformers' layout), or None.

    Args:
        q, k: [B, T, Hk, K]; v: [B, T, Hv, V], all of one dtype.

    Returns:
        A contiguous [B, 2 Hk K + Hv V, T] view of their common storage, or None when they are laid out any other way
        (the launcher then copies them with ``.contiguous()``), when T < 2 (the strides say nothing about the layout),
        or when a slice is not a multiple of 64 channels.
    """
    B, Tn, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    Fq, Fv = Hk * K, Hv * V
    C = 2 * Fq + Fv
    if Tn < 2 or Fq % TILE or Fv % TILE or k.shape != q.shape or not q.dtype == k.dtype == v.dtype:
        return None
    if not (_strides_are(q, (C * Tn, 1, K * Tn, Tn)) and _strides_are(k, (C * Tn, 1, K * Tn, Tn))
            and _strides_are(v, (C * Tn, 1, V * Tn, Tn))):
        return None
    storage = q.untyped_storage().data_ptr()
    if k.untyped_storage().data_ptr() != storage or v.untyped_storage().data_ptr() != storage:
        return None
    start = q.storage_offset()
    if k.storage_offset() != start + Fq * Tn or v.storage_offset() != start + 2 * Fq * Tn:
        return None
    if start + B * C * Tn > q.untyped_storage().nbytes() // q.element_size():
        return None
    return q.as_strided((B, C, Tn), (C * Tn, Tn, 1))


def channels_first_slice(v: torch.Tensor):
    """The [B, C, T] buffer that ``v`` [B, T, H, D] is the last channel slice of (transformers' v when it repeated q
    and k to the value heads), and the slice's first channel; or None.

    Returns:
        (buffer, c_first): a [B, C, T] view of v's storage whose channels c_first .. c_first + H D are v's (C from v's
        batch stride, v taken as the last slice so the view ends where v does); None when v is laid out any other
        way, when T < 2, or when H D is not a multiple of 64. With one sequence the batch stride says nothing, so
        the buffer is v's own [1, H D, T] block (c_first 0).
    """
    B, Tn, H, D = v.shape
    F = H * D
    if Tn < 2 or F % TILE or not _strides_are(v, (v.stride(0), 1, D * Tn, Tn)):
        return None
    start = v.storage_offset()
    if B == 1:
        C, c_first = F, 0
    else:
        C = v.stride(0) // Tn
        c_first = C - F
        if v.stride(0) % Tn or c_first < 0:
            return None
        start -= c_first * Tn
    if start < 0 or start + B * C * Tn > v.untyped_storage().nbytes() // v.element_size():
        return None
    return v.as_strided((B, C, Tn), (C * Tn, Tn, 1), start), c_first


def slice_tokens_major(buffer: torch.Tensor, c_first: int, H: int, D: int) -> torch.Tensor:
    """[B T, H, D], contiguous, from channels ``c_first`` .. ``c_first + H D`` of a [B, C, T] buffer
    (``channels_first_slice``)."""
    B, C, Tn = buffer.shape
    kernel = toolkit.compile_kernel(build_channel_slice_to_tokens, C, c_first, H * D, toolkit.tl_dtype(buffer.dtype))
    out = toolkit.empty((B * Tn, H, D), buffer.dtype, buffer.device)
    kernel(buffer, out.view(B * Tn, H * D))
    return out


def _strides_are(x: torch.Tensor, strides: tuple) -> bool:
    """x's strides are ``strides`` on every dim longer than 1 (torch reports any stride for a dim of size 1: a
    one-sequence batch's view has the token stride times T there, not C T)."""
    return all(s == want for s, want, n in zip(x.stride(), strides, x.shape) if n > 1)


def tokens_major(buffer: torch.Tensor, Hk: int, K: int, Hv: int, V: int):
    """q, k [B T, Hk, K] and v [B T, Hv, V], contiguous, from ``channels_first_buffer``'s [B, C, T] buffer."""
    B, C, Tn = buffer.shape
    kernel = toolkit.compile_kernel(build_channels_first_to_tokens, Hk * K, Hv * V, toolkit.tl_dtype(buffer.dtype))
    q = toolkit.empty((B * Tn, Hk, K), buffer.dtype, buffer.device)
    k = toolkit.empty((B * Tn, Hk, K), buffer.dtype, buffer.device)
    v = toolkit.empty((B * Tn, Hv, V), buffer.dtype, buffer.device)
    kernel(buffer, q.view(B * Tn, Hk * K), k.view(B * Tn, Hk * K), v.view(B * Tn, Hv * V))
    return q, k, v


def as_tokens_major(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k [B T, Hk, K] and v [B T, Hv, V], contiguous, as the stage kernels read them: by the one layout pass where
    q, k, v are transformers' channel slices (``channels_first_buffer``), by the one-slice pass where v alone is
    (``channels_first_slice``), else by reshape (a copy only where the layout needs one)."""
    B, Tn, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        # the common case first: views, no copy (and none of the buffer checks' host time)
        return q.view(B * Tn, Hk, K), k.view(B * Tn, Hk, K), v.view(B * Tn, Hv, V)
    buffer = channels_first_buffer(q, k, v)
    if buffer is not None:
        return tokens_major(buffer, Hk, K, Hv, V)
    q3, k3 = q.reshape(B * Tn, Hk, K).contiguous(), k.reshape(B * Tn, Hk, K).contiguous()
    found = channels_first_slice(v)
    if found is not None:
        return q3, k3, slice_tokens_major(*found, Hv, V)
    return q3, k3, v.reshape(B * Tn, Hv, V).contiguous()
