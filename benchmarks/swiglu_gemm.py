"""The MLP's gate and up projections + SwiGLU on the H200: cuBLAS and silu_mul against the fused TileLang GEMM.

One Qwen3.5-2B-shaped MLP input (M = 32768 tokens, K = d_model 2048, N = 6144 intermediate channels, bf16):

- ``cublas+silu_mul``: ``x @ Wg.T`` and ``x @ Wu.T`` (cuBLAS), then our ``silu_mul`` kernel: today's path;
- ``cublas gate+up``: the two GEMMs alone, the floor the fused kernel must approach;
- ``cublas x @ [Wg; Wu].T``: both as one N = 12288 GEMM (a concatenated weight copy, for reference only);
- ``fused <variant>``: ``swiglu_gemm`` under each config of ``VARIANTS`` (the launcher's default first).

Each fused output is checked against the cuBLAS path (relative L2 over the whole output) and against the fp32
formulation on a sample of rows (below ``TOL``, or marked FAIL in the table) before anything is timed. Timing: CUDA
events around each call, the calls of a round queued back to back (launch overhead overlaps the GPU's work), the
arms interleaved in rounds (so clock drift under the 700 W cap hits them alike), the median of all samples after a
warm-up. TFLOP/s counts the two GEMMs, 2 * 2 M N K.

Usage (GPU): ``python benchmarks/swiglu_gemm.py --out DIR`` -> ``swiglu_gemm.{json,md}``; ``--precompile`` (anywhere
with nvcc) compiles every variant, and the GPU tests' specialisations, into TileLang's cache for an H200 (132 SMs);
``--list`` prints the variants; ``--tiny`` is a CPU dry run (torch stands in for the kernels at a small shape).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, ROOT)
from flashqla_kernels.decoder.hopper.swiglu_gemm import (  # noqa: E402
    DEFAULT_CONFIG, build_swiglu_gemm, builder_args, swiglu_gemm, swiglu_reference)

M, K, N = 32768, 2048, 6144
H200_SMS = 132
BASELINE, GEMMS = "cublas+silu_mul", "cublas gate+up"
# (name, config): the launcher's default first. All keep the 128 x (128 + 128) tile of two consumer warpgroups
# (2 x 64 fp32 accumulators a thread, 168 registers, no spills); they vary the schedule around it.
VARIANTS = [
    ("persistent s4 p16", DEFAULT_CONFIG),
    ("persistent s3 p16", replace(DEFAULT_CONFIG, stages=3)),
    ("persistent s4 p8", replace(DEFAULT_CONFIG, panel=8)),
    ("persistent s4 p32", replace(DEFAULT_CONFIG, panel=32)),
    ("persistent bk32 s8 p16", replace(DEFAULT_CONFIG, BK=32, stages=8)),
    ("grid s4 p16", replace(DEFAULT_CONFIG, persistent=False)),
    ("grid s3 p8", replace(DEFAULT_CONFIG, persistent=False, stages=3, panel=8)),
]
# The GPU tests' specialisations of the default config (tests/flashqla_kernels/test_decoder_hopper_swiglu_gemm.py):
# (N, K, dtype)
TEST_SHAPES = [(6144, 2048, "bfloat16"), (6144, 2048, "float16"), (256, 128, "bfloat16"), (256, 128, "float16")]
ROUNDS, REPS, WARMUP = 10, 10, 5
CHECK_ROWS = 1024
TOL = 5e-3  # rel-L2 against fp32 a bf16 output must meet (its rounding alone is ~1.6e-3)


def specialisations(sms: int = H200_SMS) -> list[tuple]:
    """Every kernel the benchmark and the GPU tests compile on ``sms`` SMs, as builder arguments, without repeats."""
    specs = [builder_args(N, K, "bfloat16", cfg, sms) for _, cfg in VARIANTS]
    specs += [builder_args(n, k, dt, DEFAULT_CONFIG, sms) for n, k, dt in TEST_SHAPES]
    return list(dict.fromkeys(specs))


def precompile(sms: int) -> int:
    from flashqla_kernels import toolkit

    specs = specialisations(sms)
    for args in specs:
        toolkit.compile_kernel(build_swiglu_gemm, *args)
    return len(specs)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def arms(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> dict:
    """name -> a call. On CPU (the dry run) torch stands in for the silu_mul kernel and the fused kernels."""
    on_gpu = x.is_cuda
    if on_gpu:
        from flashqla_kernels.decoder.hopper.silu_mul import silu_mul
    else:
        def silu_mul(g, u):
            return (torch.nn.functional.silu(g.float()) * u.float()).to(g.dtype)
    w_cat = torch.cat([wg, wu])
    calls = {BASELINE: lambda: silu_mul(x @ wg.T, x @ wu.T),
             GEMMS: lambda: (x @ wg.T, x @ wu.T),
             "cublas x @ [Wg; Wu].T": lambda: x @ w_cat.T}
    for name, cfg in VARIANTS:
        calls[f"fused {name}"] = ((lambda cfg=cfg: swiglu_gemm(x, wg, wu, config=cfg)) if on_gpu
                                  else (lambda: swiglu_reference(x, wg, wu).to(x.dtype)))
    return calls


def time_arms(calls: dict, device: str, rounds: int = ROUNDS, reps: int = REPS, warmup: int = WARMUP) -> dict:
    """Median ms of each call: ``rounds`` rounds, each timing every arm ``reps`` times in turn, after ``warmup``
    calls of each."""
    samples = {name: [] for name in calls}
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            samples[name] += _time_round(fn, device, reps)
    return {name: sorted(s)[len(s) // 2] for name, s in samples.items()}


def _time_round(fn, device: str, reps: int) -> list[float]:
    """ms of each of ``reps`` back-to-back calls. On CUDA, events around each call and one sync at the end, after
    an untimed call: the host queues ahead, so launch overhead (the fused launcher's checks and TMA descriptors
    included) overlaps the GPU's work instead of being timed."""
    if device != "cuda":
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    fn()
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(stop) for start, stop in events]


def env(device: str) -> dict:
    import importlib.metadata as md

    out = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__,
           "tilelang": md.version("tilelang"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out["commit"] = os.environ.get("QWEN_SCOPE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).parent).stdout.strip() or None
    return out


def run(out: Path, tiny: bool) -> list[dict]:
    device = "cpu" if tiny else "cuda"
    m, k, n = (300, 128, 256) if tiny else (M, K, N)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g).bfloat16()
    wg = (torch.randn(n, k, device=device, generator=g) / k ** 0.5).bfloat16()
    wu = (torch.randn(n, k, device=device, generator=g) / k ** 0.5).bfloat16()
    calls = arms(x, wg, wu)
    # correctness first: each fused output against the cuBLAS path, and both against fp32 on a sample of rows
    base = calls[BASELINE]()
    rows = torch.randperm(m, generator=g, device=device)[:CHECK_ROWS]
    ref = swiglu_reference(x[rows], wg, wu)
    checks = {BASELINE: {"rel_l2_vs_fp32_rows": rel_l2(base[rows], ref)}}
    for name, fn in calls.items():
        if name.startswith("fused"):
            got = fn()
            checks[name] = {"rel_l2_vs_cublas": rel_l2(got, base), "rel_l2_vs_fp32_rows": rel_l2(got[rows], ref),
                            "nan": bool(got.isnan().any())}
            checks[name]["ok"] = checks[name]["rel_l2_vs_fp32_rows"] < TOL and not checks[name]["nan"]
            print(name, json.dumps(checks[name]), flush=True)
    ms = time_arms(calls, device, *((1, 2, 1) if tiny else (ROUNDS, REPS, WARMUP)))
    flops = 2 * 2 * m * n * k
    configs = {f"fused {name}": asdict(cfg) for name, cfg in VARIANTS}
    rows_out = [{"arm": name, "ms": t, "tflops": flops / t / 1e9, "of_baseline": t / ms[BASELINE],
                 "of_cublas_gemms": t / ms[GEMMS], "config": configs.get(name), **checks.get(name, {})}
                for name, t in ms.items()]
    write(out, {"env": env(device), "shape": {"M": m, "K": k, "N": n, "dtype": "bfloat16"}, "rows": rows_out})
    return rows_out


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "swiglu_gemm.json").write_text(json.dumps(result, indent=1) + "\n")
    v, s = result["env"], result["shape"]
    lines = [f"# SwiGLU MLP projections: cuBLAS + silu_mul vs the fused TileLang GEMM ({v['gpu']})", "",
             f"torch {v['torch']}, tilelang {v['tilelang']}, commit {v['commit']}, {v['date']}. x [{s['M']}, "
             f"{s['K']}], Wg / Wu [{s['N']}, {s['K']}], {s['dtype']}; TFLOP/s of the two GEMMs (4 M N K); rel-L2 of "
             f"each fused output against the cuBLAS path (whole output) and against fp32 ({CHECK_ROWS} rows).", "",
             "| arm | ms | TFLOP/s | x baseline | x cuBLAS GEMMs | rel-L2 vs cuBLAS | rel-L2 vs fp32 | check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        vs_cublas = f"{r['rel_l2_vs_cublas']:.1e}" if "rel_l2_vs_cublas" in r else ""
        vs_fp32 = f"{r['rel_l2_vs_fp32_rows']:.1e}" if "rel_l2_vs_fp32_rows" in r else ""
        check = {True: "ok", False: "**FAIL**"}.get(r.get("ok"), "")
        lines.append(f"| {r['arm']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['of_baseline']:.3f} | "
                     f"{r['of_cublas_gemms']:.3f} | {vs_cublas} | {vs_fp32} | {check} |")
    (out / "swiglu_gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--precompile", action="store_true", help="compile every variant (no GPU needed) and stop")
    parser.add_argument("--sms", type=int, default=H200_SMS, help="SM count the persistent variants are built for")
    parser.add_argument("--list", action="store_true", help="print the variants and stop")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run at a small shape, torch in place of kernels")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{name}: {cfg}" for name, cfg in VARIANTS))
    elif args.precompile:
        print(f"precompiled {precompile(args.sms)} SwiGLU GEMM kernels for {args.sms} SMs")
    elif not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: run on the H200, or pass --tiny for a CPU dry run")
    else:
        run(args.out, args.tiny)


if __name__ == "__main__":
    main()
