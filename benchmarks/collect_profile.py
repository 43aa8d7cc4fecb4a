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


from qwen_scope.collect_loop import STEP_MARK  # noqa: E402 - one profiler range a launched step


def _steady_window(cpu_ops) -> tuple[float, float, int] | None:
    """(start, end, steps) between the second and the last step launch of a collect call: the steady state, with
    the call's set-up (store, SAE to the device) and drain left out; None without at least three launches."""
    starts = sorted(e.time_range.start for e in cpu_ops if e.name == STEP_MARK)
    if len(starts) < 3:
        return None
    return starts[1], starts[-1], len(starts) - 2


def _repo_frames(stack: list[str], root: str, depth: int = 3) -> str:
    """The innermost ``depth`` frames of a profiler stack that lie in this repository (no site-packages)."""
    frames = [f.replace(root + "/", "") for f in stack if f.startswith(root) and "site-packages" not in f]
    return " <- ".join(frames[:depth]) or (stack[0] if stack else "?")


def _memcpy_sites(cpu_ops, lo: float, hi: float, steps: int, root: str) -> list[dict]:
    """Each cudaMemcpy* runtime call in [lo, hi): the innermost enclosing op with a Python stack, grouped."""
    with_stack = [c for c in cpu_ops if c.stack and not c.name.startswith("cudaMemcpy")]
    sites: dict[str, dict] = {}
    for e in cpu_ops:
        if not e.name.startswith("cudaMemcpy") or not lo <= e.time_range.start < hi:
            continue
        outer = [c for c in with_stack if c.thread == e.thread and c.time_range.start <= e.time_range.start
                 and e.time_range.end <= c.time_range.end]
        inner = min(outer, key=lambda c: c.time_range.end - c.time_range.start) if outer else None
        key = f"{inner.name} @ {_repo_frames(inner.stack, root)}" if inner else "(no enclosing op)"
        site = sites.setdefault(key, {"site": key, "count": 0, "host_ms": 0.0, "max_ms": 0.0})
        ms = (e.time_range.end - e.time_range.start) / 1e3
        site["count"] += 1 / steps
        site["host_ms"] += ms / steps
        site["max_ms"] = max(site["max_ms"], ms)
    return sorted(sites.values(), key=lambda s: -s["host_ms"])[:12]


def summarise(prof, steps: int, wall_s: float) -> dict:
    """Busy / idle, blocking runtime calls, long GPU gaps and top host ops from a finished profiler; when the run was
    a collect call (step markers), also the same measures over its steady window alone and the call sites of its
    host-device copies."""
    events = prof.events()
    kernels = [e for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    gpu = [(e.time_range.start, e.time_range.end) for e in kernels]
    cpu_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    root = str(Path(__file__).resolve().parents[1])

    def window(lo: float, hi: float, n: int) -> dict:
        blocking: dict[str, list[float]] = {}
        inside = [e for e in cpu_ops if lo <= e.time_range.start < hi]
        for e in inside:
            name = e.name
            if any(name == b or name.startswith(b + "_") or name.startswith(b + "Async") for b in BLOCKING):
                blocking.setdefault(name, []).append((e.time_range.end - e.time_range.start) / 1e3)
        spans = sorted((max(s, lo), min(e, hi)) for s, e in gpu if e > lo and s < hi)
        gaps, end = [], lo
        for s, e in spans + [(hi, hi)]:
            if s - end > 1000:
                running = [c for c in inside if c.time_range.start <= end <= c.time_range.end
                           and not c.name.startswith("ProfilerStep") and c.name != STEP_MARK]
                at = min(running, key=lambda c: c.time_range.end - c.time_range.start) if running else None
                gaps.append({"gap_ms": (s - end) / 1e3, "host_op_at_start": at.name if at else None,
                             "where": _repo_frames(at.stack, root) if at is not None and at.stack else None})
            end = max(end, e)
        busy = _union_ms(spans)
        per_kernel: dict[str, float] = {}
        for e in kernels:
            if lo <= e.time_range.start < hi and e.name != STEP_MARK:  # the step range's GPU-side twin
                per_kernel[e.name[:90]] = per_kernel.get(e.name[:90], 0.0) + (e.time_range.end - e.time_range.start)
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
        return {"top_kernels_ms_per_step": {name: us / 1e3 / n for name, us in top},"wall_ms_per_step": (hi - lo) / 1e3 / n, "gpu_busy_ms_per_step": busy / n,
                "gpu_idle_share": max(0.0, 1 - busy / ((hi - lo) / 1e3)),
                "blocking_calls_per_step": {k: {"count": len(v) / n, "host_ms": sum(v) / n}
                                            for k, v in sorted(blocking.items())},
                "gpu_gaps_over_1ms": sorted(gaps, key=lambda g: -g["gap_ms"])[:20],
                "gpu_gaps_total_ms_per_step": sum(g["gap_ms"] for g in gaps) / n}

    lo = min((s for s, _ in gpu), default=0.0)
    hi = max([e.time_range.end for e in cpu_ops] + [e for _, e in gpu] + [lo])
    out = window(lo, hi, steps)
    out["wall_ms_per_step"] = 1e3 * wall_s / steps
    out["gpu_idle_share"] = max(0.0, 1 - out["gpu_busy_ms_per_step"] * steps / (1e3 * wall_s))
    steady = _steady_window(cpu_ops)
    if steady is not None:
        out["steady"] = window(*steady)
        out["steady"]["steps"] = steady[2]
        out["steady"]["memcpy_sites"] = _memcpy_sites(cpu_ops, *steady, root)
    threads: dict[int, float] = {}
    for e in cpu_ops:
        threads[e.thread] = threads.get(e.thread, 0.0) + e.self_cpu_time_total / 1e3
    out["host_self_ms_per_step_by_thread"] = {str(k): v / steps for k, v in sorted(threads.items())}
    out["top_host_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return out


def profile(fn, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    ct.sync()
    with torch_profile(activities=acts, with_stack=True) as prof:
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
        if r.get("steady"):
            st = r["steady"]
            lines += [f"Steady window ({st['steps']} steps between the second and the last launch, set-up and drain "
                      f"left out): {st['wall_ms_per_step']:.1f} ms/step, GPU busy {st['gpu_busy_ms_per_step']:.1f}, "
                      f"idle {100 * st['gpu_idle_share']:.1f}%, gaps > 1 ms {st['gpu_gaps_total_ms_per_step']:.1f} "
                      "ms/step. Blocking calls per step: " + ", ".join(
                          f"{k} {c['count']:.1f} ({c['host_ms']:.2f} ms)" for k, c in st["blocking_calls_per_step"].items()),
                      "", "Its longest GPU gaps: " + "; ".join(
                          f"{g['gap_ms']:.1f} ms (host in {g['host_op_at_start']} at {g['where']})"
                          for g in st["gpu_gaps_over_1ms"][:6]), "",
                      "| host-device copies per step | host ms per step | longest ms | op @ repository frames |",
                      "|---|---|---|---|"]
            lines += [f"| {m['count']:.1f} | {m['host_ms']:.2f} | {m['max_ms']:.2f} | {m['site']} |"
                      for m in st["memcpy_sites"]]
            lines += ["", "| GPU kernel (steady window) | ms per step |", "|---|---|"]
            lines += [f"| `{k}` | {ms:.2f} |" for k, ms in st["top_kernels_ms_per_step"].items()]
            lines.append("")
        else:
            lines += ["| GPU kernel | ms per step |", "|---|---|"]
            lines += [f"| `{k}` | {ms:.2f} |" for k, ms in r["top_kernels_ms_per_step"].items()]
            lines.append("")
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
