"""Where a collection step's time goes on the H200: torch.profiler over the bare forward (a) and a steady-state
``collect`` with SAE codes at one layer (c1), on the Qwen3.5-2B-shaped model of ``collect_throughput.py``.

The throughput benchmark shows (c1) costing ~35 ms a step more than (a) while the fused encode is ~9.4 ms of GPU
time: the rest is GPU idle, so the question is what the host does meanwhile. For each arm this prints and writes:

- wall ms per step against the GPU's busy ms per step (union of kernel and memcpy intervals): the idle share;
- the CUDA runtime calls that block the host or the device queue (``cudaStreamSynchronize``,
  ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, ``cudaHostAlloc``, ``cudaMalloc``, ``cudaFree``, pageable
  ``cudaMemcpy``): count and host ms per step;
- the GPU's idle gaps longer than 1 ms, each with the CPU operator running when it began;
- the top host operators by self CPU time, and the host threads' busy time (main, prefetch, shard writers).

Usage (GPU machine): ``python benchmarks/collect_profile.py --out DIR [--steps 3]`` -> ``collect_profile.{json,md}``;
``--tiny`` is a CPU dry run of every code path. Phase ``collect-profile`` of ``h200.sh`` (~60 s).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import collect_throughput as ct  # noqa: E402 - the model, SAE and backends of the throughput benchmark

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaHostAlloc",
            "cudaMallocHost", "cudaMalloc", "cudaFree", "cudaMemcpy", "cudaStreamWaitEvent")


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (us in, ms out)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def summarise(prof, steps: int, wall_s: float) -> dict:
    """Busy / idle, blocking runtime calls, long GPU gaps and top host ops from a finished profiler."""
    events = prof.events()
    gpu = [(e.time_range.start, e.time_range.end) for e in events
           if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    cpu_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    blocking: dict[str, list[float]] = {}
    for e in cpu_ops:
        name = e.name
        if any(name == b or name.startswith(b + "_") or name.startswith(b + "Async") for b in BLOCKING):
            blocking.setdefault(name, []).append((e.time_range.end - e.time_range.start) / 1e3)
    gaps = []
    merged = sorted(gpu)
    end = merged[0][1] if merged else 0.0
    for s, e in merged[1:]:
        if s - end > 1000:
            running = [c.name for c in cpu_ops if c.time_range.start <= end <= c.time_range.end
                       and not c.name.startswith("ProfilerStep")]
            gaps.append({"gap_ms": (s - end) / 1e3, "host_op_at_start": running[-1] if running else None})
        end = max(end, e)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    threads: dict[int, float] = {}
    for e in cpu_ops:
        threads[e.thread] = threads.get(e.thread, 0.0) + e.self_cpu_time_total / 1e3
    busy = _union_ms(gpu)
    return {
        "wall_ms_per_step": 1e3 * wall_s / steps,
        "gpu_busy_ms_per_step": busy / steps,
        "gpu_idle_share": max(0.0, 1 - busy / (1e3 * wall_s)),
        "blocking_calls_per_step": {k: {"count": len(v) / steps, "host_ms": sum(v) / steps}
                                    for k, v in sorted(blocking.items())},
        "gpu_gaps_over_1ms": sorted(gaps, key=lambda g: -g["gap_ms"])[:20],
        "gpu_gaps_total_ms_per_step": sum(g["gap_ms"] for g in gaps) / steps,
        "host_self_ms_per_step_by_thread": {str(k): v / steps for k, v in sorted(threads.items())},
        "top_host_ops": table,
    }


def profile(fn, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    ct.sync()
    with torch_profile(activities=acts) as prof:
        t = time.perf_counter()
        fn()
        ct.sync()
        wall = time.perf_counter() - t
    return summarise(prof, steps, wall)


def sync_sites(fn, limit: int = 12) -> list[dict]:
    """Run ``fn`` with torch's CUDA sync debugging on; return where the host waited for the device: per call site
    (the innermost frame when it lies outside this repository, then the chain of repository frames above it), how
    often."""
    import traceback
    import warnings

    if not torch.cuda.is_available():
        return []
    root = str(Path(__file__).resolve().parents[1])
    sites: dict[str, dict] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in Path(f.filename).name]
        frames = [f for f in stack if f.filename.startswith(root)
                  and "site-packages" not in f.filename and not f.filename.endswith("collect_profile.py")]
        chain = " <- ".join(f"{Path(f.filename).relative_to(root)}:{f.lineno}" for f in reversed(frames[-4:]))
        if stack and stack[-1] not in frames:  # the sync itself happened outside the repository: name that frame
            chain = f"{stack[-1].filename.split('site-packages/')[-1]}:{stack[-1].lineno} ({stack[-1].name})" + (
                f" <- {chain}" if chain else "")
        entry = sites.setdefault(chain or "(outside the repository)", {"site": chain, "count": 0,
                                                                      "message": str(message)[:120]})
        entry["count"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted(sites.values(), key=lambda e: -e["count"])[:limit]


def markdown(result: dict) -> str:
    v = result["env"]
    lines = [f"# Collection step profile ({v['gpu']}, {v['date']})", "",
             f"torch {v['torch']}, transformers {v['transformers']}, tilelang {v['tilelang']}, commit {v['commit']}. "
             f"Qwen3.5-2B-shaped random bf16, steps of {ct.B} x {ct.T} tokens; (c1) codes at layer "
             f"{ct.N_LAYERS - 1}, SAE {ct.D_SAE} wide k={ct.K}; GDN on our fused layer.", ""]
    for arm, r in result["arms"].items():
        lines += [f"## {arm}", "",
                  f"wall {r['wall_ms_per_step']:.1f} ms/step, GPU busy {r['gpu_busy_ms_per_step']:.1f} ms/step, idle "
                  f"{100 * r['gpu_idle_share']:.1f}%; gaps > 1 ms: {r['gpu_gaps_total_ms_per_step']:.1f} ms/step", "",
                  "| blocking runtime call | per step | host ms per step |", "|---|---|---|"]
        lines += [f"| {k} | {c['count']:.1f} | {c['host_ms']:.2f} |" for k, c in r["blocking_calls_per_step"].items()]
        lines += ["", "Longest GPU gaps: " + ", ".join(
            f"{g['gap_ms']:.1f} ms (host in {g['host_op_at_start']})" for g in r["gpu_gaps_over_1ms"][:8]), "",
            "Host threads' self ms per step: " + ", ".join(
                f"{k}: {ms:.1f}" for k, ms in r["host_self_ms_per_step_by_thread"].items()), "",
            "```", r["top_host_ops"], "```", ""]
        if r.get("sync_sites"):
            lines += ["Where the host waited for the GPU (torch's sync debug mode, one more run): the frame of the sync "
                      "itself where it lies outside the repository, then the repository frames, innermost first.", "",
                      "| count | call site | message |", "|---|---|---|"]
            lines += [f"| {e['count']} | {e['site']} | {e['message']} |" for e in r["sync_sites"]]
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/collect_profile"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="dry run on a tiny model (CPU is fine)")
    args = parser.parse_args()
    if args.tiny:
        ct.B, ct.T, ct.D_SAE, ct.K, ct.D_MODEL, ct.N_LAYERS = 2, 128, 512, 8, 64, 4
        ct.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    from qwen_scope.collect import collect

    args.out.mkdir(parents=True, exist_ok=True)
    model = ct.build_model(args.tiny)
    backends = ct.Backends()
    backends.use("ours")
    layer = ct.N_LAYERS - 1
    saes = {layer: ct.random_sae(100 + layer)}
    docs = ct.corpus((2 * args.steps + 2) * ct.B * ct.T + 10_000, model.config.vocab_size)
    kw = dict(saes=saes, context_len=ct.T, batch_size=ct.B, shard_tokens=ct.B * ct.T, progress=False,
              corpus_id="profile", overwrite=True, gdn_kernels=False)
    ids = torch.randint(0, model.config.vocab_size, (ct.B, ct.T), device=ct.DEVICE)

    def bare():
        with torch.no_grad():
            for _ in range(args.steps):
                model.model(input_ids=ids, use_cache=False)

    def c1():
        # the steady state: one more step than profiled runs first, so the profiled window is mid-run; the
        # profile covers a whole call, set-up and drain included, which the markdown names per step
        shutil.rmtree(args.work, ignore_errors=True)
        collect(model, docs, token_budget=args.steps * ct.B * ct.T, out_dir=args.work, **kw)

    bare()  # warm-up: kernels loaded, allocator caches filled
    collect(model, docs, token_budget=ct.B * ct.T, out_dir=args.work, **kw)
    result = {"env": ct.versions(), "steps": args.steps, "arms": {}}
    for name, fn in (("a: bare forward", bare), ("c1: collect, SAE codes at one layer", c1)):
        result["arms"][name] = profile(fn, args.steps)
        result["arms"][name]["sync_sites"] = sync_sites(fn)
        print(name, json.dumps({k: v for k, v in result["arms"][name].items() if k != "top_host_ops"}), flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    (args.out / "collect_profile.json").write_text(json.dumps(result, indent=1))
    (args.out / "collect_profile.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
