"""Gated DeltaNet forward on an H200: ours (TileLang, sm_90a) vs FLA Triton vs FlashQLA 0.1.3 vs transformers' torch path.

The 10-config suite and method of ``shared/reference/anchors-h200.md``: packed B = 1 with cu_seqlens, q/k l2-normalised
randn bf16, v randn bf16, g = logsigmoid(randn)/16 fp32, beta = sigmoid(randn) fp32, h0 randn fp32, final state on;
the high-level call under torch.no_grad timed by ``triton.testing.do_bench`` (median, host overhead included).
Correctness first: every config is checked against the float64 reference on a shortened copy (same heads, same
code path decisions, <= 4096 tokens) and against FLA on the full inputs. Then the floor: bytes (each input read once,
each output written once) over the measured copy bandwidth, FLOPs over the measured bf16 matmul rate.

Usage (on the GPU machine): ``FLA_FLASH_QLA=0 python benchmarks/gdn_forward.py [--out benchmarks/results]``.
Writes ``gdn_forward.json`` and ``gdn_forward.md``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import itertools
import json
import math
import os
import subprocess
from pathlib import Path

os.environ["FLA_FLASH_QLA"] = "0"

import torch  # noqa: E402

# (Hk, Hv, tokens per sequence, sequences) — anchors-h200.md, in its order
SUITE = [(16, 32, 32768, 1), (16, 32, 8192, 4), (16, 32, 8192, 1), (16, 64, 32768, 1), (16, 64, 8192, 4),
         (2, 8, 32768, 1), (16, 16, 32768, 1), (16, 16, 2048, 1), (4, 16, 1024, 8), (16, 32, 4096, 16)]
ANCHOR_FLA_MS = [1.954, 1.962, 0.499, 3.462, 3.488, 0.941, 1.308, 0.438, 0.477, 3.973]
ANCHOR_QLA_MS = [0.690, 0.630, 0.306, 1.528, 1.225, 0.253, 0.396, 0.098, 0.103, 1.244]
K = V = 128
CHUNK = 64
# MMA work per (64-token chunk, value head), K = V = 128: K K^T, Q K^T, Ag W, Pg Vd (64x64x128 each) and
# K S, Q S, K^T Vn (64x128x128 each) -> 10.5 MFLOP.
FLOP_PER_CHUNK_HEAD = 4 * 2 * 64 * 64 * 128 + 3 * 2 * 64 * 128 * 128


def make_inputs(Hk, Hv, seqlen, nseq, seed=0, device="cuda"):
    g_ = torch.Generator(device=device).manual_seed(seed)
    T = seqlen * nseq

    def randn(*shape):
        return torch.randn(*shape, generator=g_, device=device)

    q = torch.nn.functional.normalize(randn(1, T, Hk, K), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(randn(1, T, Hk, K), dim=-1).to(torch.bfloat16)
    v = randn(1, T, Hv, V).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(randn(1, T, Hv)) / 16
    beta = torch.sigmoid(randn(1, T, Hv))
    h0 = randn(nseq, Hv, K, V)
    cu = torch.arange(0, T + 1, seqlen, dtype=torch.int32, device=device)
    return q, k, v, g, beta, h0, cu


def runners(q, k, v, g, beta, h0, cu, Hk, Hv, nseq):
    from flashqla_kernels.gated_delta_rule import hopper

    out = {"ours": lambda: hopper.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=None, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu)}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
        # one int64 copy made here: FLA caches its chunk indices on the cu_seqlens object, and a fresh tensor per
        # call would add a host sync to every call (the first recorded run did that; see the results note)
        cu64 = cu.long()
        out["fla"] = lambda: fla_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu64)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"FLA unavailable: {e!r}")
    try:
        from flash_qla import chunk_gated_delta_rule as qla_fn
        out["flashqla"] = lambda: qla_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    except Exception as e:  # noqa: BLE001
        print(f"FlashQLA unavailable: {e!r}")
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        T = q.shape[1] // nseq
        rep = Hv // Hk
        qd, kd = (x.view(nseq, T, Hk, K).repeat_interleave(rep, dim=2) for x in (q, k))
        vd, gd, bd = v.view(nseq, T, Hv, V), g.view(nseq, T, Hv), beta.view(nseq, T, Hv)
        out["torch"] = lambda: torch_chunk_gated_delta_rule(qd, kd, vd, gd, bd, initial_state=h0,
                                                            output_final_state=True)
    except Exception as e:  # noqa: BLE001
        print(f"transformers torch path unavailable: {e!r}")
    return out


def rel_l2(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def check_vs_reference(Hk, Hv, seqlen, nseq):
    """Ours vs the float64 reference on a shortened copy of the config (<= 4096 tokens, same head layout)."""
    from flashqla_kernels.gated_delta_rule import hopper
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    short = max(1, min(seqlen, 4096 // nseq))
    q, k, v, g, beta, h0, cu = make_inputs(Hk, Hv, short, nseq, seed=1)
    o, ht = hopper.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=h0,
                                              output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu)
    d = [x.double() for x in (q, k, v, g, beta, h0)]
    ro, rht = chunk_gated_delta_rule_ref(*d[:5], initial_state=d[5], output_final_state=True, cu_seqlens=cu)
    return rel_l2(o, ro), rel_l2(ht, rht), bool(o.isnan().any() or ht.isnan().any())


def ceilings():
    """Measured ceilings: bf16 8192^3 matmul (FLOP/s) and device-to-device copy (bytes read + written per s)."""
    import triton

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    x = torch.randn(1 << 28, device="cuda")
    y = torch.empty_like(x)
    cp = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * 8192 ** 3 / (mm * 1e-3), 2 * x.numel() * 4 / (cp * 1e-3)


def floor_ms(Hk, Hv, seqlen, nseq, flops_ceiling, bytes_ceiling):
    T = seqlen * nseq
    nbytes = 2 * T * Hk * K * 2 + 2 * T * Hv * V * 2 + 2 * T * Hv * 4 + 2 * nseq * Hv * K * V * 4
    chunks = nseq * math.ceil(seqlen / CHUNK)
    flops = chunks * Hv * FLOP_PER_CHUNK_HEAD
    return nbytes / bytes_ceiling * 1e3, flops / flops_ceiling * 1e3


def versions():
    vs = {"torch": torch.__version__}
    for name in ("triton", "tilelang", "fla-core", "flash-qla", "transformers"):
        try:
            vs[name] = md.version(name)
        except md.PackageNotFoundError:
            vs[name] = None
    return vs


def commit():
    if os.environ.get("GDN_COMMIT"):
        return os.environ["GDN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--skip-torch", action="store_true", help="do not time transformers' torch path")
    ap.add_argument("--render", metavar="JSON", help="only re-render the markdown table of a results JSON")
    args = ap.parse_args()
    if args.render:
        result = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return
    import triton

    flops_ceiling, bytes_ceiling = ceilings()
    rows = []
    with torch.no_grad():
        for i, (Hk, Hv, seqlen, nseq) in enumerate(SUITE):
            err_o, err_h, nan = check_vs_reference(Hk, Hv, seqlen, nseq)
            inputs = make_inputs(Hk, Hv, seqlen, nseq)
            fns = runners(*inputs, Hk, Hv, nseq)
            if args.skip_torch:
                fns.pop("torch", None)
            outs = {name: fn() for name, fn in fns.items()}
            vs_fla = rel_l2(outs["ours"][0], outs["fla"][0]) if "fla" in outs else None
            del outs
            ms = {}
            for name, fn in fns.items():
                rep = 20 if name == "torch" else 200
                ms[name] = triton.testing.do_bench(fn, warmup=10 if name == "torch" else 50, rep=rep,
                                                   return_mode="median")
            bfloor, ffloor = floor_ms(Hk, Hv, seqlen, nseq, flops_ceiling, bytes_ceiling)
            row = {"Hk": Hk, "Hv": Hv, "seqlen": seqlen, "nseq": nseq, "ms": ms,
                   "speedup_vs_fla": ms["fla"] / ms["ours"] if "fla" in ms else None,
                   "ratio_vs_flashqla": ms["flashqla"] / ms["ours"] if "flashqla" in ms else None,
                   "bytes_floor_ms": bfloor, "flop_floor_ms": ffloor, "rel_l2_o_vs_ref": err_o,
                   "rel_l2_state_vs_ref": err_h, "nan": nan, "rel_l2_o_vs_fla": vs_fla,
                   "anchor_fla_ms": ANCHOR_FLA_MS[i], "anchor_flashqla_ms": ANCHOR_QLA_MS[i]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    result = {
        "gpu": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "versions": versions(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(), "bf16_matmul_tflops": flops_ceiling / 1e12, "copy_tbps": bytes_ceiling / 1e12,
        "method": "packed B=1 + cu_seqlens, triton.testing.do_bench median, torch.no_grad, high-level call",
        "geomean_speedup_vs_fla": geomean([r["speedup_vs_fla"] for r in rows]),
        "geomean_ratio_vs_flashqla": geomean([r["ratio_vs_flashqla"] for r in rows]),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_forward.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (out / "gdn_forward.md").write_text(table)
    print(table)


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
    if r.get("note"):
        lines += [r["note"], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
