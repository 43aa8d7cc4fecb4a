"""Stage 3 (context parallelism only): the sequential state passing over segments, exactly, in either direction.

Forward: for each sequence ``S_0 = h0`` (or zeros) and ``S_{i+1} = M_i S_i + H_i`` over its segments; every
segment's start state is written to ``h_init``.

Backward (``reverse``): a segment's forward map is affine, so its backward is too: ``dS_start = M^T dS_end + c``,
with ``c`` the segment's own contribution (``bwd_dh`` walked over the segment from ``dS_end = 0``). From ``dht`` (or
zeros) at a sequence's last segment back to its first, ``dS_end[i - 1] = M_i^T dS_end[i] + c_i``; every segment's
end gradient is written, from which ``bwd_dh`` walks the segments in parallel.

One K x K x bDV GEMM per segment (bf16 operands, fp32 accumulation), and none where ``segment_states`` found the
segment's M negligible (its ``start`` >= 0: M is zero, so the step is the copy of H, with no M read): with decaying
gates most steps are such copies, and the chain over a sequence's segments no longer waits on a load and a product
each.

Grid (V / bDV, Hv, N). Forward: ``seqs[n] = (first segment, number of segments, first row of H/M)``. Backward:
``seqs[n] = (first segment, number of segments, row of c of its second segment)``, ``ms`` a row per segment (that of
each sequence's first segment is not read).
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit

BDV = 64


def build_state_scan(Hv: int, K: int, V: int, has_h0: bool, reverse: bool = False):
    """The state_scan kernel: grid (V / bDV, Hv, N), 128 threads; ``has_h0``: start from ``h0`` (else zeros);
    ``reverse``: the backward's pass (``h0`` is dht, ``hs`` the c rows, ``h_init`` the end gradients)."""
    bDV = min(BDV, V)
    num_seqs = T.dynamic("num_seqs")
    num_h0 = T.dynamic("num_h0")
    num_maps = T.dynamic("num_maps")
    num_segs = T.dynamic("num_segs")
    # the backward reads M on every segment row but its c rows only on non-first segments
    num_ms = num_segs if reverse else num_maps

    @T.prim_func
    def gdn_state_scan(
        h0: T.Tensor((num_h0, Hv, K, V), "float32"),
        hs: T.Tensor((num_maps, Hv, K, V), "float32"),
        ms: T.Tensor((num_ms, Hv, K, K), "float32"),
        mstart: T.Tensor((num_ms, Hv), "int32"),
        seqs: T.Tensor((num_seqs, 3), "int32"),
        h_init: T.Tensor((num_segs, Hv, K, V), "float32"),
    ):
        with T.Kernel(V // bDV, Hv, num_seqs, threads=128) as (bv, bh, bn):
            v0 = bv * bDV
            first = T.alloc_var("int32")
            count = T.alloc_var("int32")
            first_map = T.alloc_var("int32")
            first = seqs[bn, 0]
            count = seqs[bn, 1]
            first_map = seqs[bn, 2]
            m_sh = T.alloc_shared((K, K), "bfloat16")
            s_sh = T.alloc_shared((K, bDV), "bfloat16")
            s_f = T.alloc_fragment((K, bDV), "float32")
            if has_h0:
                T.copy(h0[bn, bh, :, v0:v0 + bDV], s_f)
            else:
                T.clear(s_f)
            if reverse:
                # segments count - 1 .. 1 of the sequence, last first: dS_end[j - 1] = M_j^T dS_end[j] + c_j
                for i in T.serial(count - 1):
                    T.copy(s_f, h_init[first + count - 1 - i, bh, :, v0:v0 + bDV])
                    if mstart[first + count - 1 - i, bh] < 0:
                        T.copy(ms[first + count - 1 - i, bh, :, :], m_sh)
                        T.copy(s_f, s_sh)
                        T.copy(hs[first_map + count - 2 - i, bh, :, v0:v0 + bDV], s_f)
                        T.fence_proxy_async()
                        T.gemm(m_sh, s_sh, s_f, transpose_A=True)
                    else:
                        T.copy(hs[first_map + count - 2 - i, bh, :, v0:v0 + bDV], s_f)
                T.copy(s_f, h_init[first, bh, :, v0:v0 + bDV])
            else:
                for i in T.serial(count - 1):
                    T.copy(s_f, h_init[first + i, bh, :, v0:v0 + bDV])
                    if mstart[first_map + i, bh] < 0:
                        T.copy(ms[first_map + i, bh, :, :], m_sh)
                        T.copy(s_f, s_sh)
                        T.copy(hs[first_map + i, bh, :, v0:v0 + bDV], s_f)
                        T.fence_proxy_async()
                        T.gemm(m_sh, s_sh, s_f)
                    else:
                        T.copy(hs[first_map + i, bh, :, v0:v0 + bDV], s_f)
                T.copy(s_f, h_init[first + count - 1, bh, :, v0:v0 + bDV])

    return gdn_state_scan


def state_scan(h0, hs, ms, mstart, seqs, num_segs: int):
    """Start state of every segment.

    Args:
        h0: [N, Hv, K, V] fp32 or None (zeros). hs: [R, Hv, K, V], ms: [R, Hv, K, K] fp32 segment maps.
        mstart: [R, Hv] int32, ``segment_states``' start table (M is used only where it is -1).
        seqs: [N, 3] int32. num_segs: total segments.

    Returns:
        h_init [num_segs, Hv, K, V] fp32.
    """
    Hv, K, V = hs.shape[1], hs.shape[2], hs.shape[3]
    kernel = toolkit.compile_kernel(build_state_scan, Hv, K, V, h0 is not None)
    h_init = toolkit.empty((num_segs, Hv, K, V), torch.float32, hs.device)
    if h0 is None:
        # the kernel's h0 argument, not read without has_h0
        h0 = toolkit.unread((1, Hv, K, V), torch.float32, hs.device)
    kernel(h0, hs, ms, mstart, seqs, h_init)
    return h_init


def state_scan_bwd(dht, cs, ms, mstart, rscan, num_segs: int):
    """The gradient of every segment's end state (the backward's pass over segments).

    Args:
        dht: [N, Hv, K, V] fp32 or None (zeros). cs: [R, Hv, K, V] fp32, each non-first segment's own start-state
        gradient (``bwd_dh`` from a zero end gradient), in segment order. ms: [num_segs, Hv, K, K] fp32 every
        segment's map M. mstart: [num_segs, Hv] int32, ``segment_states``' start table for those maps (M is used only
        where it is -1). rscan: [N, 3] int32 (the module doc). num_segs: total segments.

    Returns:
        d_end [num_segs, Hv, K, V] fp32.
    """
    Hv, K, V = ms.shape[1], ms.shape[2], cs.shape[3]
    kernel = toolkit.compile_kernel(build_state_scan, Hv, K, V, dht is not None, True)
    d_end = toolkit.empty((num_segs, Hv, K, V), torch.float32, ms.device)
    if dht is None:
        dht = toolkit.unread((1, Hv, K, V), torch.float32, ms.device)  # not read without has_dht
    if cs.shape[0] == 0:
        cs = toolkit.unread((1, Hv, K, V), torch.float32, ms.device)  # every sequence is one segment: not read
    kernel(dht, cs, ms, mstart, rscan, d_end)
    return d_end
