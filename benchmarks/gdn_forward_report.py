"""The report of ``gdn_forward.py``: geomeans, the markdown tables, and joining runs over disjoint configs."""
from __future__ import annotations

import json
import math


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None



def merge(parts: list[dict], suite: list[tuple]) -> dict:
    """One result from runs over disjoint configs of the suite (same GPU model, commit and variants): rows in suite
    order, geomeans over all of them; each part's date, commit and ceilings kept under ``parts``.

    Raises:
        ValueError: the parts overlap, or differ in GPU, commit or variants.
    """
    for key in ("gpu", "commit", "variants"):
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
    lines = [
        "# Gated DeltaNet forward, " + r["gpu"],
        "",
        f"{r['date']} · commit {r['commit']} · " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        f"Ceilings measured in this run: bf16 matmul {r['bf16_matmul_tflops']:.0f} TFLOP/s, "
        f"copy {r['copy_tbps']:.2f} TB/s. Method: {r['method']}.",
        "",
        "| Hk/Hv | seqs | ours ms | FLA ms | FlashQLA ms | torch ms | x FLA | x FLA anchor | x FlashQLA | x FlashQLA anchor | bytes floor "
        "| FLOP floor | rel-L2 o / state vs fp64 | o vs FLA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        ms = x["ms"]
        lines.append(
            f"| {x['Hk']}/{x['Hv']} | {x['seqlen']}x{x['nseq']} | {f(ms.get('ours'))} | {f(ms.get('fla'))} | "
            f"{f(ms.get('flashqla'))} | {f(ms.get('torch'), 1)} | {f(x['speedup_vs_fla'], 2)} | "
            f"{f(x['anchor_fla_ms'] / ms['ours'], 2)} | "
            f"{f(x['ratio_vs_flashqla'], 2)} | {f(x['anchor_flashqla_ms'] / ms['ours'], 2)} | "
            f"{f(x['bytes_floor_ms'])} | {f(x['flop_floor_ms'])} | "
            f"{x['rel_l2_o_vs_ref']:.1e} / {x['rel_l2_state_vs_ref']:.1e} | {f(x['rel_l2_o_vs_fla'] or 0, 4)} |")
    anchor = geomean([x["anchor_fla_ms"] / x["ms"]["ours"] for x in r["rows"]])
    qla_anchor = geomean([x["anchor_flashqla_ms"] / x["ms"]["ours"] for x in r["rows"]])
    lines += ["", f"Geomean speedup vs FLA: {f(r['geomean_speedup_vs_fla'], 2)}x (this run), {f(anchor, 2)}x against "
              f"the anchor FLA times of shared/reference/anchors-h200.md; vs FlashQLA: "
              f"{f(r['geomean_ratio_vs_flashqla'], 2)}x (this run), {f(qla_anchor, 2)}x against its anchors "
              "(>1 = ours faster).", ""]
    if len(r["rows"]) < r.get("configs_planned", len(r["rows"])):
        lines += [f"Partial run: {len(r['rows'])} of the {r['configs_planned']} planned configs finished within the "
                  "time limit.", ""]
    if r.get("note"):
        lines += [r["note"], ""]
    lines += variants_markdown(r)
    return "\n".join(lines)


def variants_markdown(r):
    """Per-variant table: ms, ratios to the anchor FLA and to this run's FlashQLA, errors vs fp64 and vs default."""
    names = [v for v in r.get("variants", []) if v != "default"]
    dropped = r.get("dropped_variants") or {}
    if not names and not dropped and not any(x.get("stages_ms") for x in r["rows"]):
        return []
    f = (lambda x, p=3: "-" if x is None else f"{x:.{p}f}")
    cols = ["default", *names]
    lines = ["## Kernel variants (hopper/variants.py)", "",
             "| Hk/Hv | seqs | " + " | ".join(f"{v} ms (x FLA anchor, x FlashQLA)" for v in cols)
             + " | rel-L2 o / state vs fp64 | o vs default |",
             "|---|---|" + "---|" * len(cols) + "---|---|"]
    for x in r["rows"]:
        var, qla = x["variants"], x["ms"].get("flashqla")
        cells = [f"{f(var[v]['ms'])} ({f(x['anchor_fla_ms'] / var[v]['ms'], 2)}, "
                 f"{f(qla / var[v]['ms'] if qla else None, 2)})" for v in cols]
        errs = ", ".join(f"{v} {var[v]['rel_l2_o_vs_ref']:.1e}/{var[v]['rel_l2_state_vs_ref']:.1e}"
                         + (" NaN" if var[v]["nan"] else "") for v in cols)
        diffs = ", ".join(f"{v} {var[v]['rel_l2_o_vs_default']:.1e}" for v in names) or "-"
        lines.append(f"| {x['Hk']}/{x['Hv']} | {x['seqlen']}x{x['nseq']} | " + " | ".join(cells)
                     + f" | {errs} | {diffs} |")
    lines.append("")
    for v in cols:
        fla = geomean([x["anchor_fla_ms"] / x["variants"][v]["ms"] for x in r["rows"]])
        qla = geomean([x["ms"]["flashqla"] / x["variants"][v]["ms"] for x in r["rows"] if x["ms"].get("flashqla")])
        lines.append(f"- {v}: geomean {f(fla, 2)}x the anchor FLA times, {f(qla, 2)}x this run's FlashQLA")
    for v, why in dropped.items():
        lines.append(f"- {v}: dropped before timing: {why}")
    staged = [x for x in r["rows"] if x.get("stages_ms")]
    if staged:
        lines += ["", "Stages alone, ms (prep / CP maps + scan / fused; bDV, segment chunks):", ""]
        for x in staged:
            cells = [f"{v} {st['prep']:.3f} / {st['cp']:.3f} / {st['fused']:.3f} ({st['bDV']}, {st['segment_chunks']})"
                     for v, st in x["stages_ms"].items()]
            lines.append(f"- {x['Hk']}/{x['Hv']} {x['seqlen']}x{x['nseq']}: " + "; ".join(cells))
    return lines + [""]
