"""Which chunk kernels a run compiles: the precompile list the benchmarks share (``gdn_forward.py``,
``collect_throughput.py``, ``layer_kernels.py``), by stage name, with the argument tuples exactly as the launchers
pass them to ``compile_kernel`` (a carried TileLang cache only hits on identical arguments; a CPU test compares the
two).
"""
from __future__ import annotations

import time

STAGES = ("kkt_solve", "chunk_fwd", "segment_states", "state_scan", "layout")


def chunk_specs(layouts, sms, *, scale=None, final=(True,), scans=True, widths=()):
    """(stage, builder args) of the chunk kernels the launcher compiles on ``layouts`` ``(Hk, Hv, K, dtype, N
    sequences[, l2norm])`` with K = V: every V slice the plan may pick for them on ``sms`` SMs, plus ``widths`` (V
    slices forced with the launcher's ``block_v``). ``scale`` (default K^-0.5) and ``final`` (store the final state or
    not) as the launcher passes them; ``l2norm`` (default False) as ``use_qk_l2norm_in_kernel``; ``scans``: also the
    state scans (with and without h0).
    """
    from flashqla_kernels.gated_delta_rule.hopper import plan

    specs = set()
    for layout in layouts:
        Hk, Hv, Kd, dt, N = layout[:5]
        l2 = bool(layout[5]) if len(layout) > 5 else False
        plan_bdv = plan.choose_block_v(N, Hv, Kd, Kd, sms)
        slices = {plan_bdv} | {min(Kd, w) for w in widths if Kd <= 128}
        if plan_bdv == 64 and Hv >= 16 and Kd == 128:
            # plan.wide_slices_pay: 128 where the sequences are split into segments
            slices.add(128)
        sc = float(Kd ** -0.5) if scale is None else float(scale)
        specs.add(("kkt_solve", (Hk, Hv, Kd, dt, l2)))
        # q, k, v made token-major in one pass when they arrive as transformers' channels-first slices
        specs.add(("layout", (Hk * Kd, Hv * Kd, dt)))
        for bdv in slices:
            specs.add(("segment_states", (Hk, Hv, Kd, Kd, bdv, dt, l2)))
            # no states saved for a backward (no grad)
            specs |= {("chunk_fwd", (Hk, Hv, Kd, Kd, bdv, dt, sc, fin, l2, False)) for fin in final}
        if scans:
            specs |= {("state_scan", (Hv, Kd, Kd, True)), ("state_scan", (Hv, Kd, Kd, False))}
    return sorted(specs)


def builder(stage: str):
    """The builder function of a stage named in :data:`STAGES`."""
    from flashqla_kernels.gated_delta_rule.hopper import chunk_fwd, kkt_solve, layout, segment_states, state_scan

    return {"kkt_solve": kkt_solve.build_kkt_solve, "chunk_fwd": chunk_fwd.build_chunk_fwd,
            "segment_states": segment_states.build_segment_states, "state_scan": state_scan.build_state_scan,
            "layout": layout.build_channels_first_to_tokens}[stage]


def build_one(spec):
    """Compile one (stage, args) spec; returns (spec, seconds, error text or None)."""
    from flashqla_kernels import toolkit

    t0 = time.time()
    try:
        toolkit.compile_kernel(builder(spec[0]), *spec[1])
        return spec, round(time.time() - t0, 1), None
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        return spec, round(time.time() - t0, 1), repr(e)[-500:]


def compile_all(specs, workers: int) -> list:
    """Compile ``specs`` on ``workers`` processes (``toolkit.compile_many``; TileLang's disk cache then serves the
    runs); returns the failures as (spec, error)."""
    from flashqla_kernels import toolkit

    names = {builder(stage): stage for stage in STAGES}
    return [((names[b], a), err) for b, a, err in toolkit.compile_many([(builder(s), a) for s, a in specs], workers)]
