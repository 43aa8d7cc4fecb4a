"""Benchmark: fused TopK-SAE encode (TileLang, sm_90a) against the torch path (addmm + ReLU + topk), on one GPU.

Shapes: 32768 tokens at 2048 -> 32768 (k=100) and 4096 -> 65536 (k=50, 100), bf16 weights and activations. For each
shape: check the fused codes against the exact top-k (float64 on a sample of rows) and against ``encode_sparse``, then
time with CUDA events (median of repeats after warm-up):

- ``torch bf16``: ``TopKSAE(compute_dtype=bf16).encode_sparse`` = addmm + ReLU + topk in bf16 (the anchor's path);
- ``torch fp32``: the default ``encode_sparse`` (bf16 operands computed in fp32), fewer repeats;
- ``fused``: ``fused_encode(backend="tilelang")`` (and ``fused_encode_async``, the collection loop's sync-free
  call); and its parts: the kernel alone, the merge alone (the TileLang merge kernel that ``fused_encode`` runs, beside
  the torch ``merge_candidates``; checked equal first), the kernel with one candidate per tile (the matmul with the
  lightest epilogue), and cuBLAS ``addmm`` alone (the matmul floor).

Usage: ``python benchmarks/topk_encode.py --out benchmarks/results`` (writes topk_encode.json and topk_encode.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from saes import TopKSAE
from saes import fused as fe
from saes import hopper_topk as hk

SHAPES = [(2048, 32768, 100), (4096, 65536, 50), (4096, 65536, 100)]


def time_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def make_sae(d_model: int, d_sae: int, k: int, seed: int = 0) -> tuple[TopKSAE, torch.Tensor]:
    """A random bf16 SAE shaped like a Qwen-Scope release and residual-like bf16 activations [32768, d_model]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w_dec = torch.randn(d_model, d_sae, device="cuda", generator=g)
    w_dec /= w_dec.norm(dim=0, keepdim=True)
    w_enc = (w_dec.T + 0.02 * torch.randn(d_sae, d_model, device="cuda", generator=g)).contiguous()
    b_enc = -0.1 + 0.05 * torch.randn(d_sae, device="cuda", generator=g)
    sae = TopKSAE(w_enc, w_dec, b_enc, torch.zeros(d_model, device="cuda"), k=k).to(torch.bfloat16)
    sae.requires_grad_(False)
    x = torch.randn(32768, d_model, device="cuda", generator=g) * (1 + torch.rand(32768, 1, device="cuda", generator=g))
    return sae, x.bfloat16()


def check(codes, sae: TopKSAE, x: torch.Tensor, rows: int = 2048) -> dict:
    """Exactness on the first ``rows`` tokens against float64 pre-activations, and agreement with encode_sparse."""
    xs = x[:rows]
    acts = (xs.double() @ sae.W_enc.double().T + sae.b_enc.double()).clamp_min(0)
    values, indices = codes.values[:rows].double(), codes.indices[:rows]
    own = acts.gather(1, indices)
    best = acts.topk(sae.k, dim=1).values
    distinct = bool((indices.sort(dim=1).values.diff(dim=1) > 0).all())
    value_err = float(((values - own).abs() / (own.abs() + 1e-3)).max())
    topk_err = float(((values - best).abs() / (best + 1e-3)).max())
    ref = sae.encode_sparse(xs)
    ours = torch.zeros_like(acts, dtype=torch.bool).scatter_(1, indices, True)
    same = ours.gather(1, ref.indices).float().mean()  # share of encode_sparse's features we also picked
    ok = distinct and value_err < 2**-7 and topk_err < 2**-7 and not torch.isnan(codes.values).any()
    return {"ok": bool(ok), "distinct": distinct, "max_rel_err_vs_own_act": value_err,
            "max_rel_err_vs_true_topk": topk_err, "index_agreement_vs_encode_sparse": float(same)}


def check_merge(cand: torch.Tensor, k: int) -> dict:
    """The merge kernel against the torch merge on the same candidates: equal values and flags, the same keys (equal
    keys may come from other tiles), distinct indices."""
    values, indices, flagged = hk.merge_candidates_kernel(cand, k)
    ref_values, ref_indices, ref_flagged = hk.merge_candidates(cand, k)
    keys = values.view(torch.int32) | (hk.BLOCK_N - 1 - indices % hk.BLOCK_N).int()
    ref_keys = ref_values.view(torch.int32) | (hk.BLOCK_N - 1 - ref_indices % hk.BLOCK_N).int()
    same = {"values": torch.equal(values, ref_values), "flagged": torch.equal(flagged, ref_flagged),
            "keys": torch.equal(keys.sort(dim=1).values, ref_keys.sort(dim=1).values),
            "distinct": bool((indices.sort(dim=1).values.diff(dim=1) > 0).all()),
            "same_indices": float((indices == ref_indices).float().mean())}
    return {"ok": all(v for key, v in same.items() if key != "same_indices"), **same}


def bench_shape(d_model: int, d_sae: int, k: int, configs: list[tuple[int, int]]) -> dict:
    sae, x = make_sae(d_model, d_sae, k)
    sae_bf16 = TopKSAE(sae.W_enc, sae.W_dec, sae.b_enc, sae.b_dec, k=k, compute_dtype=torch.bfloat16)
    n = x.shape[0]
    flops = 2 * n * d_model * d_sae
    c = hk.candidates_per_tile(k, d_sae)
    row = {"tokens": n, "d_model": d_model, "d_sae": d_sae, "k": k, "c": c}
    with torch.no_grad():
        best_cfg, best_ms = None, float("inf")
        for cfg in configs:
            hk.DEFAULT_CONFIG = cfg
            try:
                codes = fe.fused_encode(x, sae, backend="tilelang")
            except RuntimeError as err:  # e.g. a launch refused for its shared memory; try the next config
                row[f"check_{cfg[0]}x{cfg[1]}"] = {"ok": False, "error": str(err)[:300]}
                print(f"config {cfg} failed: {err}", flush=True)
                continue
            row[f"check_{cfg[0]}x{cfg[1]}"] = check(codes, sae, x)
            b = sae.b_enc.float()
            ms = time_ms(lambda: hk.topk_candidates(x[:16384], sae.W_enc, b, c)) * n / 16384
            row[f"kernel_ms_{cfg[0]}x{cfg[1]}"] = ms
            print(f"{d_model}->{d_sae} k={k} config {cfg}: kernel {ms:.3f} ms, {row[f'check_{cfg[0]}x{cfg[1]}']}",
                  flush=True)
            if row[f"check_{cfg[0]}x{cfg[1]}"]["ok"] and ms < best_ms:
                best_cfg, best_ms = cfg, ms
        if best_cfg is None:
            raise RuntimeError(f"{d_model}->{d_sae} k={k}: no mainloop config gave exact codes: "
                               + json.dumps({key: val for key, val in row.items() if key.startswith("check_")}))
        hk.DEFAULT_CONFIG = best_cfg
        row["config"] = list(hk.DEFAULT_CONFIG)
        row["kernel_ms"] = row[f"kernel_ms_{hk.DEFAULT_CONFIG[0]}x{hk.DEFAULT_CONFIG[1]}"]
        codes = fe.fused_encode(x, sae, backend="tilelang")
        row["check"] = check(codes, sae, x)
        cand = hk.topk_candidates(x[:16384], sae.W_enc, sae.b_enc.float(), c)
        row["flagged_rows_per_16k"] = int(hk.merge_candidates(cand, k)[2].sum())
        row["fused_ms"] = time_ms(lambda: fe.fused_encode(x, sae, backend="tilelang"))
        row["fused_async_ms"] = time_ms(lambda: fe.fused_encode_async(x, sae, backend="tilelang"))
        row["check_split"] = check(fe._encode_split(x, sae), sae, x)
        row["split_ms"] = time_ms(lambda: fe._encode_split(x, sae))
        row["check_merge_kernel"] = check_merge(cand, k)
        row["merge_ms"] = time_ms(lambda: hk.merge_candidates(cand, k)) * n / 16384
        row["merge_kernel_ms"] = time_ms(lambda: hk.merge_candidates_kernel(cand, k)) * n / 16384
        row["kernel_c1_ms"] = time_ms(lambda: hk.topk_candidates(x[:16384], sae.W_enc, sae.b_enc.float(), 1)) * n / 16384
        row["torch_bf16_ms"] = time_ms(lambda: sae_bf16.encode_sparse(x), reps=5)
        row["addmm_bf16_ms"] = time_ms(lambda: torch.addmm(sae.b_enc, x, sae.W_enc.T), reps=5)
        row["torch_fp32_ms"] = time_ms(lambda: sae.encode_sparse(x), reps=2, warmup=1)
        del codes
    row["speedup_vs_torch_bf16"] = row["torch_bf16_ms"] / row["fused_ms"]
    row["speedup_vs_torch_fp32"] = row["torch_fp32_ms"] / row["fused_ms"]
    row["split_speedup_vs_torch_bf16"] = row["torch_bf16_ms"] / row["split_ms"]
    row["fused_tflops"] = flops / row["fused_ms"] / 1e9
    row["addmm_tflops"] = flops / row["addmm_bf16_ms"] / 1e9
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return row


def merge_test_variants() -> list[tuple]:
    """The merge kernels the GPU tests compile: (NT, c, k) of tests/saes/test_hopper_topk.py, and the first pass of
    fused_encode at the tests' (d_sae, k)."""
    sizes = [(128, 8, 100), (7, 5, 33), (4, 8, 32), (16, 1, 10), (1, 8, 5), (256, 6, 100), (256, 5, 50),
             (128, 32, 100)]
    for d_sae, k in ((2048, 16), (32768, 100)):
        c = hk.candidates_per_tile(k, d_sae)
        sizes += [(d_sae // hk.BLOCK_N, c, k), (d_sae // hk.BLOCK_N, min(hk.BLOCK_N, 4 * c), k)]
    return [("merge", n_tiles * c, c, k) for n_tiles, c, k in sizes if n_tiles * c <= hk.MERGE_MAX_SLOTS]


def environment() -> dict:
    import tilelang

    try:
        commit = os.environ.get("QWEN_SCOPE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    commit = commit or os.environ.get("GIT_COMMIT", "")  # the device's copy of the tree has no git history
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "tilelang": tilelang.__version__, "python": platform.python_version(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [
        "# Fused TopK-SAE encode vs the torch path",
        "",
        f"{env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), tilelang {env['tilelang']}, "
        f"Python {env['python']}, commit {env['commit']}, {env['date']}. bf16 weights and activations, "
        "32768 tokens; CUDA-event medians. Checked before timing: exact top-k (float64) on 2048 tokens.",
        "",
        "| d_model -> d_sae | k | torch bf16 (ms) | torch fp32 (ms) | fused (ms) | speedup vs bf16 | speedup vs fp32 "
        "| kernel / merge kernel (torch merge) / kernel c=1 / cuBLAS addmm (ms) | fused async (ms) | fused TFLOP/s "
        "| exact | unfused: addmm + TileLang top-c (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['d_model']} -> {r['d_sae']} | {r['k']} | {r['torch_bf16_ms']:.2f} | {r['torch_fp32_ms']:.1f} | "
            f"{r['fused_ms']:.2f} | {r['speedup_vs_torch_bf16']:.2f}x | {r['speedup_vs_torch_fp32']:.1f}x | "
            f"{r['kernel_ms']:.2f} / {r['merge_kernel_ms']:.2f} ({r['merge_ms']:.2f}) / "
            f"{r['kernel_c1_ms']:.2f} / {r['addmm_bf16_ms']:.2f} | {r['fused_async_ms']:.2f} | "
            f"{r['fused_tflops']:.0f} | {r['check']['ok'] and r['check_merge_kernel']['ok']} | "
            f"{r['split_ms']:.2f} ({r['split_speedup_vs_torch_bf16']:.2f}x, exact {r['check_split']['ok']}) |")
    return "\n".join(lines) + "\n"


def profile_calls(d_model: int, d_sae: int, k: int) -> dict:
    """Where a ``fused_encode`` / ``fused_encode_async`` call's time goes: one profiled call of each after warm-up,
    its CUDA-event wall, its kernels (name, launches, device ms), and the GPU idle between its first and last kernel."""
    from torch.profiler import ProfilerActivity, profile

    sae, x = make_sae(d_model, d_sae, k)
    out = {}
    for name, fn in (("fused_encode", lambda: fe.fused_encode(x, sae, backend="tilelang")),
                     ("fused_encode_async", lambda: fe.fused_encode_async(x, sae, backend="tilelang"))):
        with torch.no_grad():
            wall = time_ms(fn, reps=5)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type.name == "CUDA")
        busy, end = 0.0, None
        for a, b in spans:  # the union of the device intervals
            if end is None or a > end:
                busy += b - a
                end = b
            elif b > end:
                busy += b - end
                end = b
        kernels = sorted(((e.self_device_time_total / 1e3, e.count, e.key[:100]) for e in prof.key_averages()
                          if e.device_type.name == "CUDA" and e.self_device_time_total > 0), reverse=True)
        out[name] = {"wall_ms": wall, "busy_ms": busy / 1e3,
                     "first_to_last_ms": (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0,
                     "kernels": [{"ms": ms, "launches": n, "name": key} for ms, n, key in kernels[:20]]}
        print(f"{name}: wall {wall:.3f} ms, GPU busy {busy / 1e3:.3f} ms of the "
              f"{out[name]['first_to_last_ms']:.3f} ms between its first and last kernel", flush=True)
        for ms, n, key in kernels[:12]:
            print(f"  {ms:8.3f} ms  x{n:<3d} {key}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for topk_encode.json / .md")
    parser.add_argument("--configs", default="64x3,64x4,128x2",
                        help="mainloop (block_K x stages) to try on the first shape; the fastest exact one is kept")
    parser.add_argument("--precompile", type=int, default=0, metavar="WORKERS",
                        help="first compile every kernel variant (and the GPU tests') in this many processes")
    parser.add_argument("--precompile-only", action="store_true", help="stop after --precompile")
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                        help="d_model x d_sae x k, comma-separated")
    parser.add_argument("--profile", action="store_true",
                        help="only profile one fused_encode and one fused_encode_async call at the first shape "
                             "(topk_encode_profile.json)")
    args = parser.parse_args()
    SHAPES[:] = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    configs = [tuple(int(v) for v in s.split("x")) for s in args.configs.split(",")]
    env = environment()
    print(json.dumps(env), flush=True)
    if args.precompile:
        # The GPU tests' kernels, then every shape x config with its c, 1 (timing) and 4c (re-run of flagged rows),
        # and the merge kernel of each first pass and of its 4c re-run where a row fits (MERGE_MAX_SLOTS).
        variants = [(256, 2048, c, "bfloat16", hk.DEFAULT_CONFIG) for c in (10, 40)]
        variants += [(2048, 32768, 32, "bfloat16", hk.DEFAULT_CONFIG), ("preacts", 2048, 10, "bfloat16")]
        variants += merge_test_variants()
        for d_model, d_sae, k in SHAPES:
            c = hk.candidates_per_tile(k, d_sae)
            for cfg in configs:
                variants += [(d_model, d_sae, cc, "bfloat16", cfg) for cc in (c, 1, min(hk.BLOCK_N, 4 * c))]
            variants.append(("preacts", d_sae, hk.candidates_per_tile(k, d_sae), "bfloat16"))
            variants += [("merge", d_sae // hk.BLOCK_N * cc, cc, k) for cc in (c, min(hk.BLOCK_N, 4 * c))
                         if d_sae // hk.BLOCK_N * cc <= hk.MERGE_MAX_SLOTS]
        hk.precompile(sorted(set(variants), key=str), workers=args.precompile)
        print(f"precompiled {len(set(variants))} variants", flush=True)
    if args.precompile_only:
        return
    if args.profile:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"environment": env, "shape": SHAPES[0], "calls": profile_calls(*SHAPES[0])}
        (out / "topk_encode_profile.json").write_text(json.dumps(result, indent=1) + "\n")
        return
    rows = [bench_shape(*SHAPES[0], configs)]
    rows += [bench_shape(*shape, [tuple(rows[0]["config"])]) for shape in SHAPES[1:]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "topk_encode.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1) + "\n")
    md = markdown(env, rows)
    (out / "topk_encode.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
