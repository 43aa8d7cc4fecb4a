"""Launch each forward stage once on a suite config, for Nsight Compute to read its hardware counters.

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section SchedulerStats \\
        --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis_Tables \\
        -k regex:gdn_ python3 benchmarks/ncu_stages.py --configs 0

``benchmarks/h200.sh ncu`` runs exactly that; ``NCU_FLASHQLA=1`` adds ``--flashqla`` (FlashQLA's forward launched on
the same inputs, its kernels profiled beside ours: the chunk stage is where the two differ most). Each stage runs as ``gdn_forward.stage_ms`` launches it (kkt_solve, the
context-parallel maps and scan where the plan splits, chunk_fwd), but once each instead of under do_bench, so the
profile holds a handful of launches. The counters say where a stage's time goes (issue, memory, barriers, shared-memory
bank conflicts); they are not timings of the op users call.
"""
import argparse

import torch

import gdn_forward


def once(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="0", help="comma-separated indices into gdn_forward.SUITE")
    ap.add_argument("--flashqla", action="store_true",
                    help="also launch FlashQLA's forward on each config (h200.sh NCU_FLASHQLA=1 profiles its kernels)")
    args = ap.parse_args()
    with torch.no_grad():
        for i in (int(c) for c in args.configs.split(",")):
            Hk, Hv, seqlen, nseq = gdn_forward.SUITE[i]
            q, k, v, g, beta, h0, cu = gdn_forward.make_inputs(Hk, Hv, seqlen, nseq)
            info = gdn_forward.stage_ms(q, k, v, g, beta, h0, cu, bench=once)
            print(f"config {i} ({Hk}/{Hv} {seqlen}x{nseq}): bDV {info['bDV']}, segment chunks "
                  f"{info['segment_chunks']}", flush=True)
            # FlashQLA's forward on the same inputs, once (after a first call that JIT-compiles it), so the profile
            # holds both libraries' kernels of the row side by side
            flashqla = gdn_forward.peer_runners(q, k, v, g, beta, h0, cu).get("flashqla")
            if flashqla is not None and args.flashqla:
                flashqla()
                once(flashqla)


if __name__ == "__main__":
    main()
