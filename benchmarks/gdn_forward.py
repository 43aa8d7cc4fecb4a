"""Gated DeltaNet forward on an H200: ours (TileLang, sm_90a) vs FLA Triton vs FlashQLA 0.1.3 vs transformers' torch path.

The 10-config suite and method of ``shared/reference/anchors-h200.md``: packed B = 1 with cu_seqlens, q/k l2-normalised
randn bf16, v randn bf16, g = logsigmoid(randn)/16 fp32, beta = sigmoid(randn) fp32, h0 randn fp32, final state on;
the high-level call under torch.no_grad timed by ``triton.testing.do_bench`` (median, host overhead included).
"ours" is the public ``flashqla_kernels.chunk_gated_delta_rule`` exactly as users call it (dispatch included);
"internal" is the Hopper launcher it dispatches to, called directly. Correctness first: every config is checked
against the float64 reference on a shortened copy (same heads, same code path decisions, <= 4096 tokens) and against
FLA on the full inputs. Each row also prints the physical floor: the bytes moved (each input read once, each output
written once) at 4.2 TB/s and the MMA FLOPs at 700 TFLOP/s (the H200's practical HBM and dense bf16 rates).

Usage (on the GPU machine): ``FLA_FLASH_QLA=0 python benchmarks/gdn_forward.py [--out benchmarks/results]``.
Writes ``gdn_forward.json`` and ``gdn_forward.md``. ``--precompile N`` builds every kernel specialisation the run (and
the GPU tests) need on N processes first; with ``--precompile-only --sms 132`` it needs no GPU. ``--stages`` also
times each stage alone. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["FLA_FLASH_QLA"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunk_kernels import chunk_specs, compile_all  # noqa: E402
from gdn_forward_report import geomean, markdown, merge  # noqa: E402

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
# the physical floor's rates: H200 HBM3e bandwidth a copy reaches, dense bf16 tensor-core throughput
FLOOR_BYTES_PER_S = 4.2e12
FLOOR_FLOP_PER_S = 700e12


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


def ours_fn(q, k, v, g, beta, h0, cu):
    """The public op as users call it."""
    import flashqla_kernels

    return lambda: flashqla_kernels.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                           output_final_state=True, cu_seqlens=cu)


def internal_fn(q, k, v, g, beta, h0, cu):
    """The Hopper launcher the public op dispatches to, called directly (no input checks, no dispatch)."""
    from flashqla_kernels.gated_delta_rule.hopper import forward

    return lambda: forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      cu_seqlens=cu)


def peer_runners(q, k, v, g, beta, h0, cu) -> dict:
    """FLA's and FlashQLA's ops on the same inputs, each where importable."""
    out = {}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
        # one int64 copy made here: FLA caches its chunk indices on the cu_seqlens object, and a fresh tensor per
        # call would add a host sync to every call
        cu64 = cu.long()
        out["fla"] = lambda: fla_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu64)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"FLA unavailable: {e!r}")
    try:
        from flash_qla import chunk_gated_delta_rule as qla_fn
        out["flashqla"] = lambda: qla_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    except Exception as e:  # noqa: BLE001
        print(f"FlashQLA unavailable: {e!r}")
    return out


def runners(q, k, v, g, beta, h0, cu, Hk, Hv, nseq):
    out = {"ours": ours_fn(q, k, v, g, beta, h0, cu), "internal": internal_fn(q, k, v, g, beta, h0, cu),
           **peer_runners(q, k, v, g, beta, h0, cu)}
    try:
        import inspect

        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        # transformers (5.x) decorates the torch function to dispatch to FLA when FLA is importable: time the
        # function itself (its __wrapped__), not FLA a second time
        torch_chunk_gated_delta_rule = inspect.unwrap(torch_chunk_gated_delta_rule)
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
    """The public op vs the float64 reference on a shortened copy of the config (<= 4096 tokens, same head layout),
    outputs poisoned with NaN. Returns (rel-L2 o, rel-L2 final state, any NaN, the dispatcher's explanation)."""
    import flashqla_kernels
    from flashqla_kernels import toolkit
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    short = max(1, min(seqlen, 4096 // nseq))
    q, k, v, g, beta, h0, cu = make_inputs(Hk, Hv, short, nseq, seed=1)
    d = [x.double() for x in (q, k, v, g, beta, h0)]
    ro, rht = chunk_gated_delta_rule_ref(*d[:5], initial_state=d[5], output_final_state=True, cu_seqlens=cu)
    with toolkit.poisoned_outputs():
        o, ht = ours_fn(q, k, v, g, beta, h0, cu)()
    why = flashqla_kernels.explain_backend(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    return rel_l2(o, ro), rel_l2(ht, rht), bool(o.isnan().any() or ht.isnan().any()), why


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


def floor_ms(Hk, Hv, seqlen, nseq):
    """(bytes floor, FLOP floor) in ms: the bytes at FLOOR_BYTES_PER_S, the MMA FLOPs at FLOOR_FLOP_PER_S."""
    T = seqlen * nseq
    nbytes = 2 * T * Hk * K * 2 + 2 * T * Hv * V * 2 + 2 * T * Hv * 4 + 2 * nseq * Hv * K * V * 4
    flops = nseq * math.ceil(seqlen / CHUNK) * Hv * FLOP_PER_CHUNK_HEAD
    return nbytes / FLOOR_BYTES_PER_S * 1e3, flops / FLOOR_FLOP_PER_S * 1e3


def versions():
    vs = {"torch": torch.__version__}
    for name in ("triton", "tilelang", "fla-core", "flash-qla", "transformers"):
        try:
            vs[name] = md.version(name)
        except md.PackageNotFoundError:
            vs[name] = None
    return vs


def commit():
    if os.environ.get("QWEN_SCOPE_COMMIT"):  # the device copy's git may not be this tree's (benchmarks/h200.sh)
        return os.environ["QWEN_SCOPE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def kernel_specs(configs, sms):
    """(stage, builder args) of every kernel the suite and tests/flashqla_kernels/test_hopper_gpu.py need on ``sms``
    SMs."""
    specs = set(chunk_specs({(Hk, Hv, K, "bfloat16", nseq) for Hk, Hv, _, nseq in configs}, sms))
    gpu = gpu_test_layouts()
    if gpu:
        # the GPU tests also force 128-wide slices, and test_hopper_no_final_state_returns_none runs scale 0.5
        # without the final state on one sequence
        specs |= set(chunk_specs(gpu, sms, widths=(128,)))
        specs |= set(chunk_specs([(1, 2, 128, "bfloat16", 1)], sms, scale=0.5, final=(False,), scans=False))
    return sorted(specs)


def gpu_test_layouts():
    """(Hk, Hv, K, dtype, N, l2norm) of tests/flashqla_kernels/test_hopper_gpu.py's cases and test_dispatch_gpu.py's
    kernel calls (empty if they cannot be imported: run from the repo root with it on PYTHONPATH), so a precompile also
    serves the GPU tests."""
    try:
        from tests.flashqla_kernels.test_dispatch_gpu import KERNEL_LAYOUTS
        from tests.flashqla_kernels.test_hopper_gpu import CASES
    except ImportError:
        return set()
    from flashqla_kernels.gated_delta_rule.hopper.forward import padded_head_dim

    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    # other head dims run zero-padded onto a kernel dim: the kernels built are those of the padded layout
    return {(Hk, Hv, padded_head_dim(Kd), names[dt], extra.get("dense_batch") or len(lens), extra.get("l2norm", False))
            for Hk, Hv, Kd, _, lens, dt, extra in CASES.values()} | set(KERNEL_LAYOUTS)


def precompile(configs, workers, sms):
    """Compile every needed kernel on ``workers`` processes (TileLang's disk cache then serves the run); works
    without a GPU given ``sms`` (132 on an H200), e.g. to fill a TILELANG_CACHE_DIR that travels to the GPU."""
    specs = kernel_specs(configs, sms)
    t0 = time.time()
    failed = compile_all(specs, workers)
    print(f"precompiled {len(specs)} kernels in {time.time() - t0:.0f} s on {workers} processes", flush=True)
    for spec, err in failed:
        print(f"  FAILED {spec}: {err}", flush=True)


def warm_flashqla(configs, workers):
    """Call FlashQLA's op once per config on ``workers`` spawned processes, so its TileLang JIT kernels (10-65 s a
    config, one at a time inside the run) compile side by side into the disk cache the timed run then reads. FlashQLA
    has no autotune, so its timings are unaffected; FLA's Triton autotune times its candidates and stays in the run."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        errors = [e for e in ex.map(_warm_flashqla_one, configs) if e]
    print(f"FlashQLA warm-up: {len(configs) - len(errors)} of {len(configs)} configs in {time.time() - t0:.0f} s on "
          f"{workers} processes", flush=True)
    for e in errors:
        print(f"  FlashQLA warm-up failed: {e}", flush=True)


def _warm_flashqla_one(config) -> str | None:
    try:
        from flash_qla import chunk_gated_delta_rule as qla_fn

        q, k, v, g, beta, h0, cu = make_inputs(*config)
        with torch.no_grad():
            qla_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the run times FlashQLA (or reports it) itself
        return f"{config}: {e!r}"[:300]
    return None


def stage_ms(q, k, v, g, beta, h0, cu, bench=None):
    """Medians (ms) of the launcher's stages on these inputs: kkt_solve, the context-parallel maps + scan (0 when the
    plan keeps sequences whole) and chunk_fwd, each launched alone on the others' outputs (internal timings).
    ``bench(fn)`` times one stage (default: do_bench's median); ``ncu_stages.py`` passes one that launches it once."""
    import triton

    from flashqla_kernels.gated_delta_rule import checks
    from flashqla_kernels.gated_delta_rule.hopper import chunk_fwd, kkt_solve, plan, segment_states, state_scan

    Tn, Hk, Kd = q.shape[1], q.shape[2], q.shape[3]
    Hv, Vd = v.shape[2], v.shape[3]
    q3, k3, v3 = q.reshape(Tn, Hk, Kd), k.reshape(Tn, Hk, Kd), v.reshape(Tn, Hv, Vd)
    g3, b3 = g.reshape(Tn, Hv).float().contiguous(), beta.reshape(Tn, Hv).float().contiguous()
    offsets = checks.host_offsets(cu)
    seq_chunks = plan.chunk_counts(offsets)
    bdv = plan.block_dv(seq_chunks, Hv, Kd, Vd, plan.num_sms(q.device))
    pl = plan.make_plan(offsets, Hv, Vd // bdv, True, q.device)
    bench = bench or (lambda fn: triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median"))
    gamma, ag, _ = kkt_solve.kkt_solve(k3, g3, b3, pl.chunks, Hv)  # no l2norm: normalised inputs
    out = {"kkt_solve": bench(lambda: kkt_solve.kkt_solve(k3, g3, b3, pl.chunks, Hv)), "cp": 0.0}

    def cp():
        maps = segment_states.segment_states(k3, v3, ag, gamma, b3, pl.maps, bDV=bdv)
        return state_scan.state_scan(h0, *maps, pl.seqs, pl.segs.shape[0])

    h_init = h0
    if pl.segment_chunks:
        h_init = cp()
        out["cp"] = bench(cp)
    o, ht = torch.empty_like(v3), torch.empty_like(h0)
    out["chunk_fwd"] = bench(lambda: chunk_fwd.chunk_fwd(q3, k3, v3, ag, gamma, b3, h_init, pl.segs, o, ht,
                                                         scale=Kd ** -0.5, bDV=bdv))
    out["bDV"], out["segment_chunks"] = bdv, pl.segment_chunks
    return out


def kernel_ms(fn, calls: int = 10) -> dict:
    """Device time a call (ms) of each kernel ``fn`` launches, from ``torch.profiler`` over ``calls`` calls (internal:
    what each stage of a library costs, ours against FlashQLA's; never the user's number)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.device_time / 1000 / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def run_suite(idx, skip=(), stages=False, on_row=None):
    """Check the public op against the float64 reference, then time it, the launcher, FLA, FlashQLA and torch (but
    the baselines named in ``skip``); ``on_row(rows)`` after each config."""
    import triton

    rows = []
    with torch.no_grad():
        for i in idx:
            Hk, Hv, seqlen, nseq = SUITE[i]
            t0 = time.time()
            err_o, err_h, nan, why = check_vs_reference(Hk, Hv, seqlen, nseq)
            t_check = time.time() - t0
            inputs = make_inputs(Hk, Hv, seqlen, nseq)
            fns = runners(*inputs, Hk, Hv, nseq)
            for name in skip:
                fns.pop(name, None)
            first, outs = {}, {}
            for name, fn in fns.items():  # first calls: JIT / autotune of the baselines happen here
                t1 = time.time()
                outs[name] = fn()
                torch.cuda.synchronize()
                first[name] = round(time.time() - t1, 1)
            vs_fla = rel_l2(outs["ours"][0], outs["fla"][0]) if "fla" in outs else None
            vs_internal = rel_l2(outs["ours"][0], outs["internal"][0])
            del outs
            ms = {}
            # the host's 1-minute load while this row is timed: the short rows are host-bound, and another busy
            # process on the host slows them (a 1.8x swing once), which the report then says
            load = os.getloadavg()[0]
            for name, fn in fns.items():
                rep = 20 if name == "torch" else 200
                ms[name] = triton.testing.do_bench(fn, warmup=10 if name == "torch" else 50, rep=rep,
                                                   return_mode="median")
            bytes_floor, flop_floor = floor_ms(Hk, Hv, seqlen, nseq)
            row = {"Hk": Hk, "Hv": Hv, "seqlen": seqlen, "nseq": nseq, "ms": ms,
                   "speedup_vs_fla": ms["fla"] / ms["ours"] if "fla" in ms else None,
                   "ratio_vs_flashqla": ms["flashqla"] / ms["ours"] if "flashqla" in ms else None,
                   "rel_l2_o_vs_ref": err_o, "rel_l2_state_vs_ref": err_h, "nan": nan, "rel_l2_o_vs_fla": vs_fla,
                   "rel_l2_o_vs_internal": vs_internal, "backend": why.splitlines()[0],
                   "bytes_floor_ms": bytes_floor, "flop_floor_ms": flop_floor,
                   "anchor_fla_ms": ANCHOR_FLA_MS[i], "anchor_flashqla_ms": ANCHOR_QLA_MS[i],
                   "host_load": round(max(load, os.getloadavg()[0]), 2)}
            t2 = time.time()
            if stages:
                row["stages_ms"] = stage_ms(*inputs)
                row["kernels_ms"] = {name: kernel_ms(fns[name]) for name in ("ours", "flashqla") if name in fns}
            row["wall_s"] = {"check": round(t_check, 1), "first_calls": first, "stages": round(time.time() - t2, 1),
                             "total": round(time.time() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if on_row is not None:
                on_row(rows)
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--skip-torch", action="store_true", help="do not time transformers' torch path")
    ap.add_argument("--skip-fla", action="store_true",
                    help="do not time FLA (its autotune costs ~40 s a shape); x FLA anchor still compares")
    ap.add_argument("--render", metavar="JSON", help="only re-render the markdown table of a results JSON")
    ap.add_argument("--merge", metavar="JSON", nargs="+",
                    help="join the rows of runs over disjoint configs (e.g. one half per GPU of one host) into "
                         "--out/gdn_forward.{json,md}")
    ap.add_argument("--configs", default="", help="comma-separated SUITE row indices (default: all 10)")
    ap.add_argument("--precompile", type=int, default=0, metavar="N", help="compile all kernels on N processes first")
    ap.add_argument("--precompile-only", action="store_true", help="stop after --precompile (no GPU needed)")
    ap.add_argument("--sms", type=int, default=0, help="SM count for --precompile without a GPU (H200: 132)")
    ap.add_argument("--warm-flashqla", type=int, default=0, metavar="N",
                    help="compile FlashQLA's JIT kernels of the configs on N GPU processes before timing")
    ap.add_argument("--stages", action="store_true",
                    help="also time each stage alone (kkt_solve, CP maps + scan, chunk_fwd): ~1 s per config")
    args = ap.parse_args()
    if args.render:
        result = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return
    out = Path(args.out)
    if args.merge:
        result = merge([json.loads(Path(p).read_text()) for p in args.merge], SUITE)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gdn_forward.json").write_text(json.dumps(result, indent=1))
        (out / "gdn_forward.md").write_text(markdown(result))
        print(markdown(result))
        return
    idx = [int(x) for x in args.configs.split(",")] if args.configs else list(range(len(SUITE)))
    if args.precompile:
        sms = args.sms or torch.cuda.get_device_properties(0).multi_processor_count
        precompile([SUITE[i] for i in idx], args.precompile, sms)
    if args.precompile_only:
        return
    if args.warm_flashqla:
        warm_flashqla([SUITE[i] for i in idx], args.warm_flashqla)
    flops_ceiling, bytes_ceiling = ceilings()
    out.mkdir(parents=True, exist_ok=True)

    def save(rows):  # after every row: a run cut short by its time limit keeps the rows it finished
        result = {
            "gpu": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "versions": versions(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "bf16_matmul_tflops": flops_ceiling / 1e12, "copy_tbps": bytes_ceiling / 1e12,
            "floor_tbps": FLOOR_BYTES_PER_S / 1e12, "floor_tflops": FLOOR_FLOP_PER_S / 1e12,
            "method": "packed B=1 + cu_seqlens, triton.testing.do_bench median, torch.no_grad, the public op",
            "geomean_speedup_vs_fla": geomean([r["speedup_vs_fla"] for r in rows]),
            "geomean_ratio_vs_flashqla": geomean([r["ratio_vs_flashqla"] for r in rows]),
            "configs_planned": len(idx), "rows": rows, "host_cpus": os.cpu_count(),
        }
        (out / "gdn_forward.json").write_text(json.dumps(result, indent=1))
        (out / "gdn_forward.md").write_text(markdown(result))
        return result

    skip = {"torch"} if args.skip_torch else set()
    skip |= {"fla"} if args.skip_fla else set()
    result = save(run_suite(idx, skip, args.stages, on_row=save))
    print(markdown(result))


if __name__ == "__main__":
    main()
