"""The Hopper backward of the chunked gated delta rule: checks, recomputes what the forward did not keep, and runs
the backward stages (``chunk_bwd``'s docstring has the math of each):

    [l2norm fwd] -> kkt_solve -> states -> dh -> dqkwg -> wy (+ dg) -> gva [+ l2norm bwd]

or, for K, V <= 128 where ``WALK`` picks it, the dh, dqkwg and WY stages as one fused walk (``bwd_walk``):

    [l2norm fwd] -> kkt_solve -> states -> walk (dq, dk per value head, dv, dbeta, dg, dh0) -> gva [+ l2norm bwd]

Saved versus recomputed: the backward takes the forward's inputs (q, k, v, g, beta, h0) and recomputes the
normalised q / k. The per-chunk states h and v_new, gamma and X = Ag come from the forward when it saved them
(``states``: the forward's ``save_states``, which the custom op asks for under grad; the states' stores ride on the
forward's own step, gamma and Ag are its ``kkt_solve``'s outputs kept) and are otherwise recomputed (``kkt_solve``,
then ``chunk_fwd.chunk_states`` over the forward's plan and split). The public op reaches it through the custom op's
autograd formula (``custom_op.py``); ``tests/flashqla_kernels/test_hopper_bwd_gpu.py`` checks it on an sm_90 GPU.

Imports torch only; the stage modules (and tilelang) load on the first call. ``precompile()`` compiles every
specialisation the GPU test runs (``TESTED_LAYOUTS``), so TileLang's disk cache can be filled on a CPU machine.
"""
from __future__ import annotations

import torch

from flashqla_kernels.gated_delta_rule.hopper import forward, plan

# The fused walk (``bwd_walk``: every gradient in one walk per (walk, value head), nothing but the saved states read
# back) for K, V <= 128, instead of the dh, dqkwg and WY stages. None: where it measured faster
# (``plan.walk_pays``: enough sequences x value heads); True / False: always / never.
WALK: bool | None = None

# (Hk, Hv, K, V, dtype, use_qk_l2norm_in_kernel, has initial_state, has dht) of every case of the GPU test, all with
# the default scale K^-0.5
TESTED_LAYOUTS = (
    (16, 32, 128, 128, "bfloat16", True, True, True),
    (2, 4, 128, 128, "bfloat16", True, True, True),
    (1, 4, 128, 128, "bfloat16", False, True, False),
    (4, 4, 128, 128, "float16", True, False, True),
    (2, 4, 64, 64, "bfloat16", True, True, True),
    (2, 2, 256, 256, "bfloat16", False, True, True),
)


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, *, scale=None, initial_state=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False, segment_chunks=None, states=None):
    """Gradients of the chunked gated delta rule on the TileLang Hopper kernels (chunk size 64).

    Args:
        q, k: [B, T, Hk, K] bf16/fp16; v: [B, T, Hv, V] same dtype; g (raw log decay), beta: [B, T, Hv];
            do: [B, T, Hv, V] the gradient of o (any float dtype, read in q's); dht: [N, Hv, K, V] the gradient of
            the final state, or None (zeros). scale, initial_state [N, Hv, K, V] or None, cu_seqlens [N+1] or None,
            use_qk_l2norm_in_kernel: as the forward (``forward.chunk_gated_delta_rule_fwd``).
        segment_chunks: intra-card context parallelism of the sequential stages: None (default) picks by
            ``plan.choose_bwd_segment_chunks`` for the dh walk and by the forward's rule for the recomputed states,
            0 never splits, L > 0 forces L-chunk segments on both (tests, benchmarks).
        states: None (recompute them), or (h, v_new, gamma, Ag) as the forward returns them with ``save_states``
            on the same inputs: the per-chunk states, v_new and kkt_solve's outputs are then read instead of
            recomputed.

    Returns:
        (dq [B, T, Hk, K] in q's dtype, dk [B, T, Hk, K] in k's, dv [B, T, Hv, V] in v's, dg [B, T, Hv] in g's,
        dbeta [B, T, Hv] in beta's, dh0 [N, Hv, K, V] fp32 or None without initial_state). Tokens of a padded tail
        (after ``cu_seqlens[-1]``) get exactly 0.

    Raises:
        ValueError: inputs the kernels cannot take (``forward.unsupported_reason``), or do / dht of the wrong shape.

    Example:
        >>> dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, None, initial_state=h0,
        ...                                                         cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    """
    reason = forward.unsupported_reason(q, k, v, g, beta, initial_state, cu_seqlens)
    if reason is not None:
        raise ValueError(reason)
    B, Tn, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    Kp, Vp = forward.padded_head_dim(K), forward.padded_head_dim(V)
    if states is not None:
        got = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in states)
        want = ((B * Tn, Hv, Vp), (B * Tn, Hv), (B * Tn, Hv, plan.CHUNK))
        if (len(states) != 4 or not all(isinstance(x, torch.Tensor) for x in states) or states[0].dim() != 4
                or states[0].shape[0] < forward.saved_chunks(B, Tn, N) or tuple(states[0].shape[1:]) != (Hv, Kp, Vp)
                or got[1:] != want):
            raise ValueError(f"states must be the forward's (h, v_new, gamma, Ag) with save_states=True on these "
                             f"inputs: h [>= {forward.saved_chunks(B, Tn, N)}, {Hv}, {Kp}, {Vp}], then "
                             f"{', '.join(str(list(w)) for w in want)}; got {got}")
    if not isinstance(do, torch.Tensor) or do.shape != v.shape:
        raise ValueError(f"do must be the gradient of o, [B, T, Hv, V] = {tuple(v.shape)}; got "
                         f"{tuple(do.shape) if isinstance(do, torch.Tensor) else type(do).__name__}")
    if dht is not None and tuple(dht.shape) != (N, Hv, K, V):
        raise ValueError(f"dht must be [N, Hv, K, V] = {(N, Hv, K, V)}; got {tuple(dht.shape)} (None for zeros)")
    scale = K ** -0.5 if scale is None else float(scale)
    if Tn == 0:
        dh0 = None
        if initial_state is not None:
            dh0 = (dht.to(torch.float32).clone() if dht is not None
                   else torch.zeros((N, Hv, K, V), dtype=torch.float32, device=q.device))
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), dh0)
    if (Kp, Vp) == (K, V):
        return _launch(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                       segment_chunks, states)
    # other head dims run zero-padded, as in the forward: zero channels get and pass no gradient
    pad = torch.nn.functional.pad
    pad_state = (lambda x: None if x is None else pad(x.to(torch.float32), (0, Vp - V, 0, Kp - K)))
    dq, dk, dv, dg, dbeta, dh0 = _launch(
        pad(q, (0, Kp - K)), pad(k, (0, Kp - K)), pad(v, (0, Vp - V)), g, beta, pad(do, (0, Vp - V)),
        pad_state(dht), scale, pad_state(initial_state), cu_seqlens, use_qk_l2norm_in_kernel, segment_chunks, states)
    return (dq[..., :K].contiguous(), dk[..., :K].contiguous(), dv[..., :V].contiguous(), dg, dbeta,
            None if dh0 is None else dh0[:, :, :K, :V].contiguous())


def _launch(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, l2norm, segment_chunks=None, states=None):
    # inputs checked, T > 0, head dims the kernels take
    from flashqla_kernels.gated_delta_rule import checks
    from flashqla_kernels.gated_delta_rule.hopper import (
        bwd_dh, bwd_dqkwg, bwd_walk, bwd_wy, chunk_bwd, kkt_solve, layout,
    )

    B, Tn, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    cu = list(range(0, B * Tn + 1, Tn)) if cu_seqlens is None else checks.host_offsets(cu_seqlens)
    seq_chunks = plan.chunk_counts(tuple(cu))
    sms = plan.num_sms(q.device) if q.is_cuda else 0
    walk = bwd_walk.supported(K, V) and (plan.walk_pays(seq_chunks, Hv, sms) if WALK is None else WALK)
    L = segment_chunks
    if L is None:
        # the fused walk owns all of V; the dh walk a V slice
        L = plan.choose_bwd_segment_chunks(seq_chunks, Hv, 1 if walk else V // bwd_dh.block_v(K, V), sms)
    pl = plan.make_bwd_plan(tuple(cu), L, q.device)
    # the states are recomputed over the forward's own plan: its V slice and split rule (a forced segment_chunks
    # splits it the same way)
    bdv = plan.block_dv(seq_chunks, Hv, K, V, sms, segment_chunks)
    fL = segment_chunks if segment_chunks is not None else plan.choose_segment_chunks(seq_chunks, Hv, V // bdv, sms)
    fpl = plan.make_plan(cu, Hv, V // bdv, initial_state is not None, q.device, fL)
    chunks = pl.chunks
    # transformers' layer passes q, k, v as channel slices of its convolution's [B, C, T] buffer: one transposing
    # pass makes all three token-major (torch's strided copies run at about a fifth of its speed)
    q3, k3, v3 = layout.as_tokens_major(q, k, v)
    do3 = do.reshape(B * Tn, Hv, V).to(q.dtype).contiguous()
    g3 = g.reshape(B * Tn, Hv).to(torch.float32).contiguous()
    b3 = beta.reshape(B * Tn, Hv).to(torch.float32).contiguous()
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    dht = None if dht is None else dht.to(torch.float32).contiguous()

    qn, kn = q3, k3
    if l2norm:
        # normalised once for all stages (in q's dtype, as FLA's l2norm writes them); the factors serve the l2norm
        # backward at the end
        (qn, rq), (kn, rk) = chunk_bwd.l2norm_fwd(q3, chunks), chunk_bwd.l2norm_fwd(k3, chunks)
    if states is not None:
        gamma, ag = states[2], states[3]
    else:
        gamma, ag, _ = kkt_solve.kkt_solve(kn, g3, b3, chunks, Hv)
    if walk:
        h, v_new = saved_or_recomputed(states, kn, v3, ag, gamma, b3, h0, chunks.shape[0], fpl, bdv)
        d_end = dht if not pl.segment_chunks else segment_end_grads(qn, kn, v3, do3, ag, gamma, b3, dht, pl, scale)
        dq_v, dk_v, dv, dbeta, dg, dh0 = bwd_walk.bwd_walk(qn, kn, v3, do3, v_new, h, ag, gamma, b3, d_end, pl.walks,
                                                           scale=scale, store_dh0=h0 is not None)
        if dh0 is not None and pl.segment_chunks:
            dh0 = dh0.index_select(0, pl.first)
        dq = chunk_bwd.gva_bwd(dq_v, None, chunks, Hk, q.dtype, *((q3, rq) if l2norm else ()))
        dk = chunk_bwd.gva_bwd(dk_v, None, chunks, Hk, k.dtype, *((k3, rk) if l2norm else ()))
        return _finish(dq, dk, dv, dg, dbeta, dh0, cu, B, Tn, Hk, Hv, K, V, g, beta)
    h, v_new, dh, du, dh0 = sequential_stages(qn, kn, v3, do3, ag, gamma, b3, h0, dht, pl, scale, fpl, bdv, states)
    if bwd_dqkwg.grouped(K, V):
        # per key head: dq finished by dqkwg, dk by WY (both summed over the value heads on chip, no GVA pass)
        dq, dk_k, dw, dgp = bwd_dqkwg.bwd_dqkwg_group(qn, kn, v_new, do3, du, h, dh, gamma, chunks, scale=scale,
                                                      **(dict(xq=q3, rq=rq) if l2norm else {}))
        if cu[-1] < B * Tn:
            # the grouped WY kernel reads whole tiles: a padded tail's rows, which no kernel wrote, must be finite
            dw[cu[-1]:].zero_()
            du[cu[-1]:].zero_()
        dk, dv, dbeta, _, dg = bwd_wy.bwd_wy_group(kn, v3, b3, gamma, ag, dw, du, dgp, dk_k, chunks,
                                                   *((k3, rk) if l2norm else ()))
    else:
        dq_v, dk_v, dw, dgp = bwd_dqkwg.bwd_dqkwg(qn, kn, v_new, do3, du, h, dh, gamma, chunks, scale=scale)
        dk_wy, dv, dbeta, _, dg = bwd_wy.bwd_wy(kn, v3, b3, gamma, ag, dw, du, dgp, chunks)
        dq = chunk_bwd.gva_bwd(dq_v, None, chunks, Hk, q.dtype, *((q3, rq) if l2norm else ()))
        dk = chunk_bwd.gva_bwd(dk_v, dk_wy, chunks, Hk, k.dtype, *((k3, rk) if l2norm else ()))
    return _finish(dq, dk, dv, dg, dbeta, dh0, cu, B, Tn, Hk, Hv, K, V, g, beta)


def _finish(dq, dk, dv, dg, dbeta, dh0, cu, B, Tn, Hk, Hv, K, V, g, beta):
    if cu[-1] < B * Tn:
        # a padded tail is in no chunk: no kernel wrote it
        for x in (dq, dk, dv, dg, dbeta):
            x[cu[-1]:].zero_()
    return (dq.view(B, Tn, Hk, K), dk.view(B, Tn, Hk, K), dv.view(B, Tn, Hv, V),
            dg.view(B, Tn, Hv).to(g.dtype), dbeta.view(B, Tn, Hv).to(beta.dtype), dh0)


def sequential_stages(qn, kn, v3, do3, ag, gamma, b3, h0, dht, pl, scale, fpl, bdv, states=None):
    """The stages that walk sequences in order (``chunk_bwd``'s docstring): (h, v_new, dh, dv of v_new, dh0 or
    None). h and v_new are the forward's ``states`` or, without them, recomputed on the forward's step over the
    forward's plan ``fpl`` with V slices ``bdv`` (``recompute_states``); the dh walk runs per sequence or
    (``pl.segment_chunks``) per segment of ``pl``."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dh

    NC = pl.chunks.shape[0]
    h, v_new = saved_or_recomputed(states, kn, v3, ag, gamma, b3, h0, NC, fpl, bdv)
    if not pl.segment_chunks:
        dh, du, dh0 = bwd_dh.bwd_dh(qn, kn, do3, ag, gamma, dht, pl.walks, NC, scale=scale,
                                    store_dh0=h0 is not None)
        return h, v_new, dh, du, dh0
    d_end = segment_end_grads(qn, kn, v3, do3, ag, gamma, b3, dht, pl, scale)
    dh, du, d_start = bwd_dh.bwd_dh(qn, kn, do3, ag, gamma, d_end, pl.walks, NC, scale=scale,
                                    store_dh0=h0 is not None)
    return h, v_new, dh, du, (None if h0 is None else d_start.index_select(0, pl.first))


def saved_or_recomputed(states, kn, v3, ag, gamma, b3, h0, num_chunks, fpl, bdv):
    """(h [NC, Hv, K, V], v_new): the forward's saved ``states`` (its h has a row for every chunk its shape-only bound
    allows; the stages take exactly NC), or ``recompute_states``' when None."""
    if states is not None:
        return states[0][:num_chunks], states[1]
    return recompute_states(kn, v3, ag, gamma, b3, h0, num_chunks, fpl, bdv)


def segment_end_grads(qn, kn, v3, do3, ag, gamma, b3, dht, pl, scale):
    """The gradient of the state at the end of every segment of ``pl`` [W, Hv, K, V] fp32, exact: the maps M of the
    segments (``segment_states``), each segment's own start gradient c walked from zero (``bwd_dh`` without its
    outputs), and ``state_scan_bwd`` carrying dS_end[i - 1] = M_i^T dS_end[i] + c_i back from ``dht``."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dh, segment_states, state_scan

    K, V = kn.shape[2], v3.shape[2]
    _, ms, mstart = segment_states.segment_states(kn, v3, ag, gamma, b3, pl.maps, bDV=bwd_dh.block_v(K, V),
                                                  maps_only=True)
    _, _, c = bwd_dh.bwd_dh(qn, kn, do3, ag, gamma, None, pl.rest, pl.chunks.shape[0], scale=scale, store_dh0=True,
                            store_grads=False)
    return state_scan.state_scan_bwd(dht, c, ms, mstart, pl.rscan, pl.walks.shape[0])


def recompute_states(kn, v3, ag, gamma, b3, h0, num_chunks, fpl, bdv):
    """h [NC, Hv, K, V] and v_new [T, Hv, V] on the forward's warp-specialised step (``chunk_fwd.chunk_states``)
    over the forward's plan ``fpl`` with V slices ``bdv``, its context parallelism included (``segment_states`` +
    ``state_scan`` give each segment's start state, as in the forward)."""
    from flashqla_kernels.gated_delta_rule.hopper import chunk_fwd, segment_states, state_scan

    Hv, K, V = v3.shape[1], kn.shape[2], v3.shape[2]
    if fpl.segment_chunks:
        h_init = state_scan.state_scan(h0, *segment_states.segment_states(kn, v3, ag, gamma, b3, fpl.maps, bDV=bdv),
                                       fpl.seqs, fpl.segs.shape[0])
    else:
        h_init = h0 if h0 is not None else torch.zeros((1, Hv, K, V), dtype=torch.float32, device=kn.device)
    return chunk_fwd.chunk_states(kn, v3, ag, gamma, b3, h_init, fpl.segs, fpl.seg_chunk0, num_chunks, bDV=bdv)


def kernel_specs(Hk: int, Hv: int, K: int, V: int, dtype: str, l2norm: bool, has_h0: bool, has_dht: bool,
                 scale: float | None = None) -> list[tuple]:
    """The (builder, args) of every kernel ``chunk_gated_delta_rule_bwd`` compiles for one layout (kernel head dims
    K, V in 64 / 128 / 256; dtype "bfloat16" or "float16"; scale None = K^-0.5), with and without context
    parallelism, the states at every V slice the forward's plan may pick (recomputed, or saved by the forward's
    chunk kernel), and both of ``bwd_dqkwg.KERNELS``' paths
    (per value head: dqkwg, WY, the GVA pass; per key head: the grouped dqkwg and WY, K, V <= 128)."""
    from flashqla_kernels.gated_delta_rule.hopper import (
        bwd_dh, bwd_dqkwg, bwd_walk, bwd_wy, chunk_bwd, chunk_fwd, kkt_solve, layout, segment_states, state_scan,
    )

    scale = K ** -0.5 if scale is None else float(scale)
    bDV = bwd_dh.block_v(K, V)
    build_dh = bwd_dh.build_bwd_dh
    specs = [(chunk_bwd.build_l2norm_fwd, (Hk, K, dtype))] if l2norm else []
    specs += [
        # q, k, v arriving as transformers' channels-first slices (forward and backward)
        (layout.build_channels_first_to_tokens, (Hk * K, Hv * V, dtype)),
        (kkt_solve.build_kkt_solve, (Hk, Hv, K, dtype, False)),
        (build_dh, (Hk, Hv, K, V, bDV, dtype, scale, has_dht, has_h0, True)),
        (bwd_dqkwg.build_bwd_dqkwg, (Hk, Hv, K, V, dtype, scale)),
        (bwd_wy.build_bwd_wy, (Hk, Hv, K, V, dtype)),
        (chunk_bwd.build_gva_bwd, (Hk, Hv, K, dtype, l2norm, False)),
        (chunk_bwd.build_gva_bwd, (Hk, Hv, K, dtype, l2norm, True)),
    ]
    if K <= 128 and V <= 128:
        specs += [
            (bwd_dqkwg.build_bwd_dqkwg_group, (Hk, Hv, K, V, dtype, scale, l2norm)),
            (bwd_wy.build_bwd_wy_group, (Hk, Hv, K, V, dtype, l2norm)),
        ]
    if bwd_walk.supported(K, V):
        # the fused walk from dht (or zeros), and from the segments' end gradients
        # (both of ``bwd_walk.KERNELS``' kernels)
        specs += [(b, (Hk, Hv, K, V, dtype, scale, d, has_h0)) for d in sorted({has_dht, True})
                  for b in (bwd_walk.build_bwd_walk, bwd_walk.build_bwd_walk_ws)]
        # its dq and dk per value head arrive in the input dtype
        specs += [(chunk_bwd.build_gva_bwd, (Hk, Hv, K, dtype, l2norm, False, dtype))]
    specs += [
        # context parallelism of the dh walk: the maps, the reverse scan, the two passes
        (segment_states.build_segment_states, (Hk, Hv, K, V, bDV, dtype, False, True)),
        (build_dh, (Hk, Hv, K, V, bDV, dtype, scale, False, True, False)),
        (state_scan.build_state_scan, (Hv, K, V, has_dht, True)),
        (build_dh, (Hk, Hv, K, V, bDV, dtype, scale, True, has_h0, True)),
        # the start states of split segments (the forward's scan)
        (state_scan.build_state_scan, (Hv, K, V, has_h0)),
    ]
    for b in sorted({min(V, 32)} if K > 128 else {min(V, 64), min(V, 128)}):
        specs += [(chunk_fwd.build_chunk_states, (Hk, Hv, K, V, b, dtype)),
                  (segment_states.build_segment_states, (Hk, Hv, K, V, b, dtype, False))]
        # the forward under grad, saving the states for this backward (with and without the final state)
        specs += [(chunk_fwd.build_chunk_fwd, (Hk, Hv, K, V, b, dtype, scale, fin, l2norm, True))
                  for fin in (True, False)]
    return specs


def precompile(layouts=TESTED_LAYOUTS, workers: int = 1) -> int:
    """Compile every backward kernel of ``layouts`` (default: the GPU test's) into TileLang's disk cache, on
    ``workers`` processes (``toolkit.compile_many``); needs nvcc, no GPU. Returns the number of distinct kernels.

    Raises:
        RuntimeError: a kernel failed to compile (how many, and the first with its arguments and error).

    Example:
        >>> # TILELANG_CACHE_DIR=/path/to/cache python -c "from flashqla_kernels.gated_delta_rule.hopper import
        >>> #     backward; backward.precompile(workers=2)"
    """
    from flashqla_kernels import toolkit

    specs = {spec for layout in layouts for spec in kernel_specs(*layout)}
    failed = toolkit.compile_many(specs, workers)
    if failed:
        b, a, err = failed[0]
        raise RuntimeError(f"{len(failed)} of {len(specs)} backward kernels failed to compile; first: "
                           f"{b.__name__}{a}: {err}")
    return len(specs)
