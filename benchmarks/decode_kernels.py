"""The GDN decode step's kernels: the public ``recurrent_gated_delta_rule`` (T = 1) beside FLA's fused recurrent op
and our torch path, and the whole layer's decode step (``flashqla_kernels.decoder.gdn_decode_step``) beside the
decode engine's torch formulation of it.

Shapes: the Qwen3.5-2B GDN layer (Hk = Hv = 16, K = V = 128, bf16, l2norm in the kernel, state in and out), batch
1, 8, 32, 128. Timing: ``triton.testing.do_bench`` median of the call a user makes (all its Python work included);
the layer step is labelled internal (the engine calls it inside its captured graph). Floor: the bytes a step must
move (the fp32 state read and written, q / k / v / o once) over 4.2 TB/s.

Usage: ``python benchmarks/decode_kernels.py --out benchmarks/results`` on the GPU writes ``decode_kernels.json`` and
``.md``; ``--precompile`` compiles (CPU with nvcc is enough) every kernel this script and the GPU tests
``tests/flashqla_kernels/test_recurrent_gpu.py`` / ``tests/qwen_scope/test_engine_gpu.py`` run, and the decode
engine's for the 2B shape (``steer_generate.py``: the GDN step, the fused norms and silu_mul), into ``TILELANG_CACHE_DIR``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import collect_throughput as ct  # noqa: E402 - the environment report and sync

HBM = 4.2e12
BATCHES = (1, 8, 32, 128)
H, D = 16, 128


def precompile() -> None:
    from flashqla_kernels import toolkit
    from flashqla_kernels.decoder.hopper import conv_gates
    from flashqla_kernels.gated_delta_rule.hopper import recurrent

    specs = []
    # (Hk, Hv, K, V, dtype) of the GPU tests' cases and the 2B layer; l2norm both ways, h0 and the final state
    shapes = [(16, 16, 128, 128, "bfloat16"), (2, 4, 128, 128, "bfloat16"), (1, 4, 128, 128, "float16"),
              (2, 2, 64, 64, "float32"), (2, 2, 256, 256, "bfloat16"), (2, 4, 16, 16, "float32")]
    for Hk, Hv, K, V, dt in shapes:
        for l2 in (True, False):
            specs.append((Hk, Hv, K, V, dt, K ** -0.5, l2, True, True, False, False, 1e-6))
    specs += [(2, 4, 128, 128, "bfloat16", 128 ** -0.5, l2, True, True, True, False, 1e-6) for l2 in (True, False)]
    # the layer's decode step: gated-norm output (the 2B layer, the tests' small models), the in-place conv shift
    for Hk, Hv in ((16, 16), (2, 4)):
        specs.append((Hk, Hv, 128, 128, "bfloat16", 128 ** -0.5, False, True, True, False, True, 1e-6))
    for spec in specs:
        toolkit.compile_kernel(recurrent.build_fused_recurrent, *spec)
    for Hk, Hv in ((16, 16), (2, 4)):
        toolkit.compile_kernel(conv_gates.build_conv_qkv_gates, Hk, Hv, 128, 4, "bfloat16", True, False, 0,
                               conv_gates.THREADS, 0, 2, True)
    # the engine step's fused norms (bf16 weights) at the tests' tiny (64) and small (256) widths and the 2B's 2048
    from flashqla_kernels.decoder.hopper import rms_norm

    for D in (64, 256, 2048):
        toolkit.compile_kernel(rms_norm.build_rms_norm, D, "bfloat16", 1e-6, "bfloat16")
        toolkit.compile_kernel(rms_norm.build_add_rms_norm, D, "bfloat16", 1e-6, "bfloat16")
    # and the dense MLPs' silu(gate) * up (the tests' intermediate sizes, the 2B's 6144)
    from flashqla_kernels.decoder.hopper import silu_mul

    for D in (64, 128, 512, 6144):
        toolkit.compile_kernel(silu_mul.build_silu_mul, D, "bfloat16")
    print(f"precompiled {len(specs) + 12} decode kernels")


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def _inputs(B: int):
    dev = "cuda"
    torch.manual_seed(B)
    q = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(B, 1, H, device=dev)
    beta = torch.rand(B, 1, H, device=dev)
    h0 = torch.randn(B, H, D, D, device=dev) * 0.1
    return q, k, v, g, beta, h0


def _gdn_layer():
    """The 2B model's GDN layer (random bf16 weights)."""
    import transformers as tf

    cfg = ct.model_config(False)
    cfg.num_hidden_layers, cfg.layer_types = 1, ["linear_attention"]
    torch.manual_seed(0)
    return tf.Qwen3_5ForCausalLM(cfg).to("cuda", torch.bfloat16).eval().model.layers[0].linear_attn


def _layer_inputs(gdn, B: int):
    C = gdn.key_dim * 2 + gdn.value_dim
    conv = torch.zeros(B, gdn.conv_kernel_size - 1, C, device="cuda", dtype=torch.bfloat16)
    rec = torch.zeros(B, gdn.num_v_heads, D, D, device="cuda")
    x = torch.randn(B, 1, gdn.hidden_size, device="cuda", dtype=torch.bfloat16)
    return x, conv, rec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--precompile", action="store_true", help="only fill the TileLang cache (CPU is enough)")
    args = parser.parse_args(argv)
    if args.precompile:
        precompile()
        return
    from flashqla_kernels import recurrent_gated_delta_rule
    from flashqla_kernels.decoder import gdn_decode_step
    from flashqla_kernels.gated_delta_rule.torch_path import recurrent_gated_delta_rule_torch
    from qwen_scope.engine import layers

    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except ImportError:
        fla_recurrent = None
    rows = []
    gdn = _gdn_layer()
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    for B in BATCHES:
        q, k, v, g, beta, h0 = _inputs(B)
        floor_ms = 1e3 * (2 * h0.numel() * 4 + 4 * q.numel() * 2) / HBM
        row = {"batch": B, "floor_ms": floor_ms,
               "ours_ms": _bench(lambda: recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kw)),
               "torch_ms": _bench(lambda: recurrent_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0,
                                                                           **kw))}
        if fla_recurrent is not None:
            row["fla_ms"] = _bench(lambda: fla_recurrent(q, k, v, g, beta, initial_state=h0, **kw))
        x, conv, rec = _layer_inputs(gdn, B)
        with torch.no_grad():
            row["layer_step_ms_internal"] = _bench(lambda: gdn_decode_step(gdn, x, conv, rec))
            reason = layers.decode_step_reason
            layers.decode_step_reason = lambda *a: "timed torch formulation"
            try:
                row["layer_torch_ms_internal"] = _bench(lambda: layers.gdn_decode(gdn, x, conv, rec))
            finally:
                layers.decode_step_reason = reason
        weights = sum(p.numel() * p.element_size() for p in gdn.parameters())
        row["layer_floor_ms"] = 1e3 * (weights + 2 * rec.numel() * 4) / HBM
        rows.append(row)
        print(row, flush=True)
    result = {"env": ct.versions(), "shape": f"Hk = Hv = {H}, K = V = {D}, bf16, T = 1", "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_kernels.json").write_text(json.dumps(result, indent=1))
    e = result["env"]
    lines = [f"# GDN decode step ({e['gpu']}, {e['date']})", "",
             f"torch {e['torch']}, tilelang {e['tilelang']}, fla {e['fla-core'] or e['flash-linear-attention']}, "
             f"commit {e['commit']}. {result['shape']}; do_bench medians, ms.", "",
             "| batch | ours (public op) | FLA fused_recurrent | torch path | floor | layer step (internal) | "
             "layer, torch formulation (internal) | layer floor |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['ours_ms']:.4f} | {r.get('fla_ms', float('nan')):.4f} | "
                     f"{r['torch_ms']:.4f} | {r['floor_ms']:.4f} | {r['layer_step_ms_internal']:.4f} | "
                     f"{r['layer_torch_ms_internal']:.4f} | {r['layer_floor_ms']:.4f} |")
    (args.out / "decode_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
