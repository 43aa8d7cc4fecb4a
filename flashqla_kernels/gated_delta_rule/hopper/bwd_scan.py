"""Backward stage (context parallelism only): the state gradient passed back over segments, exactly.

A segment's forward map is affine, ``S_end = M S_start + H`` (``segment_states``), so its backward is too:
``dS_start = M^T dS_end + c``, with ``c`` the segment's own contribution (``bwd_dh`` walked over the segment from
``dS_end = 0``). For each sequence, from ``dht`` (or zeros) at its last segment back to its first:
``dS_end[i - 1] = M_i^T dS_end[i] + c_i``; every segment's end gradient is written to ``d_end``, from which
``bwd_dh`` then walks each segment in parallel. One K x K x bDV GEMM per segment, as ``state_scan``'s (bf16
operands, fp32 accumulation).

Grid (V / bDV, Hv, N), 128 threads. ``rscan[n] = (first segment, number of segments, row of c of its second
segment)``; ``ms`` has a row per segment (that of each sequence's first segment is not read).
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit

BDV = 64


def build_bwd_scan(Hv: int, K: int, V: int, has_dht: bool):
    """The backward scan kernel: grid (V / bDV, Hv, N), 128 threads; ``has_dht``: start from ``dht`` (else zeros)."""
    bDV = min(BDV, V)
    num_seqs = T.dynamic("num_seqs")
    num_dht = T.dynamic("num_dht")
    num_c = T.dynamic("num_c")
    num_segs = T.dynamic("num_segs")

    @T.prim_func
    def gdn_bwd_scan(
        dht: T.Tensor((num_dht, Hv, K, V), "float32"),
        cs: T.Tensor((num_c, Hv, K, V), "float32"),
        ms: T.Tensor((num_segs, Hv, K, K), "float32"),
        rscan: T.Tensor((num_seqs, 3), "int32"),
        d_end: T.Tensor((num_segs, Hv, K, V), "float32"),
    ):
        with T.Kernel(V // bDV, Hv, num_seqs, threads=128) as (bv, bh, bn):
            v0 = bv * bDV
            first = T.alloc_var("int32")
            count = T.alloc_var("int32")
            first_c = T.alloc_var("int32")
            first = rscan[bn, 0]
            count = rscan[bn, 1]
            first_c = rscan[bn, 2]
            m_sh = T.alloc_shared((K, K), "bfloat16")
            s_sh = T.alloc_shared((K, bDV), "bfloat16")
            s_f = T.alloc_fragment((K, bDV), "float32")
            if has_dht:
                T.copy(dht[bn, bh, :, v0:v0 + bDV], s_f)
            else:
                T.clear(s_f)
            # segments count - 1 .. 1 of the sequence, last first
            for i in T.serial(count - 1):
                T.copy(s_f, d_end[first + count - 1 - i, bh, :, v0:v0 + bDV])
                T.copy(ms[first + count - 1 - i, bh, :, :], m_sh)
                T.copy(s_f, s_sh)
                T.copy(cs[first_c + count - 2 - i, bh, :, v0:v0 + bDV], s_f)
                T.fence_proxy_async()
                T.gemm(m_sh, s_sh, s_f, transpose_A=True)
            T.copy(s_f, d_end[first, bh, :, v0:v0 + bDV])

    return gdn_bwd_scan


def bwd_scan(dht, cs, ms, rscan, num_segs: int):
    """The gradient of every segment's end state.

    Args:
        dht: [N, Hv, K, V] fp32 or None (zeros). cs: [R, Hv, K, V] fp32, each non-first segment's own start-state
        gradient (``bwd_dh`` from a zero end gradient), in segment order. ms: [num_segs, Hv, K, K] fp32 every
        segment's map M. rscan: [N, 3] int32. num_segs: total segments.

    Returns:
        d_end [num_segs, Hv, K, V] fp32.
    """
    Hv, K, V = ms.shape[1], ms.shape[2], cs.shape[3]
    kernel = toolkit.compile_kernel(build_bwd_scan, Hv, K, V, dht is not None)
    d_end = toolkit.empty((num_segs, Hv, K, V), torch.float32, ms.device)
    if dht is None:
        dht = toolkit.unread((1, Hv, K, V), torch.float32, ms.device)  # not read without has_dht
    if cs.shape[0] == 0:
        cs = toolkit.unread((1, Hv, K, V), torch.float32, ms.device)  # every sequence is one segment: not read
    kernel(dht, cs, ms, rscan, d_end)
    return d_end
