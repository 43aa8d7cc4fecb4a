"""Whole-model forward with the fused GDN layer on one H200: tokens/s and where the CUDA time goes, per arm.

Model: the Qwen3.5-2B-shaped random bf16 model of ``shared/reference/anchors-h200.md`` (hidden 2048, 24 layers: 18 GDN
with Hk = Hv = 16, K = V = 128, and 6 full attention, vocab 248320), forward of ``model.model`` with
``use_cache=False`` and forward hooks keeping all 24 decoder-layer outputs (the anchors' method), 8 x 4096 tokens.
Arms (one run, one process):
  ours           ``patch_transformers(backend="tilelang", fused_layer=True)``: the fused GDN layer (token-major conv +
                 gates + l2norm kernel, our chunk kernels, gated-RMSNorm kernel), the one-pass zero-centred
                 RMSNorm kernel for every decoder / final / q-k norm, every MLP's gate and up GEMMs as one GEMM with
                 ``silu(gate) * up`` in its epilogue and the attention layers' q/k norm + RoPE and gate kernels
                 and the decoder layers' residual adds fused into the post-attention norm and ``down_proj``
                 (``patch_gdn_layers``' defaults ``rms_norms=True, mlp=True, attention=True, decoder=True``);
  ours_op        ``patch_transformers()``: the op patch alone, as a user calls it (automatic backend), transformers'
                 GDN layer, norms, MLP, attention and decoder layers around our chunk op (no fused layer);
  ours+graph     ``ours`` captured once into a CUDA graph and replayed (same static input ids, the kept outputs are the
                 graph's): what the forward costs with no host launch overhead at all, i.e. how much of the gap
                 between wall time and CUDA time is the host's (the hooks ran at capture);
  ours+flash     ``ours`` with SDPA restricted to its flash backend: the attention backend's effect (H200: flash
                 13.1 ms against cuDNN's 5.8 ms a forward, 182 K against 189 K tokens/s). Under graph
                 capture transformers materialises the causal mask (``is_tracing``), so ``ours+graph``'s attention
                 is cuDNN with a mask (27 ms) and flash, which takes no mask, cannot run there;
  ours+swiglu, ours+silu_mul   ``ours`` with the MLP's gate and up projections in one GEMM with the SwiGLU in its
                 epilogue (``patching.mlp.FUSED_MLP_GEMM`` on, the default), and as two cuBLAS GEMMs + the silu_mul
                 kernel (off);
  ours-decoder   ``ours`` without the decoder-layer patch (``decoder=False``): transformers' decoder forward, its two
                 residual adds as add kernels, against ``ours``' add + post-attention norm kernel and ``down_proj``
                 accumulating into the sum;
  ours+compile   the fused GDN layer left eager (graph breaks there), ``torch.compile`` of the rest of ``model.model``:
                 inductor fuses the MLP / attention-layer / RMSNorm glue (our RMSNorm and MLP kernels not used);
  flashqla_op    transformers' layer with FlashQLA's ``chunk_gated_delta_rule`` in place of its chunk op (the
                 peer the op patch is measured against: ``ours_op`` must beat it);
  qla_op         transformers' layer with our FlashQLA-style chunk op patched in, the kernels forced
                 (``patch_transformers(backend="tilelang")``);
  fla            transformers' layer as imported: FLA's Triton op when flash-linear-attention is importable;
  torch          transformers' pure-torch op (``__wrapped__``), at ``--torch-batch`` sequences (memory);
  compile        ``torch.compile`` of ``model.model`` with the qla_op patch (the op left eager).
Correctness first: on 1 x 1024 tokens every arm's decoder-layer outputs and GDN / attention module outputs are compared
with the torch arm (relative L2, per layer type). Timing: ``--warmup`` forwards, then ``--steps`` forwards between
syncs. Breakdown: one profiled forward (torch.profiler), kernels bucketed by name into GEMM / GDN op / conv / norms
and reductions / copies / elementwise / attention / other; "glue" = everything but GEMM, GDN op and attention.

Usage: first, anywhere with nvcc, ``TILELANG_CACHE_DIR=.tlcache python benchmarks/gdn_layer.py --precompile``; then
on the GPU (carrying ``.tlcache``, same ``TILELANG_CACHE_DIR``) ``python benchmarks/gdn_layer.py [--arms ours,...]``,
which writes ``gdn_layer.json`` and ``gdn_layer.md`` to ``--out`` after every arm. ``--tiny`` is a CPU dry run.
``--gpu-tests`` instead runs every case of ``tests/flashqla_kernels/test_decoder_gpu.py`` as plain function calls
(no pytest runner needed on the device) and writes ``gdn_layer_gpu_tests.txt`` (PASS/FAIL per case, printed errors).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("FLA_FLASH_QLA", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_kernels import precompile  # noqa: E402 - the precompile list, in its own module

ARMS = ("ours", "ours_op", "flashqla_op", "qla_op", "fla", "torch", "compile", "ours+compile", "ours+graph",
        "ours+flash", "ours+swiglu", "ours+silu_mul", "ours-decoder")
ANCHOR_TOKENS_PER_S = {"qla_op": 99.7e3, "fla": 96.9e3, "torch": 41.6e3}  # anchors-h200.md (FlashQLA / FLA / torch)
CATEGORIES = [  # (bucket, kernel-name pattern), first match wins
    ("elementwise", r"attention_gate_mul"),  # the attention layers' glue kernel, not attention itself
    ("conv", r"gdn_conv|conv1d|convolution|conv_depthwise|depthwise|causal_conv|cudnn.*conv|im2col"),
    ("norms", r"gated_rms|rms_?norm|layer_?norm|triton_(red|per)_|reduce_kernel|reduce|welford|norm"),
    ("GDN op", r"gdn_|chunk_|recompute_w_u|solve_tril|kkt|fused_recurrent|gated_delta|cumsum_|l2norm_fwd|gdr_|"
               r"prepare_d?h|group_reduce|warmup_chunks|correct_h0"),
    ("attention", r"flash|fmha|sdpa|attention|cudnn_generated|softmax"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|matmul|aten::(mm|addmm|bmm|linear)"),
    ("copies", r"copy|cat|transpose|permute|contiguous|memcpy|memset|index|gather|scatter|aten::(to|_to_copy|clone)"),
    ("elementwise", r"elementwise|triton_poi_|silu|sigmoid|softplus|exp|mul|add|aten::"),
]


def config(tiny: bool, value_heads: int | None = None):
    """The model's config; ``value_heads`` replaces the GDN layers' value heads (16 in the 2B model, 2 in the tiny
    one): 32 over the 16 key heads is the head layout of Qwen3.5-9B and up, for which transformers before 5.23
    repeats q and k to the value heads and hands the op v alone as a channels-first view."""
    import transformers as tf

    if tiny:
        return tf.Qwen3_5TextConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=value_heads or 2,
            linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)
    return tf.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=value_heads or 16,
        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False, max_position_embeddings=8192)


def build_model(tiny: bool, device: str, value_heads: int | None = None):
    import transformers as tf

    torch.manual_seed(0)
    cfg = config(tiny, value_heads)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = tf.Qwen3_5ForCausalLM(cfg)
    return model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval().requires_grad_(False)


class Arms:
    """Puts the model in each arm's configuration; ``use(name)`` returns the callable to run (maybe compiled)."""

    def __init__(self, model, device: str):
        from transformers.models.qwen3_5 import modeling_qwen3_5

        from flashqla_kernels.patching import mlp as mlp_patch  # fails early if the package is missing
        from flashqla_kernels.patching import op as op_patch

        self.model, self.device = model, device
        self.module = modeling_qwen3_5
        self.originals = {n: getattr(self.module, n) for n in ("torch_chunk_gated_delta_rule",
                                                                "torch_recurrent_gated_delta_rule")}
        implementation, _ = op_patch.transformers_op_parts(self.originals["torch_chunk_gated_delta_rule"])
        self.has_fla = getattr(implementation, "__module__", "").startswith("fla")
        self.backend = "tilelang" if device == "cuda" else None
        self.fused_mlp_gemm = mlp_patch.FUSED_MLP_GEMM

    def reason_unavailable(self, name: str) -> str | None:
        if name == "fla" and not self.has_fla:
            return "flash-linear-attention is not importable: transformers' op is its torch fallback"
        if name == "flashqla_op" and flashqla_chunk() is None:
            return "flash-qla is not importable"
        if "+graph" in name and self.device != "cuda":
            return "CUDA graphs need a CUDA device"
        if name.endswith("+flash") and self.device != "cuda":
            return "SDPA's flash backend needs a CUDA device"
        return None

    def use(self, name: str):
        from flashqla_kernels.patching import (
            gdn_layers_patched, patch_gdn_layers, patch_transformers, unpatch_transformers,
        )
        from flashqla_kernels.patching import mlp as mlp_patch

        unpatch_transformers()
        for n, f in self.originals.items():
            setattr(self.module, n, f)
        base = name.removesuffix("+compile")
        # the MLP's gate/up GEMMs: fused with the SwiGLU (+swiglu), two cuBLAS GEMMs + silu_mul (+silu_mul), else the
        # package default
        mlp_patch.FUSED_MLP_GEMM = {"ours+swiglu": True, "ours+silu_mul": False}.get(name, self.fused_mlp_gemm)
        if name in ("ours", "ours+graph", "ours+flash", "ours+swiglu", "ours+silu_mul"):
            patch_transformers(backend=self.backend, fused_layer=True)
        elif name == "ours-decoder":  # transformers' decoder forward: its residual adds as two add kernels
            patch_transformers(backend=self.backend)
            patch_gdn_layers(self.backend, decoder=False)
        elif name == "ours+compile":
            # the norms, the MLP and the attention glue are left to inductor here: compilation against hand fusion
            patch_transformers(backend=self.backend)
            patch_gdn_layers(self.backend, rms_norms=False, mlp=False, attention=False)
        elif name == "ours_op":  # the op patch as a user calls it: the automatic backend
            patch_transformers()
        elif base in ("qla_op", "compile"):
            patch_transformers(backend=self.backend)
        elif name == "flashqla_op":
            self.module.torch_chunk_gated_delta_rule = flashqla_for_transformers(flashqla_chunk())
        elif base == "torch":
            for n, f in self.originals.items():
                setattr(self.module, n, getattr(f, "__wrapped__", f))
        if not (name.endswith("+compile") or name == "compile"):
            return self.model.model
        # Leave our kernels eager: dynamo breaks the graph around them and compiles the rest.
        for n in self.originals:
            setattr(self.module, n, torch.compiler.disable(getattr(self.module, n)))
        if gdn_layers_patched():
            cls = self.module.Qwen3_5GatedDeltaNet
            cls.forward = torch.compiler.disable(cls.forward)
        return torch.compile(self.model.model)


def flashqla_chunk():
    """FlashQLA's public chunk op, or None where flash-qla is not installed."""
    try:
        from flash_qla import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def flashqla_for_transformers(fn):
    """FlashQLA's op under transformers' call convention for ``torch_chunk_gated_delta_rule`` (extra keywords such
    as ``chunk_size`` dropped), as a user would patch it in."""
    def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, scale=None,
                               **kwargs):
        return fn(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens)
    return chunk_gated_delta_rule


def forward_fn(run, ids, keep: list):
    def fwd():
        keep.clear()
        return run(input_ids=ids, use_cache=False)
    return fwd


def graphed_forward_fn(run, ids, keep: list):
    """One forward captured into a CUDA graph (after two warm-up forwards on a side stream, as torch requires);
    ``fwd()`` replays it on the same ``ids``. The hooks fire during the capture only: ``keep`` then holds the
    graph's output tensors, which every replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            keep.clear()
            run(input_ids=ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    keep.clear()
    with torch.cuda.graph(graph):
        out = run(input_ids=ids, use_cache=False)

    def fwd():
        graph.replay()
        return out
    return fwd


def sdpa_backends(arm: str):
    """SDPA restricted to its flash backend for the ``+flash`` arms; no restriction otherwise."""
    import contextlib

    if not arm.endswith("+flash"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def hook_outputs(model, keep: list):
    return [layer.register_forward_hook(lambda m, a, o: keep.append(o)) for layer in model.model.layers]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_forward(fwd, steps: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        fwd()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fwd()
    sync(device)
    return (time.perf_counter() - t) / steps


def categorize(name: str) -> str:
    low = name.lower()
    for bucket, pattern in CATEGORIES:
        if re.search(pattern, low):
            return bucket
    return "other"


def breakdown(fwd, device: str, top_n: int = 12) -> dict:
    """Self time per bucket (ms) of one forward, CUDA kernels on the GPU (CPU ops in a CPU dry run); the ``top_n``
    kernels and torch ops by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        fwd()
        sync(device)
    out: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for evt in prof.key_averages():
        us = evt.self_device_time_total if device == "cuda" else evt.self_cpu_time_total
        if us <= 0 or (device == "cuda" and evt.device_type.name != "CUDA"):
            continue
        bucket = categorize(evt.key)
        out[bucket] = out.get(bucket, 0.0) + us / 1e3
        top.append((us / 1e3, f"{bucket}: {evt.key[:90]}"))
    total = sum(out.values())
    glue = total - sum(out.get(b, 0.0) for b in ("GEMM", "GDN op", "attention"))
    # which torch ops launch the glue kernels, with their input shapes (the kernel names alone do not say where a
    # copy or a cat comes from): aten ops by the device time of the kernels they launched
    ops = []
    for evt in prof.key_averages(group_by_input_shape=True):
        us = evt.device_time_total if device == "cuda" else evt.self_cpu_time_total
        if evt.key.startswith("aten::") and us > 0 and evt.key not in ("aten::mm", "aten::addmm", "aten::linear",
                                                                        "aten::matmul"):
            ops.append((us / 1e3, f"{evt.key} x{evt.count} {str(evt.input_shapes)[:110]}"))
    # where the host's time goes (a step whose GPU waits on the host is bounded by these, not by the kernels):
    # every op and Python-level range by its own CPU time
    host = sorted(((evt.self_cpu_time_total / 1e3, f"{evt.key[:90]} x{evt.count}") for evt in prof.key_averages()
                   if evt.self_cpu_time_total > 0), reverse=True)
    return {"ms": out, "total_ms": total, "glue_ms": glue, "glue_share": glue / total if total else 0.0,
            "top_kernels": [f"{ms:.2f} ms {name}" for ms, name in sorted(top, reverse=True)[:top_n]],
            "top_torch_ops": [f"{ms:.2f} ms {name}" for ms, name in sorted(ops, reverse=True)[:top_n + 3]],
            "top_host_ops": [f"{ms:.2f} ms {name}" for ms, name in host[:top_n]]}


def rel_l2(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def capture_modules(model, run, ids) -> dict[str, list]:
    """Outputs of every decoder layer, GDN module and attention module on one forward."""
    got: dict[str, list] = {"layer": [], "linear_attention": [], "full_attention": []}
    handles = []
    for layer in model.model.layers:
        handles.append(layer.register_forward_hook(lambda m, a, o: got["layer"].append(o.float())))
        mixer = getattr(layer, "linear_attn", None) or layer.self_attn
        kind = "linear_attention" if hasattr(layer, "linear_attn") else "full_attention"
        handles.append(mixer.register_forward_hook(
            lambda m, a, o, _k=kind: got[_k].append((o[0] if isinstance(o, tuple) else o).float())))
    try:
        with torch.no_grad():
            run(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


def versions(device: str) -> dict:
    out = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for dist in ("transformers", "triton", "tilelang", "flash-linear-attention", "fla-core", "flash-qla"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    out["commit"] = os.environ.get("QWEN_SCOPE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).parent).stdout.strip() or None
    return out


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_layer.json").write_text(json.dumps(result, indent=1))
    v = result["env"]
    buckets = ["GEMM", "GDN op", "conv", "norms", "copies", "elementwise", "attention", "other"]
    lines = [f"# Whole-model forward with the fused GDN layer ({v['gpu']}, {v['date']})", "",
             f"torch {v['torch']}, transformers {v['transformers']}, triton {v['triton']}, tilelang {v['tilelang']}, "
             f"fla {v['fla-core'] or v['flash-linear-attention']}, commit {v['commit']}. Model: {result['model']}; "
             f"{result['batch']} x {result['seqlen']} tokens per forward, use_cache=False, every decoder-layer output "
             "kept by a hook. Bar: ours >= 2x qla_op, glue <= 25% of CUDA time.", "",
             "| arm | tokens/s | ms/forward | x qla_op | CUDA ms | glue % | " + " | ".join(buckets) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(buckets)]
    qla = next((r["tokens_per_s"] for r in result["arms"] if r["arm"] == "qla_op" and "tokens_per_s" in r), None)
    for r in result["arms"]:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['arm']} | - | - | - | - | - | " + " | ".join("-" * len(buckets)) + f" | "
                         f"{r.get('error', r.get('note', ''))} |")
            continue
        b = r["breakdown"]
        ratio = f"{r['tokens_per_s'] / qla:.2f}" if qla else "-"
        lines.append(f"| {r['arm']} | {r['tokens_per_s']:,.0f} | {r['ms_per_forward']:.1f} | {ratio} | "
                     f"{b['total_ms']:.1f} | {100 * b['glue_share']:.0f}% | "
                     + " | ".join(f"{b['ms'].get(k, 0.0):.1f}" for k in buckets) + " |")
    speed = {r["arm"]: r["tokens_per_s"] for r in result["arms"] if "tokens_per_s" in r}
    if "ours_op" in speed and "flashqla_op" in speed:
        lines += ["", f"The op patch alone against FlashQLA's op in the same layer: ours_op / flashqla_op = "
                      f"{speed['ours_op'] / speed['flashqla_op']:.3f} (bar: > 1)."]
    lines += ["", f"Correctness (rel. L2 vs the torch arm on 1 x {result['check_tokens']} tokens; max over layers of "
              "each type: decoder-layer outputs, GDN module outputs, attention module outputs):", ""]
    lines += [f"- {arm}: {json.dumps(c)}" for arm, c in result["checks"].items()]
    lines += ["", "Top kernels per arm:", ""]
    for r in result["arms"]:
        if "breakdown" in r:
            lines += [f"- {r['arm']}: " + "; ".join(r["breakdown"]["top_kernels"][:6])]
    first = next((r for r in result["arms"] if r.get("breakdown", {}).get("top_torch_ops")), None)
    if first is not None:  # where the glue of the first arm comes from
        lines += ["", f"Torch ops of {first['arm']} by the device time of their kernels (GEMMs left out):", ""]
        lines += [f"- {x}" for x in first["breakdown"]["top_torch_ops"]]
    for r in result["arms"]:
        if r.get("profile"):  # --profile: where the wall time beyond the CUDA time goes
            pr = r["profile"]
            lines += ["", f"Profile of {r['arm']} ({pr['steps']} forwards under torch.profiler with Python stacks): "
                      f"wall {pr['wall_ms_per_step']:.1f} ms a forward, GPU busy {pr['gpu_busy_ms_per_step']:.1f}, "
                      f"idle {100 * pr['gpu_idle_share']:.1f}%; gaps > 1 ms {pr['gpu_gaps_total_ms_per_step']:.1f} "
                      "ms a forward. Blocking calls a forward: " + (", ".join(
                          f"{k} {c['count']:.1f} ({c['host_ms']:.2f} ms)"
                          for k, c in pr["blocking_calls_per_step"].items()) or "none"), ""]
            lines += [f"- gap {g['gap_ms']:.1f} ms: host in {g['host_op_at_start']} at {g['where']}"
                      for g in pr["gpu_gaps_over_1ms"][:8]]
            lines += [f"- host waited for the GPU {e['count']}x at {e['site']}" for e in pr.get("sync_sites", [])]
    (out / "gdn_layer.md").write_text("\n".join(lines) + "\n")


def profile_arm(fwd, steps: int) -> dict:
    """``collect_profile``'s analysis of ``steps`` forwards: GPU busy / idle, the GPU gaps over 1 ms with the host op
    and repository frames at their start, blocking runtime calls, and (one more run) torch's sync sites."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import collect_profile

    collect_profile.ct.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # its syncs follow the device

    def run():
        for _ in range(steps):
            fwd()

    out = collect_profile.profile(run, steps)
    out = {k: v for k, v in out.items() if k != "top_host_ops"}
    out["steps"] = steps
    out["sync_sites"] = collect_profile.sync_sites(run)
    return out


def run_gpu_tests(out: Path, only: str = "") -> int:
    """Run the GDN-layer GPU tests as plain calls (``plain_tests``: pytest itself optional); returns the number of
    failures. ``only``: comma-separated substrings; then just the cases whose id contains one of them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import plain_tests

    plain_tests.install_pytest_stand_in()  # before the test module's marks run
    from tests.flashqla_kernels import test_decoder_gpu as gpu_tests

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return plain_tests.run_module(gpu_tests, out / "gdn_layer_gpu_tests.txt",
                                  f"# {gpu_tests.__name__} on {gpu} (commit {versions('cpu')['commit']})", only,
                                  before_each=lambda: torch.manual_seed(0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--value-heads", type=int, default=None,
                        help="GDN value heads over the model's key heads (2B: 16 over 16; 32 is the 9B layout)")
    parser.add_argument("--torch-batch", type=int, default=2, help="sequences per forward in the torch arm")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run of every code path on a tiny model")
    parser.add_argument("--precompile", action="store_true", help="only fill the TileLang cache (CPU is enough)")
    parser.add_argument("--jobs", type=int, default=1, help="processes for --precompile")
    parser.add_argument("--gpu-tests", action="store_true", help="only run the decoder GPU tests (plain calls)")
    parser.add_argument("--only", default="", help="with --gpu-tests: comma-separated substrings of the case ids")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N forwards of each arm: GPU idle, its gaps and the host op at each")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other arms of an existing gdn_layer.json in --out (runs split across calls)")
    args = parser.parse_args(argv)
    if args.precompile:
        return 1 if precompile(args.jobs) else 0
    if args.gpu_tests:
        return 1 if run_gpu_tests(args.out, args.only) else 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on the H200, or pass --tiny for a CPU dry run")
    B, T = (2, 80) if args.tiny else (args.batch, args.seqlen)
    model = build_model(args.tiny, device, args.value_heads)
    vocab = model.config.vocab_size
    label = "tiny Qwen3.5 (CPU dry run)" if args.tiny else "Qwen3.5-2B-shaped random bf16"
    if args.value_heads:
        label += (f", GDN layers with {model.config.linear_num_value_heads} value heads over "
                  f"{model.config.linear_num_key_heads} key heads")
    result = {"env": versions(device), "model": label, "batch": B, "seqlen": T, "arms": [], "checks": {},
              "anchors_tokens_per_s": ANCHOR_TOKENS_PER_S}
    previous = args.out / "gdn_layer.json"
    if args.merge and previous.exists():
        old = json.loads(previous.read_text())
        result["arms"] = [r for r in old["arms"] if r["arm"] not in arms]
        result["checks"] = {a: c for a, c in old["checks"].items() if a not in arms}
    ctl = Arms(model, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    check_ids = torch.randint(0, vocab, (1, 80 if args.tiny else 1024), generator=gen).to(device)
    result["check_tokens"] = check_ids.shape[1]
    ctl.use("torch")
    reference = capture_modules(model, model.model, check_ids)
    keep: list = []
    for arm in arms:
        row = {"arm": arm}
        try:
            if (why := ctl.reason_unavailable(arm)) is not None:
                row["note"] = why
                continue
            run = ctl.use(arm)
            got = capture_modules(model, run, check_ids)
            result["checks"][arm] = {k: max((rel_l2(a, b) for a, b in zip(got[k], reference[k])), default=0.0)
                                     for k in reference}
            nb = min(args.torch_batch, B) if arm == "torch" else B
            ids = torch.randint(0, vocab, (nb, T), generator=gen).to(device)
            handles = hook_outputs(model, keep)
            try:
                with torch.no_grad(), sdpa_backends(arm):
                    fwd = (graphed_forward_fn if "+graph" in arm else forward_fn)(run, ids, keep)
                    sec = time_forward(fwd, args.steps, args.warmup, device)
                    row["breakdown"] = breakdown(fwd, device)
                    if args.profile:
                        row["profile"] = profile_arm(fwd, args.profile)
            finally:
                for h in handles:
                    h.remove()
            row.update(tokens_per_s=nb * T / sec, ms_per_forward=1e3 * sec, batch=nb)
            print(f"{arm}: {row['tokens_per_s']:,.0f} tokens/s, glue {100 * row['breakdown']['glue_share']:.0f}% "
                  f"of {row['breakdown']['total_ms']:.1f} ms; check {result['checks'][arm]}", flush=True)
        except Exception as err:  # one failing arm must not lose the others' numbers
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"{arm}: FAILED {row['error']}", flush=True)
        finally:
            keep.clear()
            result["arms"].append(row)
            write(args.out, result)
            torch._dynamo.reset()
    ctl.use("torch")
    from flashqla_kernels import unpatch_transformers

    unpatch_transformers()
    for n, f in ctl.originals.items():
        setattr(ctl.module, n, f)
    print(f"wrote {args.out / 'gdn_layer.json'} and {args.out / 'gdn_layer.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
