"""The report of ``gdn_forward.py``: geomeans, the markdown tables, and joining runs over disjoint configs."""
from __future__ import annotations

import json
import math

# the timing process keeps about one CPU busy: a 1-minute load above this means another process shared the host
HOST_LOAD_SHARED = 2.0


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def merge(parts: list[dict], suite: list[tuple]) -> dict:
    """One result from runs over disjoint configs of the suite (same GPU model and commit): rows in suite order,
    geomeans over all of them; each part's date, commit and ceilings kept under ``parts``.

    Raises:
        ValueError: the parts overlap, or differ in GPU or commit.
    """
    for key in ("gpu", "commit"):
        if len({json.dumps(p[key]) for p in parts}) > 1:
            raise ValueError(f"cannot merge runs with different {key}: {[p[key] for p in parts]}")
    order = {cfg: i for i, cfg in enumerate(suite)}
    rows = sorted((r for p in parts for r in p["rows"]), key=lambda r: order[(r["Hk"], r["Hv"], r["seqlen"], r["nseq"])])
    keys = [(r["Hk"], r["Hv"], r["seqlen"], r["nseq"]) for r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the runs overlap: configs {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    result = dict(parts[0])
    result.update(rows=rows, configs_planned=sum(p["configs_planned"] for p in parts),
                  geomean_speedup_vs_fla=geomean([r["speedup_vs_fla"] for r in rows]),
                  geomean_ratio_vs_flashqla=geomean([r["ratio_vs_flashqla"] for r in rows]),
                  parts=[{k: p[k] for k in ("date", "commit", "bf16_matmul_tflops", "copy_tbps")} | {
                      "configs": [f"{r['Hk']}/{r['Hv']} {r['seqlen']}x{r['nseq']}" for r in p["rows"]]}
                      for p in parts],
                  method=parts[0]["method"] + f"; {len(parts)} processes on GPUs of one host, disjoint configs")
    return result


def markdown(r):
    f = (lambda x, p=3: "-" if x is None else f"{x:.{p}f}")
    floor = (f"bytes at {r.get('floor_tbps', 4.2):.1f} TB/s, MMA FLOPs at "
             f"{r.get('floor_tflops', 700):.0f} TFLOP/s")
    lines = [
        "# Gated DeltaNet forward, " + r["gpu"],
        "",
        f"{r['date']} · commit {r['commit']} · " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        f"Ceilings measured in this run: bf16 matmul {r['bf16_matmul_tflops']:.0f} TFLOP/s, "
        f"copy {r['copy_tbps']:.2f} TB/s. Method: {r['method']}. \"ours\" is the public "
        f"`flashqla_kernels.chunk_gated_delta_rule`; \"internal\" the Hopper launcher it dispatches to, called "
        f"directly. Physical floors: {floor}.",
        "",
        "| Hk/Hv | seqs | ours ms | internal ms | FLA ms | FlashQLA ms | torch ms | x FLA | x FLA anchor | x FlashQLA "
        "| x FlashQLA anchor | bytes floor | FLOP floor | rel-L2 o / state vs fp64 | o vs FLA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        ms = x["ms"]
        lines.append(
            f"| {x['Hk']}/{x['Hv']} | {x['seqlen']}x{x['nseq']} | {f(ms.get('ours'))} | {f(ms.get('internal'))} | "
            f"{f(ms.get('fla'))} | {f(ms.get('flashqla'))} | {f(ms.get('torch'), 1)} | {f(x['speedup_vs_fla'], 2)} | "
            f"{f(x['anchor_fla_ms'] / ms['ours'], 2)} | "
            f"{f(x['ratio_vs_flashqla'], 2)} | {f(x['anchor_flashqla_ms'] / ms['ours'], 2)} | "
            f"{f(x['bytes_floor_ms'])} | {f(x['flop_floor_ms'])} | "
            f"{x['rel_l2_o_vs_ref']:.1e} / {x['rel_l2_state_vs_ref']:.1e} | {f(x['rel_l2_o_vs_fla'], 4)} |")
    anchor = geomean([x["anchor_fla_ms"] / x["ms"]["ours"] for x in r["rows"]])
    qla_anchor = geomean([x["anchor_flashqla_ms"] / x["ms"]["ours"] for x in r["rows"]])
    this_run = "not timed" if r["geomean_speedup_vs_fla"] is None else f"{r['geomean_speedup_vs_fla']:.2f}x"
    lines += ["", f"Geomean speedup vs FLA: {this_run} (this run), {f(anchor, 2)}x against "
              f"the anchor FLA times of shared/reference/anchors-h200.md; vs FlashQLA: "
              f"{f(r['geomean_ratio_vs_flashqla'], 2)}x (this run), {f(qla_anchor, 2)}x against its anchors "
              "(>1 = ours faster).", ""]
    if len(r["rows"]) < r.get("configs_planned", len(r["rows"])):
        lines += [f"Partial run: {len(r['rows'])} of the {r['configs_planned']} planned configs finished within the "
                  "time limit.", ""]
    loads = [x["host_load"] for x in r["rows"] if "host_load" in x]
    if loads:
        busy = [f"{x['Hk']}/{x['Hv']} {x['seqlen']}x{x['nseq']}" for x in r["rows"]
                if x.get("host_load", 0) > HOST_LOAD_SHARED]
        lines += [f"Host load (1-minute average) while timing: {min(loads):.2f}-{max(loads):.2f} on "
                  f"{r.get('host_cpus', '?')} CPUs"
                  + (f"; above {HOST_LOAD_SHARED} (another busy process) on {', '.join(busy)}: the short rows there "
                     "may be host-bound by it." if busy else "."), ""]
    if r.get("note"):
        lines += [r["note"], ""]
    lines += stages_markdown(r)
    return "\n".join(lines)


def stages_markdown(r):
    """Each stage alone (``--stages``): kkt_solve / CP maps + scan / chunk_fwd ms, with the V slice and split."""
    staged = [x for x in r["rows"] if x.get("stages_ms")]
    if not staged:
        return []
    lines = ["Stages alone, ms (kkt_solve / CP maps + scan / chunk_fwd; bDV, segment chunks):", ""]
    for x in staged:
        st = x["stages_ms"]
        lines.append(f"- {x['Hk']}/{x['Hv']} {x['seqlen']}x{x['nseq']}: {st['kkt_solve']:.3f} / {st['cp']:.3f} / "
                     f"{st['chunk_fwd']:.3f} ({st['bDV']}, {st['segment_chunks']})")
    profiled = [x for x in staged if x.get("kernels_ms")]
    if profiled:
        lines += ["", "Kernels of one public call, device ms (torch.profiler, internal; ours against FlashQLA's):", ""]
        for x in profiled:
            for name, kernels in x["kernels_ms"].items():
                parts = ", ".join(f"{k[:48]} {v:.3f}" for k, v in kernels.items())
                lines.append(f"- {x['Hk']}/{x['Hv']} {x['seqlen']}x{x['nseq']} {name} "
                             f"({sum(kernels.values()):.3f}): {parts}")
    return lines + [""]
