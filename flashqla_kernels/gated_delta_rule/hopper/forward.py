"""The Hopper forward: validates, plans, and runs the stages (prep -> [segment maps -> scan] -> fused output).

Imports torch only; the stage modules (and tilelang) are imported on the first call.
"""
from __future__ import annotations

import os

import torch

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Tests set this to fill outputs with NaN before the kernels run, to prove every element is written.
POISON_OUTPUTS = False


def unsupported_reason(q, k, v, g, beta, initial_state=None, cu_seqlens=None) -> str | None:
    """Why the Hopper kernels cannot run these inputs, or None when they can.

    Args:
        q, k: [B, T, Hk, K]; v: [B, T, Hv, V]; g, beta: [B, T, Hv]; initial_state: [N, Hv, K, V] or None;
        cu_seqlens: [N+1] or None.

    Returns:
        A sentence naming the offending input and the fix, or None.
    """
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if not all(isinstance(x, torch.Tensor) for x in tensors.values()):
        return "q, k, v, g, beta must all be torch.Tensor"
    if not all(x.is_cuda for x in tensors.values()):
        return "the Hopper kernels need CUDA tensors; got " + ", ".join(f"{n} on {x.device}" for n, x in tensors.items())
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        return f"the Hopper kernels need an sm_90 GPU; {torch.cuda.get_device_name(q.device)} is sm_{major}{minor}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        return f"q, k, v must share one dtype in (bfloat16, float16); got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dim() != 4 or v.dim() != 4 or k.shape != q.shape:
        return f"q, k must be [B, T, Hk, K] and v [B, T, Hv, V]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    K, V, Hk, Hv = k.shape[3], v.shape[3], k.shape[2], v.shape[2]
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS:
        return f"head dims K={K}, V={V} unsupported by the Hopper kernels (supported: {SUPPORTED_HEAD_DIMS})"
    if Hv % Hk:
        return f"Hv={Hv} must be a multiple of Hk={Hk}"
    if cu_seqlens is not None and q.shape[0] != 1:
        return f"cu_seqlens needs B=1 (packed sequences); got B={q.shape[0]}"
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        return f"g and beta must be [B, T, Hv] = {tuple(v.shape[:3])}; got {tuple(g.shape)}, {tuple(beta.shape)}"
    if initial_state is not None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if tuple(initial_state.shape) != (N, Hv, K, V):
            return f"initial_state must be [N, Hv, K, V] = {(N, Hv, K, V)}; got {tuple(initial_state.shape)}"
    return None


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _empty(shape, dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def block_dv(N: int, Hv: int, K: int, V: int, device: torch.device, *, seq_chunks: list[int] | None = None,
             segment_chunks: int | None = None, wide_cp: bool = False) -> int:
    """Width of the V slice one CTA owns (see ``plan.choose_block_v``; with ``wide_cp``, the warp-specialised fused
    stage's rule ``plan.wide_slices_pay`` on top, given ``seq_chunks``); FLASHQLA_KERNELS_BLOCK_V overrides it."""
    from flashqla_kernels.gated_delta_rule.hopper import plan

    forced = int(os.environ.get("FLASHQLA_KERNELS_BLOCK_V", "0"))
    if forced:
        return min(V, forced)
    sms = plan.num_sms(device)
    bdv = plan.choose_block_v(N, Hv, K, V, sms)
    if wide_cp and seq_chunks is not None and plan.wide_slices_pay(bdv, seq_chunks, Hv, K, V, sms, segment_chunks):
        return 128
    return bdv


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, segment_chunks=None):
    """Gated delta rule forward on the fused TileLang Hopper kernels (chunk size 64, exact).

    Args:
        q, k: [B, T, Hk, K] bf16/fp16; v: [B, T, Hv, V] same dtype; g (log decay), beta: [B, T, Hv] (any float dtype,
        computed in fp32). scale: default K^-0.5. initial_state: [N, Hv, K, V] or None. output_final_state: return the
        [N, Hv, K, V] fp32 final state. use_qk_l2norm_in_kernel: l2-normalise q and k first. cu_seqlens: [N+1] offsets
        of packed sequences (B = 1). segment_chunks: None picks intra-card context parallelism by a cost model,
        0 disables it, L > 0 forces L-chunk segments (tests and benchmarks).

    Returns:
        (o [B, T, Hv, V] in q's dtype, final state [N, Hv, K, V] fp32 or None).
    """
    reason = unsupported_reason(q, k, v, g, beta, initial_state, cu_seqlens)
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.gated_delta_rule.hopper import fused_fwd, prep

    B, Tn, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    if Tn == 0:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        ht = None
        if output_final_state:
            ht = (initial_state.to(torch.float32).clone() if initial_state is not None
                  else torch.zeros((N, Hv, K, V), dtype=torch.float32, device=q.device))
        return v.new_empty(v.shape), ht
    return launch(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                  segment_chunks=segment_chunks, prep_fn=prep.prep, fused_fn=fused_fwd.fused_fwd)


def launch(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
           segment_chunks, prep_fn, fused_fn, segment_fn=None, block_v: int | None = None, wide_cp: bool = False):
    """The stage wiring shared by the default launcher and the kernel variants (``variants.py``).

    Inputs are checked by the caller and T > 0. ``prep_fn`` / ``fused_fn`` / ``segment_fn`` follow the contracts of
    ``prep.prep``, ``fused_fwd.fused_fwd`` and ``segment_states.segment_states`` (None: that one); ``block_v`` forces
    the V slice per CTA (K <= 128 only); ``wide_cp``: the warp-specialised fused stage's slice rule (``block_dv``).
    """
    from flashqla_kernels.gated_delta_rule.hopper import plan, segment_states, state_scan

    B, Tn, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    cu = list(range(0, B * Tn + 1, Tn)) if cu_seqlens is None else plan.host_offsets(cu_seqlens)
    N = len(cu) - 1
    q3 = q.reshape(B * Tn, Hk, K).contiguous()
    k3 = k.reshape(B * Tn, Hk, K).contiguous()
    v3 = v.reshape(B * Tn, Hv, V).contiguous()
    g3 = g.reshape(B * Tn, Hv).to(torch.float32).contiguous()
    b3 = beta.reshape(B * Tn, Hv).to(torch.float32).contiguous()
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()

    bDV = block_dv(N, Hv, K, V, q.device, seq_chunks=[-(-(e - s) // 64) for s, e in zip(cu, cu[1:])],
                   segment_chunks=segment_chunks, wide_cp=wide_cp)
    if block_v and K <= 128:
        bDV = min(V, block_v)
    pl = plan.make_plan(cu, Hv, V // bDV, h0 is not None, q.device, segment_chunks)
    gamma, a0 = prep_fn(k3, g3, b3, pl.chunks, Hv)
    if pl.segment_chunks:
        hs, ms = (segment_fn or segment_states.segment_states)(k3, v3, a0, gamma, b3, pl, bDV=bDV)
        h_init = state_scan.state_scan(h0, hs, ms, pl.seqs, pl.segs.shape[0])
    else:
        h_init = h0 if h0 is not None else torch.zeros((1, Hv, K, V), dtype=torch.float32, device=q.device)
    o = _empty((B * Tn, Hv, V), q.dtype, q.device)
    ht = _empty((N, Hv, K, V), torch.float32, q.device) if output_final_state else None
    fused_fn(q3, k3, v3, a0, gamma, b3, h_init, pl.segs, o, ht, scale=scale, bDV=bDV)
    return o.view(B, Tn, Hv, V), ht
