"""Which chunk kernels a run compiles: the precompile list the benchmarks share (``gdn_forward.py``,
``collect_throughput.py``, ``gdn_layer.py``), by stage name, with the argument tuples exactly as the launchers pass them
to ``compile_kernel`` (a carried TileLang cache only hits on identical arguments; a CPU test compares the two).
"""
from __future__ import annotations

import os
import time


def variant_specs(variant_names, layouts, sms, *, scale=None, final=(True,), scans=True):
    """(stage, builder args) of the chunk kernels the variants launch on ``layouts`` ``(Hk, Hv, K, dtype, N
    sequences)`` (every V slice the plan may pick for them on ``sms`` SMs); ``scale`` (default K^-0.5) and ``final``
    (store the final state or not) as the launcher passes them. The collection and whole-model benchmarks take
    their chunk kernels from here too."""
    from flashqla_kernels.gated_delta_rule.hopper import plan, variants
    from flashqla_kernels.gated_delta_rule.hopper._common import trailing_flags

    forced = int(os.environ.get("FLASHQLA_KERNELS_BLOCK_V", "0"))
    parsed = [variants.parse_variant(v) for v in variant_names]
    specs = set()

    def add(var, Hk, Hv, Kd, dt, bdv, sc, final):
        # the argument tuples exactly as the launchers pass them (prep_v2 / prep_tc, fused_fwd_ws, segment_states)
        tail = (Hk, Hv, Kd, Kd, bdv, dt)
        if var.inverse == "mma":
            specs.add(("prep4", (Hk, Hv, Kd, dt) + ((True,) if var.a_gated else ())))
        else:
            prep_args = (Hk, Hv, Kd, dt) + ((var.inverse, True) if var.a_gated else
                                            (var.inverse,) if var.inverse != "substitution" else ())
            specs.add(("prep2" if var.prep2 else "prep", prep_args))
        if var.fused == "base":
            specs.add(("fused", (*tail, sc, final)))
        else:
            inner = "float16" if var.fused == "ws16" and dt == "bfloat16" else ""
            specs.add(("ws", (*tail, sc, final, inner) + trailing_flags(False, var.w_in_registers, var.a_gated,
                                                                var.p_in_registers)))
        specs.add(("segment", tail + trailing_flags(var.a_gated, var.starts_in_kernel)))

    for Hk, Hv, Kd, dt, N in layouts:
        plan_bdv = min(Kd, forced) if forced else plan.choose_block_v(N, Hv, Kd, Kd, sms)
        for var in parsed:
            widths = {min(Kd, var.block_v)} if var.block_v and Kd <= 128 else {plan_bdv}
            if var.fused != "base" and not forced and not var.block_v and plan_bdv == 64 and Hv >= 16 and Kd == 128:
                widths.add(128)  # plan.wide_slices_pay: 128 where the sequences are split into segments
            for bdv in widths:
                for fin in final:
                    add(var, Hk, Hv, Kd, dt, bdv, float(Kd ** -0.5) if scale is None else scale, fin)
        if scans:
            specs |= {("scan", (Hv, Kd, Kd, True)), ("scan", (Hv, Kd, Kd, False))}
    return sorted(specs)


_HOPPER = "flashqla_kernels.gated_delta_rule.hopper."
# stage name of a spec -> (module, builder)
STAGE_BUILDERS = {"prep": (_HOPPER + "prep", "build_prep"), "prep2": (_HOPPER + "prep_v2", "build_prep_v2"),
                  "prep4": (_HOPPER + "prep_tc", "build_prep_tc"), "fused": (_HOPPER + "fused_fwd", "build_fused_fwd"),
                  "ws": (_HOPPER + "fused_fwd_ws", "build_fused_fwd_ws"),
                  "segment": (_HOPPER + "segment_states", "build_segment_states"),
                  "scan": (_HOPPER + "state_scan", "build_state_scan")}


def build_one(spec):
    """Compile one (stage, args) spec; returns (spec, seconds, error text or None)."""
    import importlib

    from flashqla_kernels.gated_delta_rule.hopper import _common

    module, builder = STAGE_BUILDERS[spec[0]]
    t0 = time.time()
    try:
        _common.compile_kernel(getattr(importlib.import_module(module), builder), *spec[1])
        return spec, round(time.time() - t0, 1), None
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        return spec, round(time.time() - t0, 1), repr(e)[-500:]


def compile_all(specs, workers: int) -> list:
    """Compile ``specs`` on ``workers`` processes (TileLang's disk cache then serves the runs); returns the failures
    as (spec, error)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return [(spec, err) for spec, _, err in ex.map(build_one, specs) if err]
