"""The token-by-token gated delta rule on sm_90a: the decode step (T = 1) and short sequences, state in registers.

Per value head h, token t (q/k head h // (Hv/Hk)), with the optional l2norm folded in as scalars:

    S <- exp(g_t) S;   u = beta_t (v_t - S^T k^_t);   S <- S + k^_t u^T;   o_t = scale S^T q^_t

where ``x^ = x * rsqrt(sum(x^2) + 1e-6)`` under ``l2norm`` (else ``x^ = x``). Grid (V / BV, Hv, N): one CTA owns a
K x BV slice of one sequence's state for the whole sequence, so the state is read from HBM once and written once
however long the sequence is; q, k and the slice of v of each token go through shared memory. Each thread holds a
column strip of the slice in registers: the sums over K (``S^T k``, ``S^T q`` and the squared norms) are fused
multiply-adds in the thread plus one exchange of partials through shared memory, and the rank-1 update needs none.
SIMT-style rather than tile GEMMs: one token's work is a matrix-vector product per head, and the tile reductions'
cross-warp passes (four barriers each over 256 threads) cost more than the arithmetic.
``final`` may be the same tensor as ``h0``: each CTA reads its slice before it writes it, and no other CTA touches it,
so the decode step updates the state in place.

With ``gated_norm`` (BV = V: a CTA holds the whole value row), the output is the Qwen3.5 / Qwen3-Next gated RMSNorm
of it instead, ``y = o * rsqrt(mean(o^2) + eps) * weight * silu(z)``, so the decoder's decode step needs no second
kernel for the norm.
"""
import tilelang.language as T
import torch

from flashqla_kernels import toolkit

L2NORM_EPS = 1e-6
THREADS = 256


def shape_reason(K: int, V: int, gated_norm: bool = False, threads: int = THREADS) -> str | None:
    """Why the recurrent kernel cannot take head dims K, V, or None: a CTA's BV columns must split its threads
    evenly, and each thread's strip of K must fit in registers."""
    BV = block_v(V, gated_norm)
    if V % BV or threads % BV:
        return (f"value head dim V={V} unsupported by the recurrent kernel (a power of two up to 64 or a multiple "
                f"of 64{'; the gated norm needs V in 64, 128, 256' if gated_norm else ''})")
    P = threads // BV
    if K % P or K // P > 128:
        return (f"key head dim K={K} unsupported by the recurrent kernel with V={V} (a multiple of {P}, at most "
                f"{128 * P})")
    return None


def block_v(V: int, gated_norm: bool) -> int:
    """Value columns a CTA owns: the whole row under ``gated_norm`` (the norm is over V), else 64 (more CTAs for
    the one-token decode step, whose grid is Hv x N)."""
    return V if gated_norm else min(V, 64)


def build_fused_recurrent(Hk: int, Hv: int, K: int, V: int, dtype: str, scale: float, l2norm: bool, has_h0: bool,
                          store_final: bool, varlen: bool, gated_norm: bool = False, norm_eps: float = 1e-6,
                          threads: int = THREADS):
    """The recurrent kernel. ``varlen``: sequences are ``cu_seqlens`` spans of batch row 0 (else one per batch
    row); ``has_h0`` / ``store_final``: read an initial state / write the final one; ``gated_norm``: apply the
    gated RMSNorm (``z`` [B, T, Hv, V], ``weight`` [V], ``norm_eps``) to the output.

    Thread ``tx`` owns column ``tx % BV`` of the CTA's slice and rows ``KP (tx // BV) ..`` of it (KP = K BV /
    threads values in registers): the sums over K are KP fused multiply-adds in the thread and one exchange of P
    partials through shared memory, and the rank-1 update needs no exchange at all (u_j is the thread's own).
    """
    G = Hv // Hk
    BV = block_v(V, gated_norm)
    P = threads // BV
    KP = K // P
    assert V % BV == 0 and threads % BV == 0 and K % P == 0, (K, V, BV, threads)
    batch = T.dynamic("batch")
    seqlen = T.dynamic("seqlen")
    num_cu = T.dynamic("num_cu")
    num_h0 = T.dynamic("num_h0")
    num_final = T.dynamic("num_final")
    num_z = T.dynamic("num_z")
    inv_v = 1.0 / V
    loads = (2 * K + threads - 1) // threads

    @T.prim_func
    def gdn_fused_recurrent(
        q: T.Tensor((batch, seqlen, Hk, K), dtype),
        k: T.Tensor((batch, seqlen, Hk, K), dtype),
        v: T.Tensor((batch, seqlen, Hv, V), dtype),
        g: T.Tensor((batch, seqlen, Hv), "float32"),
        beta: T.Tensor((batch, seqlen, Hv), "float32"),
        cu_seqlens: T.Tensor((num_cu,), "int32"),
        h0: T.Tensor((num_h0, Hv, K, V), "float32"),
        z: T.Tensor((num_z, Hv, V), dtype),
        weight: T.Tensor((V,), dtype),
        final: T.Tensor((num_final, Hv, K, V), "float32"),
        o: T.Tensor((batch, seqlen, Hv, V), dtype),
    ):
        with T.Kernel(V // BV, Hv, num_cu - 1 if varlen else batch, threads=threads) as (bv, bh, bn):
            tx = T.get_thread_binding()
            j = tx % BV
            i0 = (tx // BV) * KP
            v0 = bv * BV
            hk = bh // G
            row = T.alloc_var("int32")
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            if varlen:
                row = 0
                bos = cu_seqlens[bn]
                eos = cu_seqlens[bn + 1]
            else:
                row = bn
                bos = 0
                eos = seqlen
            s = T.alloc_local((KP,), "float32")
            acc = T.alloc_local((3,), "float32")
            gate = T.alloc_local((2,), "float32")
            tot = T.alloc_local((3,), "float32")
            q_sh = T.alloc_shared((K,), "float32")
            k_sh = T.alloc_shared((K,), "float32")
            v_sh = T.alloc_shared((BV,), "float32")
            red = T.alloc_shared((3, P, BV), "float32")
            red_o = T.alloc_shared((P, BV), "float32")
            if gated_norm:
                o_sh = T.alloc_shared((V,), "float32")
            for r in T.unroll(KP):
                if has_h0:
                    s[r] = h0[bn, bh, i0 + r, v0 + j]
                else:
                    s[r] = 0.0
            for t in T.serial(eos - bos):
                tt = bos + t
                for c in T.unroll(loads):
                    if c * threads + tx < K:
                        q_sh[c * threads + tx] = T.cast(q[row, tt, hk, c * threads + tx], "float32")
                    elif c * threads + tx < 2 * K:
                        k_sh[c * threads + tx - K] = T.cast(k[row, tt, hk, c * threads + tx - K], "float32")
                if tx < BV:
                    v_sh[tx] = T.cast(v[row, tt, bh, v0 + tx], "float32")
                gate[0] = T.exp(g[row, tt, bh])
                gate[1] = beta[row, tt, bh]
                T.sync_threads()
                for c in T.unroll(3):
                    acc[c] = 0.0
                for r in T.unroll(KP):
                    s[r] = s[r] * gate[0]
                    acc[0] = acc[0] + s[r] * k_sh[i0 + r]
                    if l2norm:
                        acc[1] = acc[1] + k_sh[i0 + r] * k_sh[i0 + r]
                        acc[2] = acc[2] + q_sh[i0 + r] * q_sh[i0 + r]
                for c in T.unroll(3):
                    red[c, tx // BV, j] = acc[c]
                T.sync_threads()
                for c in T.unroll(3):
                    tot[c] = 0.0
                    for p in T.unroll(P):
                        tot[c] = tot[c] + red[c, p, j]
                if l2norm:
                    tot[1] = T.rsqrt(tot[1] + L2NORM_EPS)
                    tot[2] = T.rsqrt(tot[2] + L2NORM_EPS) * scale
                else:
                    tot[1] = 1.0
                    tot[2] = scale
                # u_j times k^'s norm factor: the rank-1 update then reads the raw k from shared memory
                tot[0] = tot[1] * gate[1] * (v_sh[j] - tot[0] * tot[1])
                acc[0] = 0.0
                for r in T.unroll(KP):
                    s[r] = s[r] + k_sh[i0 + r] * tot[0]
                    acc[0] = acc[0] + s[r] * q_sh[i0 + r]
                red_o[tx // BV, j] = acc[0]
                T.sync_threads()
                acc[0] = 0.0
                for p in T.unroll(P):
                    acc[0] = acc[0] + red_o[p, j]
                acc[0] = acc[0] * tot[2]
                if gated_norm:
                    if tx < BV:
                        o_sh[j] = acc[0]
                    T.sync_threads()
                    acc[1] = 0.0
                    for c in T.serial(V):
                        acc[1] = acc[1] + o_sh[c] * o_sh[c]
                    if tx < BV:
                        acc[2] = T.cast(z[row * seqlen + tt, bh, j], "float32")
                        o[row, tt, bh, j] = T.cast(
                            acc[0] * T.rsqrt(acc[1] * inv_v + norm_eps) * T.cast(weight[j], "float32")
                            * acc[2] * T.sigmoid(acc[2]), dtype)
                elif tx < BV:
                    o[row, tt, bh, v0 + j] = T.cast(acc[0], dtype)
                # the next token overwrites the shared rows and partials
                T.sync_threads()
            if store_final:
                for r in T.unroll(KP):
                    final[bn, bh, i0 + r, v0 + j] = s[r]

    return gdn_fused_recurrent


def fused_recurrent(q, k, v, g, beta, scale: float, initial_state=None, output_final_state: bool = False,
                    use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None, *, final_state=None, z=None,
                    norm_weight=None, norm_eps: float = 1e-6):
    """Run the recurrent kernel (CUDA tensors, contiguous, dtypes as the builder takes them).

    Args:
        q, k: [B, T, Hk, K]; v: [B, T, Hv, V] bf16/fp16/fp32, one dtype. g, beta: [B, T, Hv] fp32.
        scale: output scale. initial_state: [N, Hv, K, V] fp32 or None (zeros). cu_seqlens: [N+1] int32 or None.
        output_final_state: return the final state. final_state: where to write it (may be ``initial_state``
            itself: the decode step's in-place update); default a new tensor.
        z, norm_weight, norm_eps: apply the gated RMSNorm (z [B, T, Hv, V] in v's dtype, weight [V]).

    Returns:
        (o [B, T, Hv, V] in v's dtype, the final state or None).
    """
    B, Tn, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    dev = q.device
    gated = z is not None
    store = output_final_state or final_state is not None
    kernel = toolkit.compile_kernel(build_fused_recurrent, Hk, Hv, K, V, toolkit.tl_dtype(v.dtype), float(scale),
                                    bool(use_qk_l2norm_in_kernel), initial_state is not None, store,
                                    cu_seqlens is not None, gated, float(norm_eps) if gated else 1e-6)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if store and final_state is None:
        final_state = toolkit.empty((N, Hv, K, V), torch.float32, dev)
    # a padded tail after cu_seqlens[-1] belongs to no sequence: its outputs are zeros, as the chunk op's
    o = toolkit.empty((B, Tn, Hv, V), v.dtype, dev) if cu_seqlens is None else torch.zeros(
        (B, Tn, Hv, V), dtype=v.dtype, device=dev)
    placeholder = toolkit.unread((1, Hv, K, V), torch.float32, dev) if initial_state is None or not store else None
    cu = cu_seqlens if cu_seqlens is not None else toolkit.unread((1,), torch.int32, dev)
    zz = z.reshape(B * Tn, Hv, V) if gated else toolkit.unread((1, Hv, V), v.dtype, dev)
    w = norm_weight.to(v.dtype).contiguous() if gated else toolkit.unread((V,), v.dtype, dev)
    if B * Tn > 0:
        kernel(q, k, v, g, beta, cu, initial_state if initial_state is not None else placeholder, zz, w,
               final_state if store else placeholder, o)
    return o, (final_state if store else None)
