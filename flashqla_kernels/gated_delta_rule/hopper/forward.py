"""The Hopper forward: checks the kernels' own requirements, plans, and runs the stages
(kkt_solve -> [segment_states -> state_scan] -> chunk_fwd).

Imports torch only; the stage modules (and tilelang) are imported on the first call. The device check (CUDA tensors
of an sm_90 GPU) is the dispatcher's (``flashqla_kernels.dispatch.hopper_reason``), made before the kernels are chosen.
"""
from __future__ import annotations

import functools

import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule import checks
from flashqla_kernels.gated_delta_rule.hopper import plan

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def padded_head_dim(d: int) -> int | None:
    """The kernel head dim a head dim ``d`` runs at: the smallest of ``SUPPORTED_HEAD_DIMS`` >= d, or None past 256.

    Zero channels change nothing: a zero key or query channel adds nothing to a dot product or a norm, a zero value
    channel only produces a zero output column and a zero state column, so the launcher pads other head dims with
    zeros and slices the outputs back.
    """
    if d in SUPPORTED_HEAD_DIMS:
        return d  # the common case, without the search (it runs four times a call)
    return next((s for s in SUPPORTED_HEAD_DIMS if s >= d), None) if d >= 1 else None


def unsupported_reason(q, k, v, g, beta, initial_state=None, cu_seqlens=None) -> str | None:
    """Why the Hopper kernels cannot take these inputs (dtypes, head dims, shapes), or None when they can.

    Args:
        q, k: [B, T, Hk, K]; v: [B, T, Hv, V]; g, beta: [B, T, Hv]; initial_state: [N, Hv, K, V] or None;
        cu_seqlens: [N+1] or None.

    Returns:
        A sentence naming the offending input and the fix, or None.
    """
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if not all(isinstance(x, torch.Tensor) for x in tensors.values()):
        return "q, k, v, g, beta must all be torch.Tensor"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        return (f"the Hopper kernels take q, k, v in one dtype of (bfloat16, float16); got {q.dtype}, {k.dtype}, "
                f"{v.dtype}: cast them with .to(torch.bfloat16)")
    if q.dim() != 4 or v.dim() != 4 or k.shape != q.shape:
        return (f"q, k must be [B, T, Hk, K] and v [B, T, Hv, V]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}")
    K, V, Hk, Hv = k.shape[3], v.shape[3], k.shape[2], v.shape[2]
    if padded_head_dim(K) is None or padded_head_dim(V) is None:
        return (f"head dims K={K}, V={V} unsupported by the Hopper kernels (1 to {SUPPORTED_HEAD_DIMS[-1]}; "
                f"{SUPPORTED_HEAD_DIMS} run as they are, others zero-padded to the next)")
    if Hv % Hk:
        return f"Hv={Hv} must be a multiple of Hk={Hk}"
    if plan.heads_per_cta(Hv // Hk) == 3:
        # 3 heads a CTA are 6 warps, over which kkt_solve's 64 x 64 GEMMs cannot be partitioned
        return (f"kkt_solve takes GVA groups it can split into slices of 1, 2 or 4 value heads; Hv / Hk = "
                f"{Hv // Hk} would need slices of 3")
    if cu_seqlens is not None and q.shape[0] != 1:
        return f"cu_seqlens needs B=1 (packed sequences); got B={q.shape[0]}"
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        return f"g and beta must be [B, T, Hv] = {tuple(v.shape[:3])}; got {tuple(g.shape)}, {tuple(beta.shape)}"
    if initial_state is not None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if tuple(initial_state.shape) != (N, Hv, K, V):
            return f"initial_state must be [N, Hv, K, V] = {(N, Hv, K, V)}; got {tuple(initial_state.shape)}"
    return None


def saved_chunks(B: int, T: int, N: int) -> int:
    """Rows of the saved states ``h`` for B x T tokens in N sequences: an upper bound on the chunk count (each
    sequence adds at most one partial chunk), known from shapes alone (the custom op's fake needs it)."""
    return -(-(B * T) // plan.CHUNK) + N


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, segment_chunks=None, block_v=None,
                               save_states=False, checked=False):
    """Gated delta rule forward on the TileLang Hopper kernels (chunk size 64, exact).

    Args:
        q, k: [B, T, Hk, K] bf16/fp16; v: [B, T, Hv, V] same dtype (K, V up to 256: 64 / 128 / 256 as they are,
            others zero-padded to the next); g (log decay), beta: [B, T, Hv] (any float
            dtype, computed in fp32). scale: default K^-0.5. initial_state: [N, Hv, K, V] or None.
        output_final_state: return the [N, Hv, K, V] fp32 final state. use_qk_l2norm_in_kernel: l2-normalise q and k
            inside the kernels (no separate pass). cu_seqlens: [N+1] offsets of packed sequences (B = 1); a tail
            after ``cu_seqlens[-1]`` is padding: ignored, its outputs 0.
        segment_chunks: intra-card context parallelism: None (default) picks by the plan's cost model, 0 never
            splits, L > 0 forces L-chunk segments (tests and benchmarks).
        block_v: None (default) takes the plan's V slice per CTA (``plan.block_dv``); 32, 64 or 128 forces that
            width where K <= 128 (benchmarks).
        save_states: also return what the backward would otherwise recompute (``backward``'s ``states``): the
            per-chunk states and v_new, and kkt_solve's gamma and Ag.
        checked: the caller has run ``unsupported_reason`` on these inputs and it returned None (the public op's
            dispatcher does): skip running it again.

    Returns:
        (o [B, T, Hv, V] in q's dtype, final state [N, Hv, K, V] fp32 or None); with ``save_states`` also
        (h [saved_chunks(B, T, N), Hv, Kp, Vp], the state entering every chunk, and v_new [B T, Hv, Vp]), both in q's
        dtype at the kernel head dims Kp, Vp (``padded_head_dim``), then (gamma [B T, Hv] fp32, the chunk-local
        cumsum of g, and Ag [B T, Hv, 64] fp16, ``kkt_solve``'s); h's rows past the last chunk and the padded tail's
        rows of the others are 0.

    Raises:
        ValueError: inputs the kernels cannot take (``unsupported_reason``).
    """
    if not checked:
        reason = unsupported_reason(q, k, v, g, beta, initial_state, cu_seqlens)
        if reason is not None:
            raise ValueError(reason)
    B, Tn, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    Kp, Vp = padded_head_dim(K), padded_head_dim(V)
    if Tn == 0:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        ht = None
        if output_final_state:
            ht = (initial_state.to(torch.float32).clone() if initial_state is not None
                  else torch.zeros((N, Hv, K, V), dtype=torch.float32, device=q.device))
        if save_states:
            return (v.new_empty(v.shape), ht, q.new_empty((saved_chunks(B, Tn, N), Hv, Kp, Vp)),
                    q.new_empty((0, Hv, Vp)), q.new_empty((0, Hv), dtype=torch.float32),
                    q.new_empty((0, Hv, plan.CHUNK), dtype=torch.float16))
        return v.new_empty(v.shape), ht
    if (Kp, Vp) == (K, V):
        return _launch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       cu_seqlens, segment_chunks, block_v, save_states)
    # other head dims run zero-padded (see padded_head_dim); the scale stays the true K's
    pad = torch.nn.functional.pad
    scale = K ** -0.5 if scale is None else float(scale)
    h0 = None if initial_state is None else pad(initial_state.to(torch.float32), (0, Vp - V, 0, Kp - K))
    o, ht, *states = _launch(pad(q, (0, Kp - K)), pad(k, (0, Kp - K)), pad(v, (0, Vp - V)), g, beta, scale, h0,
                             output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, segment_chunks, block_v,
                             save_states)
    # the saved states stay at the kernel head dims: the backward pads its inputs the same way
    return o[..., :V].contiguous(), (None if ht is None else ht[:, :, :K, :V].contiguous()), *states


def _token_rows(x: torch.Tensor, rows: int, Hv: int) -> torch.Tensor:
    """g or beta as the [B T, Hv] fp32 rows the kernels read: a view where it already is one."""
    if x.dtype == torch.float32 and x.is_contiguous():
        return x.view(rows, Hv)
    return x.reshape(rows, Hv).to(torch.float32).contiguous()


@functools.cache
def _stages():
    # imported on the first launch (they import tilelang), then kept: an import statement per call costs microseconds
    # of host time on a path whose small calls are host-bound
    from flashqla_kernels.gated_delta_rule.hopper import chunk_fwd, kkt_solve, layout, segment_states, state_scan

    return chunk_fwd, kkt_solve, layout, segment_states, state_scan


def _launch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            segment_chunks, block_v, save_states=False):
    # inputs checked, T > 0
    chunk_fwd, kkt_solve, layout, segment_states, state_scan = _stages()
    B, Tn, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else float(scale)
    cu = tuple(range(0, B * Tn + 1, Tn)) if cu_seqlens is None else checks.host_offsets(cu_seqlens)
    N = len(cu) - 1
    # transformers' layer passes q, k, v as channel slices of its convolution's [B, C, T] buffer: one transposing
    # pass makes all three token-major (torch's strided copies run at about a fifth of its speed)
    q3, k3, v3 = layout.as_tokens_major(q, k, v)
    g3, b3 = _token_rows(g, B * Tn, Hv), _token_rows(beta, B * Tn, Hv)
    h0 = initial_state
    if h0 is not None and not (h0.dtype == torch.float32 and h0.is_contiguous()):
        h0 = h0.to(torch.float32).contiguous()

    bDV, pl, num_chunks = plan.forward_plan(cu, Hv, K, V, h0 is not None, q.device, segment_chunks, block_v)
    # l2norm inside the stages: kkt_solve writes the inverse norms, the others fold them into their row scalings
    gamma, ag, rn = kkt_solve.kkt_solve(k3, g3, b3, pl.chunks, Hv, q3 if use_qk_l2norm_in_kernel else None)
    if pl.segment_chunks:
        h_init = state_scan.state_scan(h0, *segment_states.segment_states(k3, v3, ag, gamma, b3, pl.maps, bDV=bDV,
                                                                          rn=rn),
                                       pl.seqs, pl.segs.shape[0])
    else:
        h_init = h0 if h0 is not None else torch.zeros((1, Hv, K, V), dtype=torch.float32, device=q.device)
    o = toolkit.empty((B * Tn, Hv, V), q.dtype, q.device)
    if cu[-1] < B * Tn:
        # a padded tail after the last sequence (FlashQLA's packed batches): no sequence reads it, its outputs are 0
        o[cu[-1]:].zero_()
    ht = toolkit.empty((N, Hv, K, V), torch.float32, q.device) if output_final_state else None
    states = None
    if save_states:
        states = (pl.seg_chunk0, toolkit.empty((saved_chunks(B, Tn, N), Hv, K, V), q.dtype, q.device),
                  toolkit.empty((B * Tn, Hv, V), q.dtype, q.device))
    chunk_fwd.chunk_fwd(q3, k3, v3, ag, gamma, b3, h_init, pl.segs, o, ht, scale=scale, bDV=bDV, rn=rn, states=states)
    if states is None:
        return o.view(B, Tn, Hv, V), ht
    # what no chunk writes is zeroed, as o's padded tail is: the op's outputs are the same on every run (opcheck
    # compares two), and no uninitialised memory is kept until the backward
    _, h, v_new = states
    if h.shape[0] > num_chunks:
        h[num_chunks:].zero_()
    if cu[-1] < B * Tn:
        for x in (v_new, gamma, ag):
            x[cu[-1]:].zero_()
    # gamma and Ag too: the backward skips its kkt_solve (they cost 132 bytes a token and value head)
    return o.view(B, Tn, Hv, V), ht, h, v_new, gamma, ag
