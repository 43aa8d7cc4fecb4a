"""SAE-guided fine-tuning throughput: ``qwen_scope.applications.finetune`` (LM loss + a feature penalty at one layer,
AdamW) on the Qwen3.5-2B-shaped model, with transformers' GDN op as installed (FLA), FlashQLA's op patched in, and
ours (``flashqla_kernels.patched_transformers``), in one run; ``ours_torch_glue`` is ours with the glue's torch
formulation under grad (``ops.GRAD_KERNELS`` off), the A/B of the glue's backward kernels.

Model: the random 2B-shaped config of ``collect_throughput.py`` in fp32 weights under bf16 autocast (``precision=
"bf16"``: the weights and AdamW's state stay fp32), one random 32K-wide TopK SAE (k = 100) at layer 12, rows of
``--seq-len`` tokens (4096), ``--batch`` rows a step (8) in micro-batches of ``--micro`` rows (2, or 1 on an 80 GB
GPU), the bundled nano model's byte-level
tokenizer over the nano corpus (token ids are bytes: any vocabulary takes them). Timing: ``finetune`` is called with ``--steps`` and
with 1 step; the difference over ``steps - 1`` is one training step without the fixed costs (the held-out
evaluations before and after, the first step's compiles), reported as training tokens/s.

Usage (GPU): ``python benchmarks/train_step.py --out benchmarks/results`` writes ``train_step.json`` and ``.md``
(after every arm, so a run stopped by its time limit keeps the arms it finished); ``--profile`` adds one profiled
training step per arm (device time by kind of kernel: GEMM, GDN op, norms, conv, copies, elementwise, attention);
``--sync-sites`` lists where one step's host waited for the GPU (torch's CUDA sync debugging); ``--idle`` where
the GPU waited for the host (its gaps in one profiled step);
``--tiny`` runs every arm on a tiny model (CPU is fine) as a dry run. ``--precompile-only`` (no GPU, ``--jobs N``
processes) builds the kernels of the "ours" arm: the GDN op's forward chunk kernels and backward kernels for the 2B
layer as the fused layer trains it (bf16 under autocast, the l2norm in the glue, no initial or final state), the
glue's forward and backward kernels, and the held-out evaluations' forward kernels (``gdn_layer.py``'s list).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import collect_throughput as ct  # noqa: E402 - sync and the environment report
import steer_generate  # noqa: E402 - the 2B-shaped random model and random SAE

DEVICE = steer_generate.DEVICE
LAYER = 12


def build_scope(tiny: bool):
    """The 2B-shaped (or tiny) random model in fp32 weights, the nano tokenizer and a random SAE at ``LAYER``."""
    from transformers import AutoTokenizer

    from qwen_scope import Scope
    from qwen_scope.nano import NANO_DIR

    model = steer_generate.build_model(tiny).float().requires_grad_(True).train()
    config = model.config
    layer = min(LAYER, config.num_hidden_layers - 1)
    sae = steer_generate.random_sae(config.hidden_size, 256 if tiny else 32768, 8 if tiny else 100, torch.float32)
    return Scope(model, AutoTokenizer.from_pretrained(str(NANO_DIR)), {layer: sae}), layer


def qla_op_patch():
    """transformers' chunk-op global of the Qwen3.5 modeling file pointed at FlashQLA's op (its FLA-style API)."""
    from flash_qla import chunk_gated_delta_rule as qla
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    def op(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, cu_seqlens=None, scale=None, **kwargs):
        return qla(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   cu_seqlens=cu_seqlens)

    @contextlib.contextmanager
    def patched():
        original = modeling.torch_chunk_gated_delta_rule
        modeling.torch_chunk_gated_delta_rule = op
        try:
            yield
        finally:
            modeling.torch_chunk_gated_delta_rule = original

    return patched()


@contextlib.contextmanager
def _torch_glue_under_grad():
    """The glue's backward kernels off (``ops.GRAD_KERNELS``): under grad the glue runs its torch formulation."""
    from flashqla_kernels.decoder import ops

    saved, ops.GRAD_KERNELS = ops.GRAD_KERNELS, False
    try:
        yield
    finally:
        ops.GRAD_KERNELS = saved


def arm_context(name: str):
    if name in ("ours", "ours_torch_glue"):
        from flashqla_kernels import patched_transformers

        if name == "ours":
            return patched_transformers(fused_layer=True)
        stack = contextlib.ExitStack()
        stack.enter_context(patched_transformers(fused_layer=True))
        stack.enter_context(_torch_glue_under_grad())
        return stack
    if name == "flashqla":
        return qla_op_patch()
    return contextlib.nullcontext()  # "transformers": the op as installed (FLA's kernels when importable)


def precompile(micro: int, jobs: int = 1) -> int:
    """Compile the kernels the "ours" arm's training step runs (``micro`` rows a micro-batch): the fused layer's glue
    forward and backward kernels and the GDN op's (the l2norm in the glue), and the whole-model benchmark's list
    (``layer_kernels``: the held-out evaluations' forward); needs nvcc, no GPU. Returns the number of failures."""
    from chunk_kernels import chunk_specs, compile_all
    from layer_kernels import precompile as layer_precompile

    from flashqla_kernels.gated_delta_rule.hopper import backward

    cfg = ct.model_config()  # the 2B shape build_scope trains
    Hk, Hv, Kd = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    from flashqla_kernels import toolkit
    from flashqla_kernels.decoder.hopper import cross_entropy

    fwd = chunk_specs([(Hk, Hv, Kd, "bfloat16", micro, False)], 132, final=(False,), scans=True)
    failed = compile_all(fwd, jobs)
    # the LM loss: the head's cross entropy and the backward's scale, over bf16 logits
    failed += [(f"{b.__name__}{a}", err) for b, a, err in toolkit.compile_many(
        [(cross_entropy.build_cross_entropy, (cfg.vocab_size, "bfloat16")),
         (cross_entropy.build_scale, (cfg.vocab_size, "bfloat16"))])]
    n_bwd = backward.precompile([(Hk, Hv, Kd, Kd, "bfloat16", False, False, False)], workers=jobs)
    for spec, err in failed:
        print(f"  FAILED {spec}: {err}", flush=True)
    print(f"precompiled {len(fwd) - len(failed)} forward chunk kernels and {n_bwd} backward kernels", flush=True)
    return len(failed) + layer_precompile(jobs)


def gpu_idle(fn, top: int = 25) -> dict:
    """One call of ``fn`` under torch.profiler: the GPU's busy time (the union of its kernels) against the span from
    its first kernel to its last, the idle time by gap length, and the ``top`` longest gaps, each with the host op
    that issued the kernel the GPU waited for (the innermost op around the last launch before the gap's end)."""
    import bisect

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    ct.sync()
    with profile(activities=acts) as prof:
        fn()
        ct.sync()
    events = prof.events()
    cuda = torch.autograd.DeviceType.CUDA
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == cuda and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    cpu = [e for e in events if e.device_type != cuda]
    launches = sorted((e.time_range.start, e.thread) for e in cpu if e.name.startswith(("cudaLaunch", "cuLaunch")))
    starts = [t for t, _ in launches]
    gaps, busy, end = [], 0.0, spans[0][0]
    for s, e in spans:
        if s > end:
            gaps.append((s - end, end, s))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    span = end - spans[0][0]
    buckets = {"< 10 us": 0.0, "10-100 us": 0.0, "0.1-1 ms": 0.0, "> 1 ms": 0.0}
    for g, _, _ in gaps:
        key = "< 10 us" if g < 10 else "10-100 us" if g < 100 else "0.1-1 ms" if g < 1000 else "> 1 ms"
        buckets[key] += g / 1e3
    longest = []
    for g, _, s in sorted(gaps, reverse=True)[:top]:
        i = bisect.bisect_right(starts, s) - 1
        where = "?"
        if i >= 0:
            t, thread = launches[i]
            around = [e for e in cpu if e.thread == thread and e.time_range.start <= t <= e.time_range.end
                      and not e.name.startswith(("cuda", "cu", "ProfilerStep"))]
            if around:
                where = min(around, key=lambda e: e.time_range.end - e.time_range.start).name[:80]
        longest.append(f"{g / 1e3:.2f} ms before a kernel issued in {where}")
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "idle_ms_by_gap": buckets, "gaps": len(gaps), "longest_gaps": longest}


def loss_check(scope, texts, seq: int, micro: int, precision: str) -> dict:
    """finetune's LM loss (``causal_lm_loss``) beside transformers' ``model(labels=...).loss`` on one micro-batch,
    as the step computes it (autocast in bf16), with stock transformers modules."""
    from qwen_scope.applications.finetune import _autocast, pack_texts
    from qwen_scope.applications.lm_loss import causal_lm_loss

    x = pack_texts(scope.tokenizer, texts, seq)[:micro].to(scope.device)
    with torch.no_grad(), _autocast(scope.device, precision):
        ours = float(causal_lm_loss(scope.adapter, x))
        theirs = float(scope.model(input_ids=x, labels=x, use_cache=False).loss)
    return {"causal_lm_loss": ours, "transformers": theirs, "rel_diff": abs(ours - theirs) / abs(theirs)}


def default_micro() -> int:
    """Rows a micro-batch: 2 where the GPU has room for them (the H200's 141 GB), else 1 (an 80 GB H100 runs out of
    memory at 2 rows: the fp32 logits of 2 x 4096 tokens over 248K entries alone take 7.6 GiB, twice over)."""
    if DEVICE != "cuda":
        return 2
    return 2 if torch.cuda.get_device_properties(0).total_memory >= 100 * 2**30 else 1


def write_results(result: dict, out: Path) -> str:
    """``train_step.json`` and ``.md`` under ``out`` from the arms timed so far; returns the markdown."""
    base = next((r["tokens_per_s"] for r in result["arms"] if r["arm"] == "flashqla" and "tokens_per_s" in r), None)
    for r in result["arms"]:
        if base and "tokens_per_s" in r:
            r["vs_flashqla"] = r["tokens_per_s"] / base
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step.json").write_text(json.dumps(result, indent=1))
    e = result["env"]
    lines = [f"# SAE-guided fine-tuning step ({e['gpu']}, {e['date']})", "",
             f"torch {e['torch']}, transformers {e['transformers']}, tilelang {e['tilelang']}, commit {e['commit']}. "
             f"{result['model']}; {result['batch']} x {result['seq_len']} tokens a step, LM loss + a feature penalty "
             f"at layer {result['layer']}, AdamW, through `qwen_scope.applications.finetune`; CUDA allocator: "
             f"{e.get('allocator', 'default')}.", "",
             "| arm | s a step | training tokens/s | x FlashQLA's op | peak GB | host issue / GPU drain, s | note |",
             "|---|---|---|---|---|---|---|"]
    for r in result["arms"]:
        peak = f"{r['peak_gb']:.1f}" if "peak_gb" in r else "-"
        if r.get("alloc_retries"):
            peak += f" ({r['alloc_retries']} allocator retries)"
        host = f"{r['issue_s']:.3f} / {r['drain_s']:.3f}" if "issue_s" in r else "-"
        if "tokens_per_s" in r:
            lines.append(f"| {r['arm']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                         f"{r.get('vs_flashqla', float('nan')):.2f} | {peak} | {host} | |")
        else:
            lines.append(f"| {r['arm']} | - | - | - | {peak} | {host} | {r.get('error') or r.get('note')} |")
    check = result.get("loss_check")
    if check:
        lines += ["", f"The step's LM loss (`causal_lm_loss`) on one micro-batch: {check['causal_lm_loss']:.6f}, "
                  f"transformers' `model(labels=...).loss` {check['transformers']:.6f} (relative difference "
                  f"{check['rel_diff']:.1e})."]
    profiled = [r for r in result["arms"] if "profile" in r]
    if profiled:
        kinds = sorted({k for r in profiled for k in r["profile"]["ms"]})
        lines += ["", "One training step profiled (torch.profiler; device time by kind of kernel, ms; CPU time in a "
                  "CPU dry run):", "", "| arm | " + " | ".join(kinds) + " | total |",
                  "|---|" + "---|" * (len(kinds) + 1)]
        for r in profiled:
            ms = r["profile"]["ms"]
            lines.append(f"| {r['arm']} | " + " | ".join(f"{ms.get(k, 0.0):.1f}" for k in kinds)
                         + f" | {r['profile']['total_ms']:.1f} |")
        for r in profiled:
            lines += ["", f"Top kernels, {r['arm']}:", ""] + [f"- {k}" for k in r["profile"]["top_kernels"]]
            lines += ["", f"Top torch ops by their kernels' device time, {r['arm']}:", ""] + [
                f"- {k}" for k in r["profile"].get("top_torch_ops", [])]
            if r["profile"].get("top_host_ops"):
                lines += ["", f"Top ops by host (CPU) self time, {r['arm']}:", ""] + [
                    f"- {k}" for k in r["profile"]["top_host_ops"]]
    for r in result["arms"]:
        idle = r.get("gpu_idle")
        if idle:
            lines += ["", f"The GPU in one profiled training step, {r['arm']}: {idle['busy_ms']:.0f} ms busy of "
                      f"{idle['span_ms']:.0f} ms from its first kernel to its last; idle {idle['idle_ms']:.0f} ms in "
                      f"{idle['gaps']} gaps (" + ", ".join(f"{k}: {v:.0f} ms" for k, v in
                                                           idle["idle_ms_by_gap"].items()) + "). Longest:", ""]
            lines += [f"- {g}" for g in idle["longest_gaps"][:12]]
    for r in result["arms"]:
        if "sync_sites" in r:
            sites = r["sync_sites"]
            lines += ["", f"Where the host waited for the GPU in one training step, {r['arm']} (torch's CUDA sync "
                      f"debugging; {sum(e['count'] for e in sites)} waits):", ""]
            lines += [f"- {e['count']} x {e['site']}" for e in sites] or ["- none"]
    text = "\n".join(lines) + "\n"
    (out / "train_step.md").write_text(text)
    return text


def main(argv=None) -> None:
    from qwen_scope.applications import FinetuneConfig, finetune
    from qwen_scope.nano import nano_corpus

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tiny", action="store_true", help="dry run of every arm on a tiny model (CPU ok)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 4; tiny 2)")
    parser.add_argument("--batch", type=int, default=None, help="rows a step (default 8; tiny 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a row (default 4096; tiny 64)")
    parser.add_argument("--micro", type=int, default=None,
                        help="rows a micro-batch (default 2 on a GPU of 100 GB or more, else 1; tiny 1)")
    parser.add_argument("--arms", default="transformers,flashqla,ours", type=lambda a: a.split(","),
                        help="of transformers, flashqla, ours, ours_torch_glue (ours with the glue's torch "
                             "formulation under grad: the backward kernels' share)")
    parser.add_argument("--precompile-only", action="store_true", help="build the arm's kernels and stop (no GPU)")
    parser.add_argument("--jobs", type=int, default=1, help="processes for --precompile-only")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one training step of each arm: device time by kind of kernel")
    parser.add_argument("--idle", action="store_true",
                        help="also profile one training step of each arm for the GPU's idle gaps: how long, and "
                             "which host op issued the kernel each long one waited for")
    parser.add_argument("--sync-sites", action="store_true",
                        help="also run one training step of each arm under torch's CUDA sync debugging and list "
                             "where the host waited for the GPU")
    args = parser.parse_args(argv)
    if args.precompile_only:
        raise SystemExit(1 if precompile(args.micro or 2, args.jobs) else 0)
    steps, batch = args.steps or (2 if args.tiny else 4), args.batch or (2 if args.tiny else 8)
    seq = args.seq_len or (64 if args.tiny else 4096)
    micro = args.micro or (1 if args.tiny else default_micro())
    if batch % micro:
        raise SystemExit(f"--batch {batch} is not a multiple of --micro {micro}")
    texts = nano_corpus()
    held, train = texts[:4], texts[4:]
    scope, layer = build_scope(args.tiny)
    precision = "bf16" if DEVICE == "cuda" else "fp32"
    # the caching allocator's settings change a step's time (expandable segments: ~8% of ours on an H100)
    env = dict(ct.versions(), allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"))
    result = {"env": env, "model": "tiny Qwen3.5 (dry run)" if args.tiny else
              "Qwen3.5-2B-shaped random, fp32 weights, bf16 autocast", "batch": batch, "seq_len": seq,
              "micro": micro, "steps": steps, "layer": layer, "arms": []}

    def config(n: int) -> FinetuneConfig:  # the timed calls and the profiled step train alike
        return FinetuneConfig(steps=n, lr=1e-5, batch_size=micro, grad_accum=batch // micro, seq_len=seq,
                              precision=precision, eval_batch_size=micro, max_eval_rows=micro)

    def run(n: int) -> float:
        cfg = config(n)
        ct.sync()
        start = time.perf_counter()
        finetune(scope, train, held, {layer: [7]}, cfg, progress=False)
        ct.sync()
        return time.perf_counter() - start

    ft = sys.modules[finetune.__module__]
    train_rows = ft.pack_texts(scope.tokenizer, train, seq, what="train_texts")

    def train_only(n: int) -> None:
        # the training steps alone: finetune's own loop (its module's private _train), without the held-out
        # evaluations finetune runs before and after
        ft._train(scope, train_rows, ft._penalties(scope, {layer: [7]}), config(n), False)

    def issue_and_drain() -> tuple[float, float]:
        # one step: the seconds the host takes to issue it, then the seconds the GPU still needs after the host is
        # done; a drain near zero means the GPU waited on the host (the step is host-bound)
        ct.sync()
        start = time.perf_counter()
        train_only(1)
        issued = time.perf_counter()
        ct.sync()
        return issued - start, time.perf_counter() - issued

    result["loss_check"] = loss_check(scope, train, seq, micro, precision)
    for name in args.arms:
        row = {"arm": name}
        try:
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.reset_accumulated_memory_stats()
            with arm_context(name):
                run(1)  # warm-up: kernels compiled, the optimizer's first allocations
                one, many = run(1), run(steps)
                row["issue_s"], row["drain_s"] = issue_and_drain()
                if args.profile:
                    import gdn_layer

                    # a training step's glue is spread over many small kernels: a longer list than a forward's
                    row["profile"] = gdn_layer.breakdown(lambda: train_only(1), DEVICE, top_n=30)
                if args.idle and DEVICE == "cuda":
                    row["gpu_idle"] = gpu_idle(lambda: train_only(1))
                if args.sync_sites and DEVICE == "cuda":
                    import collect_profile

                    row["sync_sites"] = collect_profile.sync_sites(lambda: train_only(1), limit=16)
            if DEVICE == "cuda":
                row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                # the caching allocator's retries: each frees cached blocks (a device-wide sync) to fit a request
                row["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            if many > one:
                step_s = (many - one) / max(steps - 1, 1)
                row.update(step_s=step_s, tokens_per_s=batch * seq / step_s, call_s=many)
            else:  # the extra steps took less than the timer's noise (the tiny dry run on a CPU)
                row.update(call_s=many, note=f"{steps} steps timed no longer than 1 ({many:.3f} s vs {one:.3f} s)")
        except Exception as err:  # an arm that fails is reported in the table, the others still run
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        result["arms"].append(row)
        print(row, flush=True)
        # after every arm: a run stopped by its time limit still leaves the arms it finished
        print(write_results(result, args.out), flush=True)


if __name__ == "__main__":
    main()
