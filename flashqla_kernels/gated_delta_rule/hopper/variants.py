"""Kernel variants of the Hopper forward: which stage kernels the launcher wires (``forward.launch``).

A variant name joins parts with ``+``. ``base`` is the first verified path (``forward.chunk_gated_delta_rule_fwd``:
``prep`` + ``fused_fwd``); ``default`` (or "") is ``DEFAULT_VARIANT``, what runs when nothing is chosen. Parts:

    ws      fused stage warp-specialised (``fused_fwd_ws``: state / values / output warpgroups + TMA producer)
    ws16    as ws, with the W, Ag, Vd, Pg operands in fp16 when the inputs are bf16 (finer rounding, same speed)
    prep2   prep stage with K K^T shared across a GVA group and 2G warps per CTA (``prep_v2``)
    prep3   as prep2, with the hierarchical (16 x 16 blocks, then block merges) inverse instead of the 64-row
            substitution chain (``prep_v2`` with ``inverse="blocks"``; FLA's and FlashQLA's scheme)
    prep4   as prep3, with the block merges of the inverse as fp16 tensor-core products (``prep_tc``: prep3 was
            issue-bound on the shared-memory loads of its CUDA-core merges)
    wreg    with ws / ws16: W formed in registers and stored by one fragment copy (``fused_fwd_ws``'s
            ``w_in_registers``: no warpgroup barrier per element pair on the values warpgroup's chain)
    agp     "Ag from prep": prep2 / prep3 write Ag = Gamma * A0 * beta_col instead of A0, and the fused stage (ws16)
            and the segment maps multiply the tile as loaded (no per-chunk gating loop; the trace showed the output
            warpgroup spending ~40% of a chunk step on it)
    cpk     the context-parallel map stage finds where each map's H walk may start in the kernel (a shared-memory
            scan of the map's chunk totals) instead of the ~25 small torch ops of ``warmup_starts`` per call
    prs     with ws / ws16: Pg formed in the Q K^T accumulator's registers, the output GEMM reading it from there
            (wgmma with A in registers): no Pg tile, no element loop over shared memory
    bv32, bv64, bv128   force the V slice per CTA (the plan's rules were tuned on the base fused stage; the
            warp-specialised one holds one 512-thread CTA per SM, so wider slices and more segments may pay)

``DEFAULT_VARIANT = "ws16+prep4+wreg+agp+prs+cpk"`` (since the fifth session, 2026-11-30): on the H200 it passed
the whole GPU suite (rel-L2 vs float64 2.0e-3 o / 1.7e-3 state, the same as the prep3 default) and was faster on all
10 configs of benchmarks/results/gdn_forward.md: geomean 2.96x the anchor FLA times where the same run measured the
prep3 default at 2.45x, and 1.03x that run's FlashQLA. Its prep stage alone went from 0.376 to 0.170 ms on 16/32
8192x4 (the tensor-core merges). Before it, ``ws16+prep3+wreg+agp+prs+cpk`` (fourth session: agp + prs made the
fused stage 1.5-2.1x faster, cpk took 16/32 8192x1 from 1.19 to 0.38 ms), and before that ``ws16+prep2`` (the first
verified warp-specialised path); both stay selectable. Every warp-specialised variant takes 128-wide V slices where
the plan splits long sequences and Hv >= 16 (``plan.wide_slices_pay``: forcing ``bv128`` won exactly those rows on
the H200 and lost the others), ``bv*`` still forces a width.

Select per call (``variant=``) or process-wide with the environment variable FLASHQLA_KERNELS_VARIANT (read on every
call with ``variant=None``; ``base`` restores the first path). The context-parallel stages (``segment_states``,
``state_scan``) are the same in every variant (``segment_states`` reads the gated tile with ``agp`` and finds its walk
starts itself with ``cpk``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashqla_kernels.gated_delta_rule.hopper import forward

ENV_VAR = "FLASHQLA_KERNELS_VARIANT"
PARTS = ("ws", "ws16", "prep2", "prep3", "prep4", "wreg", "agp", "prs", "cpk", "bv32", "bv64", "bv128")
DEFAULT_VARIANT = "ws16+prep4+wreg+agp+prs+cpk"
# what benchmarks/gdn_forward.py --variants all and the GPU variant tests run beside the default: the first path, the
# two previous defaults, the default writing A0 instead of Ag (prep4 without agp), and the default with 128-wide
# slices everywhere. Measured and retired from this list on 2026-11-30 (benchmarks/README.md): ws, ws16, prep2,
# ws+prep2, ws16+prep2+bv128, ws16+prep3, ws16+prep2+wreg, ws16+prep3+wreg(+bv128), ws16+prep3+agp+prs,
# ws16+prep3+wreg+agp+prs(+bv128), ws16+prep3+wreg+agp+prs+cpk+bv128.
ALL_VARIANTS = ("base", "ws16+prep2", "ws16+prep3+wreg+agp+prs+cpk", "ws16+prep4+wreg+prs+cpk",
                "ws16+prep4+wreg+agp+prs+cpk+bv128")


@dataclass(frozen=True)
class Variant:
    """Parsed variant: which fused stage (``"base"``, ``"ws"``, ``"ws16"``), whether prep is ``prep_v2``, and a
    forced V slice per CTA (0: the plan's rule)."""

    fused: str = "base"
    prep2: bool = False
    block_v: int = 0
    inverse: str = "substitution"  # the grouped prep's inverse: "blocks" for prep3, "mma" for prep4
    w_in_registers: bool = False  # wreg
    a_gated: bool = False  # agp
    p_in_registers: bool = False  # prs
    starts_in_kernel: bool = False  # cpk

    @property
    def is_base(self) -> bool:
        """The first verified path: ``forward.chunk_gated_delta_rule_fwd`` itself."""
        return self.fused == "base" and not self.prep2 and not self.block_v and not self.starts_in_kernel


def parse_variant(name: str | None) -> Variant:
    """Parse ``"ws+prep2"``-style names; ``None`` reads FLASHQLA_KERNELS_VARIANT; unset, ``""`` and ``"default"``
    mean ``DEFAULT_VARIANT``; ``"base"`` the first verified path.

    Raises:
        ValueError: an unknown part, or both ws and ws16.
    """
    if name is None:
        name = os.environ.get(ENV_VAR, "")
    if name.strip() in ("", "default"):
        name = DEFAULT_VARIANT
    parts = [p.strip() for p in name.split("+") if p.strip() and p.strip() != "base"]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown Hopper kernel variant part(s) {unknown} in {name!r} (from variant= or {ENV_VAR}); "
                         f"expected 'default', 'base' or parts of {PARTS} joined by '+', e.g. 'ws+prep2'")
    fused = [p for p in parts if p in ("ws", "ws16")]
    if len(fused) > 1:
        raise ValueError(f"variant {name!r} names two fused stages {fused}; pick one of 'ws', 'ws16'")
    widths = [int(p[2:]) for p in parts if p.startswith("bv")]
    if len(widths) > 1:
        raise ValueError(f"variant {name!r} names two V slices {widths}; pick one")
    preps = [p for p in parts if p in ("prep2", "prep3", "prep4")]
    if len(preps) > 1:
        raise ValueError(f"variant {name!r} names two prep stages {preps}; pick one of 'prep2', 'prep3', 'prep4'")
    for part in ("wreg", "prs"):
        if part in parts and not fused:
            raise ValueError(f"variant {name!r}: {part} changes the warp-specialised fused stage; add 'ws' or 'ws16'")
    if "agp" in parts and (fused != ["ws16"] or not preps):
        raise ValueError(f"variant {name!r}: agp needs the grouped prep (prep2, prep3 or prep4) to write Ag and the fp16 "
                         f"operands of ws16 to multiply it; e.g. 'ws16+prep3+agp'")
    inverse = {"prep3": "blocks", "prep4": "mma"}.get(preps[0] if preps else "", "substitution")
    return Variant(fused=fused[0] if fused else "base", prep2=bool(preps),
                   block_v=widths[0] if widths else 0, inverse=inverse,
                   w_in_registers="wreg" in parts, a_gated="agp" in parts, p_in_registers="prs" in parts,
                   starts_in_kernel="cpk" in parts)


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, segment_chunks=None, variant=None):
    """``forward.chunk_gated_delta_rule_fwd`` with the stages of a kernel variant.

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
        segment_chunks: as ``forward.chunk_gated_delta_rule_fwd`` (q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta
        [B, T, Hv]; initial_state [N, Hv, K, V]). variant: a name for :func:`parse_variant`; None reads
        FLASHQLA_KERNELS_VARIANT.

    Returns:
        (o [B, T, Hv, V] in q's dtype, final state [N, Hv, K, V] fp32 or None).
    """
    var = parse_variant(variant)
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                  segment_chunks=segment_chunks)
    Tn = k.shape[1]
    if var.is_base or Tn == 0:
        return forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kwargs)
    reason = forward.unsupported_reason(q, k, v, g, beta, initial_state, cu_seqlens)
    if reason is not None:
        raise ValueError(reason)
    return _run(var, q, k, v, g, beta, **kwargs)


def _run(var: Variant, q, k, v, g, beta, **kwargs):
    # forward's wiring with the stage functions swapped (every variant must equal the float64 reference on the GPU suite)
    return forward.launch(q, k, v, g, beta, **kwargs, prep_fn=prep_fn(var), fused_fn=fused_fn(var, q.dtype),
                          segment_fn=segment_fn(var), block_v=var.block_v, wide_cp=var.fused != "base")


def prep_fn(var: Variant):
    """The prep stage launcher of a variant (``prep.prep``, ``prep_v2.prep_v2`` or ``prep_tc.prep_tc``; same
    contract)."""
    if var.inverse == "mma":
        from flashqla_kernels.gated_delta_rule.hopper.prep_tc import prep_tc

        return lambda *args: prep_tc(*args, gated=var.a_gated)
    if var.prep2:
        from flashqla_kernels.gated_delta_rule.hopper.prep_v2 import prep_v2

        if var.inverse != "substitution" or var.a_gated:
            return lambda *args: prep_v2(*args, inverse=var.inverse, gated=var.a_gated)
        return prep_v2
    from flashqla_kernels.gated_delta_rule.hopper.prep import prep

    return prep


def fused_fn(var: Variant, dtype: torch.dtype):
    """The fused stage launcher of a variant for inputs of ``dtype`` (same contract as ``fused_fwd.fused_fwd``)."""
    if var.fused == "base":
        from flashqla_kernels.gated_delta_rule.hopper.fused_fwd import fused_fwd

        return fused_fwd
    from flashqla_kernels.gated_delta_rule.hopper.fused_fwd_ws import fused_fwd_ws

    inner = "float16" if var.fused == "ws16" and dtype == torch.bfloat16 else ""
    return lambda *a, **kw: fused_fwd_ws(*a, **kw, inner=inner, w_in_registers=var.w_in_registers,
                                         a_gated=var.a_gated, p_in_registers=var.p_in_registers)


def segment_fn(var: Variant):
    """The context-parallel map stage of a variant (``segment_states.segment_states``; reads Ag with ``agp``, finds
    the walk starts itself with ``cpk``)."""
    from flashqla_kernels.gated_delta_rule.hopper import segment_states

    if var.a_gated or var.starts_in_kernel:
        return lambda *a, **kw: segment_states.segment_states(*a, **kw, a_gated=var.a_gated,
                                                              starts_in_kernel=var.starts_in_kernel)
    return segment_states.segment_states
