"""Where a chunk step of the warp-specialised fused stage spends its time, on the H200, from clock64 stamps.

Runs ``fused_fwd_ws.trace_step`` (the traced twin of the default fused kernel: same schedule, stamps at every
hand-off; and of its forms with the variant parts of ``KERNELS``) on benchmark-shaped inputs and prints, per
warpgroup, the median cycles between consecutive events over the steady-state steps, plus one step's timeline of all four warpgroups against the state
warpgroup's ``ready``. Also times the untraced stage on the same inputs, to show what the stamps cost.

Usage (on the GPU machine): ``python benchmarks/gdn_ws_trace.py [--configs 16,32,8192,4;16,32,32768,1] [--out DIR]``
-> ``gdn_ws_trace.{json,md}``. Precompile the traced kernels on a CPU box with ``--precompile`` (no GPU needed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

DEFAULT_CONFIGS = "16,32,8192,4;16,32,32768,1;16,16,4096,8"
K = V = 128
# traced forms of the ws16 fused stage: label -> fused_fwd_ws flags (agp also needs prep's gated output)
KERNELS = {
    "default": {},
    "wreg": {"w_in_registers": True},
    "wreg+agp+prs": {"w_in_registers": True, "a_gated": True, "p_in_registers": True},
}


def configs(text: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(x) for x in part.split(",")) for part in text.split(";") if part.strip()]


def stage_inputs(Hk: int, Hv: int, seqlen: int, nseq: int, bdv: int | None, gated: bool = False):
    """The fused stage's inputs for one benchmark config (prep run, segments planned as the launcher does)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gdn_forward import make_inputs  # noqa: E402 - the benchmark's input distributions

    from flashqla_kernels.gated_delta_rule.hopper import forward, plan, prep_v2, segment_states, state_scan

    q, k, v, g, beta, h0, cu = make_inputs(Hk, Hv, seqlen, nseq)
    Tn = q.shape[1]
    q3, k3, v3 = q.reshape(Tn, Hk, K), k.reshape(Tn, Hk, K), v.reshape(Tn, Hv, V)
    g3, b3 = g.reshape(Tn, Hv).float().contiguous(), beta.reshape(Tn, Hv).float().contiguous()
    offsets = plan.host_offsets(cu)
    bdv = bdv or forward.block_dv(len(offsets) - 1, Hv, K, V, q.device, wide_cp=True,
                                  seq_chunks=[-(-(e - s) // 64) for s, e in zip(offsets, offsets[1:])])
    pl = plan.make_plan(offsets, Hv, V // bdv, True, q.device)
    gamma, a0 = prep_v2.prep_v2(k3, g3, b3, pl.chunks, Hv, gated=gated)
    h_init = h0
    if pl.segment_chunks:
        hs, ms = segment_states.segment_states(k3, v3, a0, gamma, b3, pl, bDV=bdv, a_gated=gated)
        h_init = state_scan.state_scan(h0, hs, ms, pl.seqs, pl.segs.shape[0])
    return (q3, k3, v3, a0, gamma, b3, h_init, pl.segs), bdv, pl


def analyse(stamps: torch.Tensor, n_steps: int, clock_ghz: float) -> dict:
    """Median gaps (cycles and ns) between consecutive events per warpgroup over steps 4 .. n-4, and the timeline of
    the middle step against the state warpgroup's ``ready`` stamp."""
    from flashqla_kernels.gated_delta_rule.hopper.fused_fwd_ws import TRACE_NAMES

    lo, hi = min(4, n_steps - 1), max(min(4, n_steps - 1) + 1, min(n_steps, stamps.shape[2]) - 4)
    out = {"steps_used": [lo, hi], "gaps": {}, "timeline": {}}
    ready = stamps[0, 0]
    step = ready[lo + 1:hi] - ready[lo:hi - 1]
    out["per_step_cycles"] = float(step.median())
    mid = (lo + hi) // 2
    for wg, names in enumerate(TRACE_NAMES):
        s = stamps[wg, :len(names), lo:hi]
        gaps = {f"{names[e - 1]} -> {names[e]}": float((s[e] - s[e - 1]).median()) for e in range(1, len(names))}
        gaps[f"{names[-1]} -> next {names[0]}"] = float((stamps[wg, 0, lo + 1:hi + 1] - s[-1]).median())
        out["gaps"][("state", "values", "output", "producer")[wg]] = gaps
        out["timeline"][("state", "values", "output", "producer")[wg]] = {
            names[e]: float(stamps[wg, e, mid] - ready[mid]) for e in range(len(names))}
    out["ns_per_cycle"] = 1 / clock_ghz
    return out


def markdown(result: dict) -> str:
    lines = [f"# Warp-specialised fused stage, traced ({result['gpu']}, {result['date']})", "",
             f"commit {result['commit']}; SM clock {result['clock_ghz']:.2f} GHz; kernel variant {result['variant']}.",
             ""]
    for row in result["rows"]:
        a = row["analysis"]
        lines += [f"## Hk/Hv {row['Hk']}/{row['Hv']}, {row['seqlen']}x{row['nseq']} (bDV {row['bDV']}, "
                  f"{row['steps']} steps for CTA 0), kernel {row.get('kernel', 'default')}", "",
                  f"Stage alone: {row['stage_ms']:.3f} ms untraced, {row['traced_ms']:.3f} ms traced. Median step "
                  f"{a['per_step_cycles']:.0f} cycles = {a['per_step_cycles'] * a['ns_per_cycle'] / 1e3:.2f} us.", "",
                  "| warpgroup | gap | cycles |", "|---|---|---|"]
        for wg, gaps in a["gaps"].items():
            lines += [f"| {wg} | {name} | {c:.0f} |" for name, c in gaps.items()]
        lines += ["", "Timeline of the middle step (cycles after the state warpgroup's `ready`):", "",
                  "| warpgroup | events |", "|---|---|"]
        for wg, events in a["timeline"].items():
            lines.append(f"| {wg} | " + ", ".join(f"{n} {c:.0f}" for n, c in events.items()) + " |")
        lines.append("")
    return "\n".join(lines)


def precompile(cfgs) -> None:
    from flashqla_kernels.gated_delta_rule.hopper import _common, fused_fwd_ws, plan

    for Hk, Hv, seqlen, nseq in cfgs:
        bdv = plan.choose_block_v(nseq, Hv, K, V, 132)
        bdv = 128 if plan.wide_slices_pay(bdv, [-(-seqlen // 64)] * nseq, Hv, K, V, 132) else bdv
        for flags in KERNELS.values():
            on = [flags.get(f, False) for f in ("w_in_registers", "a_gated", "p_in_registers")]
            for trace in (True, False):  # the traced twin and the kernel timed beside it
                _common.compile_kernel(fused_fwd_ws.build_fused_fwd_ws, Hk, Hv, K, V, bdv, "bfloat16", K ** -0.5,
                                       False, "float16", *_common.trailing_flags(trace, *on))
    print(f"precompiled {2 * len(KERNELS) * len(cfgs)} kernels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="Hk,Hv,seqlen,nseq;... (benchmark shapes)")
    parser.add_argument("--bdv", type=int, default=0, help="force the V slice (0: the plan's)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--precompile", action="store_true", help="only compile the traced kernels (no GPU)")
    args = parser.parse_args()
    cfgs = configs(args.configs)
    if args.precompile:
        precompile(cfgs)
        return
    import triton

    from flashqla_kernels.gated_delta_rule.hopper import fused_fwd_ws

    clock_ghz = float(os.environ.get("SM_CLOCK_GHZ", "1.98"))  # H200 max SM clock (nvidia-smi clocks.max.sm)
    rows = []
    with torch.no_grad():
        for (Hk, Hv, seqlen, nseq), label in ((c, w) for c in cfgs for w in KERNELS):
            flags = KERNELS[label]
            (q3, k3, v3, a0, gamma, b3, h_init, segs), bdv, pl = stage_inputs(
                Hk, Hv, seqlen, nseq, args.bdv or None, gated=flags.get("a_gated", False))
            o = torch.empty_like(v3)
            kw = dict(scale=K ** -0.5, bDV=bdv, inner="float16", **flags)
            stage = triton.testing.do_bench(lambda: fused_fwd_ws.fused_fwd_ws(
                q3, k3, v3, a0, gamma, b3, h_init, segs, o, None, **kw), return_mode="median")
            traced = triton.testing.do_bench(lambda: fused_fwd_ws.trace_step(
                q3, k3, v3, a0, gamma, b3, h_init, segs, o, **kw), return_mode="median")
            stamps = fused_fwd_ws.trace_step(q3, k3, v3, a0, gamma, b3, h_init, segs, o, **kw)
            first = [int(x) for x in segs[0].tolist()]
            n_steps = -(-(first[1] - first[0]) // 64)
            row = {"Hk": Hk, "Hv": Hv, "seqlen": seqlen, "nseq": nseq, "bDV": bdv, "steps": n_steps, "kernel": label,
                   "stage_ms": stage, "traced_ms": traced, "analysis": analyse(stamps, n_steps, clock_ghz),
                   "stamps": stamps[:, :, :min(n_steps, stamps.shape[2])].tolist()}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "stamps"}), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": os.environ.get("QWEN_SCOPE_COMMIT", ""), "clock_ghz": clock_ghz,
        "variant": "ws16 fused stage: " + ", ".join(KERNELS), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gdn_ws_trace.json").write_text(json.dumps(result, indent=1))
    (args.out / "gdn_ws_trace.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
