"""Gated DeltaNet forward + backward on an H200: the public ``flashqla_kernels.chunk_gated_delta_rule`` under grad
beside FLA and FlashQLA 0.1.3, in one run.

Configs: the 10-config suite of ``gdn_forward.py`` and the four fwd+bwd rows of ``shared/reference/anchors-h200.md``
(16/32 8192x1, 16/32 32768x1, 4/8 32768x1, 16/32 4096x8); inputs as ``gdn_forward.make_inputs`` (packed, cu_seqlens)
with q, k, v, g, beta and h0 requiring grad. Timed call (``triton.testing.do_bench`` median, grads reset between
calls): the op, then ``torch.autograd.backward`` of (o, final state) with fixed random cotangents. Correctness first:
each arm's gradients against FLA's on the full inputs (relative L2 per gradient). Floor per row: bytes (inputs and
the cotangents read, outputs and gradients written, once) at 4.2 TB/s, and three times the forward's MMA FLOPs
(a backward does about twice a forward's) at 700 TFLOP/s.

FlashQLA 0.1.3's backward kernel fails tilelang 0.1.15's buffer-initialisation check; its kernels are built here with
the pass config ``tl.disable_buffer_init_check`` on (``--no-qla-fix`` leaves tilelang as it is).

Usage (GPU): ``python benchmarks/gdn_backward.py --out benchmarks/results`` writes ``gdn_backward.json`` and ``.md``
after every row; ``--configs 0,7`` narrows the suite, ``--rows suite|anchors|all``. ``--stages`` adds the backward's
stages alone (internal), the sequential ones also at each segment length of ``BWD_SEGMENT_SWEEP`` (the split rule's
inputs); ``--ab`` the public op with each of ``AB_ARMS``' backward defaults changed. ``--precompile-only`` (no GPU)
builds the backward kernels of the chosen rows into TileLang's cache (``benchmarks/precompile_h200.sh`` calls it;
the forward's come from ``gdn_forward.py --precompile``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ["FLA_FLASH_QLA"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gdn_forward as fwd  # noqa: E402 - the suite, inputs, floors and the environment report

ANCHOR_ROWS = [(16, 32, 8192, 1), (16, 32, 32768, 1), (4, 8, 32768, 1), (16, 32, 4096, 8)]
ANCHOR_FWD_BWD_MS = {(16, 32, 8192, 1): (3.125, 1.553), (16, 32, 32768, 1): (8.684, 3.106),
                     (4, 8, 32768, 1): (3.907, 1.813), (16, 32, 4096, 8): (8.743, 3.001)}  # (FLA, FlashQLA)


def force_qla_buffer_init_fix() -> None:
    """Every ``tilelang.jit`` built after this call compiles with ``tl.disable_buffer_init_check`` on (FlashQLA's
    backward reads a fragment that tilelang 0.1.15's check believes unwritten). Call before importing flash_qla."""
    import tilelang

    original = tilelang.jit

    def jit(func=None, **kwargs):
        kwargs["pass_configs"] = {**(kwargs.get("pass_configs") or {}), "tl.disable_buffer_init_check": True}
        return original(func, **kwargs) if func is not None else original(**kwargs)

    tilelang.jit = jit


def warm_flashqla(rows, workers: int, fix: bool = True) -> None:
    """FlashQLA's forward + backward once per row on ``workers`` spawned processes, so its TileLang JIT kernels compile
    side by side into the disk cache the timed run reads (one at a time inside the run, they took the whole phase
    before the first row). FlashQLA has no autotune: its timings are unaffected."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        errors = [e for e in ex.map(_warm_flashqla_one, rows, [fix] * len(rows)) if e]
    print(f"FlashQLA fwd+bwd warm-up: {len(rows) - len(errors)} of {len(rows)} rows in {time.time() - t0:.0f} s on "
          f"{workers} processes", flush=True)
    for e in errors:
        print(f"  FlashQLA warm-up failed: {e}", flush=True)


def _warm_flashqla_one(row, fix: bool) -> str | None:
    try:
        if fix:
            force_qla_buffer_init_fix()
        from flash_qla import chunk_gated_delta_rule as qla_fn

        q, k, v, g, beta, h0, cu = fwd.make_inputs(*row)
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = qla_fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu)
        torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the run times FlashQLA (or reports it) itself
        return f"{row}: {e!r}"[:300]
    return None


def arms(q, k, v, g, beta, h0, cu) -> dict:
    """The public op as users call it, then FLA's and FlashQLA's (``gdn_forward.peer_runners``)."""
    return {"ours": fwd.ours_fn(q, k, v, g, beta, h0, cu), **fwd.peer_runners(q, k, v, g, beta, h0, cu)}


# --ab: the public call again with one backward default changed for the step (module, attribute, value), each an
# arm beside "ours" (the defaults as shipped); an arm equal to the defaults is skipped
AB_ARMS = {
    "ours_per_value_head": ("bwd_dqkwg", "KERNEL", "blocked"),
    "ours_recomputed_states": ("custom_op", "SAVE_STATES", False),
    "ours_walk": ("backward", "WALK", True),
    "ours_staged": ("backward", "WALK", False),
    "ours_walk_ws": ("bwd_walk", "KERNEL", "ws"),
}


def ab_module(name: str):
    """The module an ``AB_ARMS`` entry names."""
    from flashqla_kernels.gated_delta_rule.hopper import backward, bwd_dqkwg, bwd_walk, custom_op

    return {"backward": backward, "bwd_dqkwg": bwd_dqkwg, "bwd_walk": bwd_walk, "custom_op": custom_op}[name]


# --stages: the segment lengths (chunks) the sequential stages are also timed at (0: whole sequences)
BWD_SEGMENT_SWEEP = (0, 16, 32, 64, 128, 256)
DH_NARROW = "dh walk, bDV=32"


def fwd_bwd(fn, do, dht, override=None):
    """One forward + backward through ``fn`` (the op, then the backward of (o, final state)); ``override``: an
    ``AB_ARMS`` entry set for this step only (the public op's backward reads the module defaults)."""
    if override is not None:  # looked up once, outside the timed step
        module, attr, value = override
        module = ab_module(module)

    def step():
        if override is None:
            o, ht = fn()
            torch.autograd.backward([o, ht], [do, dht])
            return
        prev = getattr(module, attr)
        setattr(module, attr, value)
        try:
            o, ht = fn()
            torch.autograd.backward([o, ht], [do, dht])
        finally:
            setattr(module, attr, prev)
    return step


def rel_l2(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def floor_ms(Hk, Hv, seqlen, nseq) -> tuple[float, float]:
    T, N = seqlen * nseq, nseq
    K, V = fwd.K, fwd.V
    inputs = T * (2 * Hk * K + Hv * V) * 2 + T * Hv * 8 + N * Hv * K * V * 4
    cotangents = T * Hv * V * 2 + N * Hv * K * V * 4
    nbytes = 2 * inputs + cotangents + T * Hv * V * 2 + N * Hv * K * V * 4
    flops = 3 * nseq * math.ceil(seqlen / fwd.CHUNK) * Hv * fwd.FLOP_PER_CHUNK_HEAD
    return nbytes / fwd.FLOOR_BYTES_PER_S * 1e3, flops / fwd.FLOOR_FLOP_PER_S * 1e3


def stage_ms(q, k, v, g, beta, h0, cu, do, dht) -> dict:
    """Internal: medians (ms) of the Hopper backward's stages on these inputs, each launched alone on the others'
    outputs, in the launcher's order. Not the user's number: that is the "ours" column."""
    import triton.testing

    from flashqla_kernels.gated_delta_rule import checks
    from flashqla_kernels.gated_delta_rule.hopper import (
        backward, bwd_dh, bwd_dqkwg, bwd_walk, bwd_wy, chunk_bwd, kkt_solve, plan,
    )

    Hk, Kd = q.shape[2], q.shape[3]
    Hv, Vd = v.shape[2], v.shape[3]
    q3, k3, v3, do3 = q[0].detach(), k[0].detach(), v[0].detach(), do[0]
    g3, b3 = g[0].detach().float().contiguous(), beta[0].detach().float().contiguous()
    h0, scale = h0.detach(), Kd ** -0.5
    cu_host = checks.host_offsets(cu)
    seq_chunks = plan.chunk_counts(cu_host)
    sms = plan.num_sms(q.device)
    # the launcher's plans: the dh walk's split, and the forward's plan the states are recomputed over
    L = plan.choose_bwd_segment_chunks(seq_chunks, Hv, Vd // bwd_dh.block_v(Kd, Vd), sms)
    pl = plan.make_bwd_plan(tuple(cu_host), L, q.device)
    bdv = plan.block_dv(seq_chunks, Hv, Kd, Vd, sms)
    fpl = plan.make_plan(cu_host, Hv, Vd // bdv, True, q.device,
                         plan.choose_segment_chunks(seq_chunks, Hv, Vd // bdv, sms))
    chunks = pl.chunks
    NC = chunks.shape[0]
    bench = (lambda fn: float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")))
    gamma, ag, _ = kkt_solve.kkt_solve(k3, g3, b3, chunks, Hv)

    def sequential(plan_=pl):
        return backward.sequential_stages(q3, k3, v3, do3, ag, gamma, b3, h0, dht, plan_, scale, fpl, bdv)

    # the dh walk's split, swept (plan.choose_bwd_segment_chunks picks one); "-" where a sequence is not longer
    sweep = {}
    for seg in BWD_SEGMENT_SWEEP:
        name = f"states + dh, L={seg}"
        sweep[name] = "-" if seg >= max(seq_chunks) else bench(
            lambda seg=seg: sequential(plan.make_bwd_plan(tuple(cu_host), seg, q.device)))

    h, v_new, dh, du, _ = sequential()
    dq_v, dk_v, dw, dgp = bwd_dqkwg.bwd_dqkwg(q3, k3, v_new, do3, du, h, dh, gamma, chunks, scale=scale)
    dk_wy = bwd_wy.bwd_wy(k3, v3, b3, gamma, ag, dw, du, dgp, chunks)[0]
    grouped = (bwd_dqkwg.bwd_dqkwg_group(q3, k3, v_new, do3, du, h, dh, gamma, chunks, scale=scale)
               if Kd <= 128 and Vd <= 128 else None)
    _, dk_k, dw_g, dgp_g = grouped if grouped is not None else (None,) * 4
    from flashqla_kernels.gated_delta_rule.hopper import forward

    qd, kd, vd, gd, bd = (x.detach() for x in (q, k, v, g, beta))
    walk = {}
    if bwd_walk.supported(Kd, Vd):
        # the fused walk on these states over its own split (one CTA a value head), its segments' exact end
        # gradients, and its GVA pass on the input-dtype partials
        wpl = plan.make_bwd_plan(tuple(cu_host), plan.choose_bwd_segment_chunks(seq_chunks, Hv, 1, sms), q.device)

        def ends():
            return backward.segment_end_grads(q3, k3, v3, do3, ag, gamma, b3, dht, wpl, scale)

        d_end = ends() if wpl.segment_chunks else dht

        def run_walk():
            return bwd_walk.bwd_walk(q3, k3, v3, do3, v_new, h, ag, gamma, b3, d_end, wpl.walks, scale=scale,
                                     store_dh0=True)

        dq_w, dk_w = run_walk()[:2]
        walk = {"walk segment_chunks": wpl.segment_chunks,
                "walk: segment end grads": bench(ends) if wpl.segment_chunks else 0.0,
                "walk": bench(run_walk),
                "walk: gva": bench(lambda: (chunk_bwd.gva_bwd(dq_w, None, wpl.chunks, Hk, q.dtype),
                                            chunk_bwd.gva_bwd(dk_w, None, wpl.chunks, Hk, q.dtype)))}
    return {
        **walk,
        "segment_chunks": L,
        # the forward as the custom op runs it under grad, without and with the states saved for the backward
        "forward": bench(lambda: forward.chunk_gated_delta_rule_fwd(qd, kd, vd, gd, bd, initial_state=h0,
                                                                    output_final_state=True, cu_seqlens=cu)),
        "forward, saving": bench(lambda: forward.chunk_gated_delta_rule_fwd(
            qd, kd, vd, gd, bd, initial_state=h0, output_final_state=True, cu_seqlens=cu, save_states=True)),
        "kkt_solve": bench(lambda: kkt_solve.kkt_solve(k3, g3, b3, chunks, Hv)),
        "states + dh": bench(sequential),
        **sweep,
        "states": bench(lambda: backward.recompute_states(k3, v3, ag, gamma, b3, h0, NC, fpl, bdv)),
        # one pass of the dh walk over the backward's walks (from zeros)
        "dh walk": bench(lambda: bwd_dh.bwd_dh(q3, k3, do3, ag, gamma, None, pl.walks, NC, scale=scale,
                                               store_dh0=False)),
        # the same walk on 32-wide V slices: twice the CTAs, half the work a step (for walks too few to fill the SMs)
        **({DH_NARROW: bench(lambda: bwd_dh.bwd_dh(q3, k3, do3, ag, gamma, None, pl.walks, NC, scale=scale,
                                                   store_dh0=False, block=32))}
           if bwd_dh.block_v(Kd, Vd) > 32 else {}),
        # the grouped kernels (the default for K <= 128) sum the value heads on chip: no GVA pass
        **({"dqkwg (group)": bench(lambda: bwd_dqkwg.bwd_dqkwg_group(
               q3, k3, v_new, do3, du, h, dh, gamma, chunks, scale=scale)),
            "wy (group)": bench(lambda: bwd_wy.bwd_wy_group(k3, v3, b3, gamma, ag, dw_g, du, dgp_g, dk_k, chunks))}
           if grouped is not None else {}),
        # the per-value-head path (K = 256, or KERNEL = "blocked")
        "dqkwg (blocked)": bench(lambda: bwd_dqkwg.bwd_dqkwg(q3, k3, v_new, do3, du, h, dh, gamma, chunks,
                                                             scale=scale)),
        "wy": bench(lambda: bwd_wy.bwd_wy(k3, v3, b3, gamma, ag, dw, du, dgp, chunks)),
        "gva": bench(lambda: (chunk_bwd.gva_bwd(dq_v, None, chunks, Hk, q.dtype),
                              chunk_bwd.gva_bwd(dk_v, dk_wy, chunks, Hk, q.dtype))),
    }


def run_row(cfg, stages=False, ab=(), skip=()) -> dict:
    import triton.testing

    Hk, Hv, seqlen, nseq = cfg
    q, k, v, g, beta, h0, cu = fwd.make_inputs(Hk, Hv, seqlen, nseq)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(v.shape, generator=gen, device="cuda").to(v.dtype)
    dht = torch.randn(h0.shape, generator=gen, device="cuda")
    row = {"Hk": Hk, "Hv": Hv, "seqlen": seqlen, "nseq": nseq, "ms": {}, "grad_rel_l2_vs_fla": {}}
    row["bytes_floor_ms"], row["flop_floor_ms"] = floor_ms(Hk, Hv, seqlen, nseq)
    grads = {}
    runs = {name: fn for name, fn in arms(q, k, v, g, beta, h0, cu).items() if name not in skip}
    if ab:
        runs.update({name: runs["ours"] for name, (module, attr, value) in AB_ARMS.items()
                     if name in ab and getattr(ab_module(module), attr) != value})
    for name, fn in runs.items():
        try:
            step = fwd_bwd(fn, do, dht, AB_ARMS.get(name))
            for x in leaves:
                x.grad = None
            step()
            grads[name] = [x.grad.detach().clone() for x in leaves]
            row["ms"][name] = float(triton.testing.do_bench(step, warmup=5, rep=50, grad_to_none=leaves,
                                                            return_mode="median"))
        except Exception as e:  # noqa: BLE001 - an arm that fails is reported in the row, the others still run
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "fla" in grads:
        names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
        for name, gs in grads.items():
            if name != "fla":
                row["grad_rel_l2_vs_fla"][name] = {n: rel_l2(a, b) for n, a, b in zip(names, gs, grads["fla"])}
    if stages and "ours" in row["ms"]:
        try:
            row["stages_ms"] = stage_ms(q, k, v, g, beta, h0, cu, do, dht)
        except Exception as e:  # noqa: BLE001 - internal detail; the row stands without it
            row.setdefault("errors", {})["stages"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if cfg in ANCHOR_FWD_BWD_MS:
        row["anchor_fla_ms"], row["anchor_flashqla_ms"] = ANCHOR_FWD_BWD_MS[cfg]
    ms = row["ms"]
    if "ours" in ms and "flashqla" in ms:
        row["ratio_vs_flashqla"] = ms["flashqla"] / ms["ours"]
    del q, k, v, g, beta, h0, grads
    torch.cuda.empty_cache()
    return row


def precompile(rows, workers: int = 1) -> int:
    """Compile the backward kernels of ``rows`` (bf16, K = V = 128, no l2norm, h0 and dht as ``run_row`` passes
    them) on ``workers`` processes; needs nvcc, no GPU. Returns the number of kernels."""
    from flashqla_kernels.gated_delta_rule.hopper import backward

    from flashqla_kernels import toolkit
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dh

    layouts = {(Hk, Hv, fwd.K, fwd.V, "bfloat16", False, True, True) for Hk, Hv, _, _ in rows}
    # --stages' narrow dh walk (from zeros, no dh0)
    extra = {(bwd_dh.build_bwd_dh, (Hk, Hv, fwd.K, fwd.V, 32, "bfloat16", fwd.K ** -0.5, False, False, True))
             for Hk, Hv in {(Hk, Hv) for Hk, Hv, _, _ in rows}}
    for builder, args, err in toolkit.compile_many(extra, workers):
        print(f"  FAILED {builder.__name__}{args}: {err.splitlines()[-1] if err else ''}", flush=True)
    return backward.precompile(sorted(layouts), workers) + len(extra)


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_backward.json").write_text(json.dumps(result, indent=1))
    e = result["env"]
    f = (lambda x, n=3: "-" if x is None else f"{x:.{n}f}")
    lines = [f"# Gated DeltaNet forward + backward ({e.get('gpu')}, {e.get('date')})", "",
             f"versions: {', '.join(f'{k} {v}' for k, v in e.items() if k not in ('gpu', 'date'))}. "
             "do_bench medians of the op plus the backward of (o, final state), ms.", "",
             "| Hk/Hv | seqs | FLA | FlashQLA | ours | x FlashQLA | floor (bytes / FLOP) | anchor FLA / FlashQLA | "
             "ours' grads vs FLA (max rel-L2) | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ms = r["ms"]
        worst = max(r["grad_rel_l2_vs_fla"].get("ours", {}).values(), default=None)
        anchor = (f"{r['anchor_fla_ms']:.3f} / {r['anchor_flashqla_ms']:.3f}" if "anchor_fla_ms" in r else "-")
        lines.append(f"| {r['Hk']}/{r['Hv']} | {r['seqlen']}x{r['nseq']} | {f(ms.get('fla'))} | "
                     f"{f(ms.get('flashqla'))} | {f(ms.get('ours'))} | {f(r.get('ratio_vs_flashqla'), 2)} | "
                     f"{r['bytes_floor_ms']:.3f} / {r['flop_floor_ms']:.3f} | {anchor} | {f(worst, 4)} | "
                     f"{'; '.join(f'{k}: {v}' for k, v in r.get('errors', {}).items())} |")
    ab_names = [n for n in AB_ARMS if any(n in r["ms"] for r in result["rows"])]
    if ab_names:
        lines += ["", "The same public call with one backward default changed (`" + "`, `".join(
            f"{n}: {m}.{a} = {v!r}" for n, (m, a, v) in AB_ARMS.items() if n in ab_names) + "`), ms:", "",
            "| Hk/Hv | seqs | ours | " + " | ".join(ab_names) + " |", "|---|---|---|" + "---|" * len(ab_names)]
        lines += [f"| {r['Hk']}/{r['Hv']} | {r['seqlen']}x{r['nseq']} | {f(r['ms'].get('ours'))} | "
                  + " | ".join(f(r["ms"].get(n)) for n in ab_names) + " |" for r in result["rows"]]
    ratios = [r["ratio_vs_flashqla"] for r in result["rows"] if r.get("ratio_vs_flashqla")]
    if ratios:
        lines += ["", f"Geomean x FlashQLA: {fwd.geomean(ratios):.3f} over {len(ratios)} rows."]
    staged = [r for r in result["rows"] if "stages_ms" in r]
    if staged:
        names = list(dict.fromkeys(n for r in staged for n in r["stages_ms"]))  # a row may lack a stage: "-"
        lines += ["", "Internal, not the user's number: the forward launcher as the custom op calls it under grad "
                  "(plain, and saving the states), then the backward's stages alone, ms (each launched on the others' "
                  "outputs).", "",
                  "| Hk/Hv | seqs | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        lines += [f"| {r['Hk']}/{r['Hv']} | {r['seqlen']}x{r['nseq']} | "
                  + " | ".join(f"{r['stages_ms'][n]:.3f}" if isinstance(r['stages_ms'].get(n), float)
                               else str(r['stages_ms'].get(n, "-")) for n in names) + " |" for r in staged]
    (out / "gdn_backward.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rows", choices=("suite", "anchors", "all"), default="all")
    parser.add_argument("--configs", default="", help="suite indices, e.g. 0,7 (default: all ten)")
    parser.add_argument("--budget-s", type=float, default=500.0, help="stop starting rows after this many seconds")
    parser.add_argument("--no-qla-fix", action="store_true", help="leave tilelang's buffer-init check as it is")
    parser.add_argument("--ab", nargs="?", const=",".join(AB_ARMS), default="",
                        help="also time the public op with AB_ARMS' backward defaults changed (all, or the listed "
                             "arms: --ab ours_walk)")
    parser.add_argument("--warm-flashqla", type=int, default=0, metavar="N",
                        help="compile FlashQLA's JIT kernels of the rows on N GPU processes before timing")
    parser.add_argument("--skip-fla", action="store_true",
                        help="leave FLA out (its Triton autotune takes minutes on a machine without its cache)")
    parser.add_argument("--precompile-only", action="store_true", help="build the rows' backward kernels and stop")
    parser.add_argument("--jobs", type=int, default=1, help="processes compiling kernels (--precompile-only)")
    parser.add_argument("--stages", action="store_true", help="also time the backward's stages alone (internal)")
    args = parser.parse_args(argv)
    unknown = sorted({a for a in args.ab.split(",") if a} - set(AB_ARMS))
    if unknown:
        parser.error(f"--ab names {unknown}; the arms are {sorted(AB_ARMS)}")
    if not args.no_qla_fix:
        force_qla_buffer_init_fix()
    suite = [fwd.SUITE[int(i)] for i in args.configs.split(",")] if args.configs else list(fwd.SUITE)
    rows = {"suite": suite, "anchors": ANCHOR_ROWS, "all": suite + [r for r in ANCHOR_ROWS if r not in suite]}
    if args.precompile_only:
        print(f"precompiled {precompile(rows[args.rows], args.jobs)} backward kernels", flush=True)
        return
    if args.warm_flashqla:
        warm_flashqla(rows[args.rows], args.warm_flashqla, fix=not args.no_qla_fix)
    began = time.perf_counter()
    import datetime

    result = {"env": {"gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), **fwd.versions(), "commit": fwd.commit()}, "rows": []}
    for cfg in rows[args.rows]:
        if time.perf_counter() - began > args.budget_s:
            print(f"past the {args.budget_s:.0f} s budget: {cfg} and later rows not run")
            break
        result["rows"].append(run_row(cfg, args.stages, [a for a in args.ab.split(",") if a],
                                      skip=("fla",) if args.skip_fla else ()))
        print(result["rows"][-1], flush=True)
        write(args.out, result)
    print((args.out / "gdn_backward.md").read_text())


if __name__ == "__main__":
    main()
