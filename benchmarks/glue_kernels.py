"""The decoder's glue kernels alone on the H200, against the memory floor, with their CTA-shape variants.

Each kernel runs on one layer's tensors of the Qwen3.5-2B-shaped forward of ``gdn_layer.py`` (8 x 4096 tokens):
the conv + gates stage (Hk = Hv = 16, K = V = 128, conv width 4), the decoder RMSNorm (2048 channels), the gated
RMSNorm (16 heads of 128), the MLP's silu_mul (6144), the attention glue (8 query / 2 key heads of 256, 64 rotary
channels) and the attention gate on a token-major and on SDPA's head-major output (beside transformers' transpose
copy that the head-major one replaces). For each: the median of CUDA-event timings, the bytes it must move, and its
bandwidth against a device-to-device copy of 1 GiB (the practical floor of a one-pass kernel). The variants are the
builders' CTA knobs (tokens or rows per CTA, threads), so the launcher defaults can follow the measurement.

Usage (GPU): ``python benchmarks/glue_kernels.py --out DIR`` -> ``glue_kernels.{json,md}``; ``--precompile`` (anywhere
with nvcc) compiles every variant into TileLang's cache; ``--list`` prints them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from topk_encode import time_ms  # noqa: E402 - CUDA-event median, shared by the benchmarks

B, T, HK, HV, D, KC, D_MODEL, D_FF = 8, 4096, 16, 16, 128, 4, 2048, 6144
H_ATT, HKV_ATT, D_ATT, R_ATT = 8, 2, 256, 64
BF16 = "bfloat16"
# (stage, module of flashqla_kernels.decoder.hopper, builder, builder args): the default specialisation first, then
# the variants
VARIANTS = [
    # the launcher's default: the pipelined conv, 4 tiles of 32 tokens a CTA (BT, threads, tiles[, stages])
    ("conv", "conv_gates", "build_conv_qkv_gates", (HK, HV, D, KC, BF16, False, False, 32, 128, 4)),
    *[("conv", "conv_gates", "build_conv_qkv_gates", (HK, HV, D, KC, BF16, False, False, bt, th, tiles, *stages))
      for bt, th, tiles, *stages in ((32, 128, 2), (32, 128, 8), (64, 128, 2), (64, 256, 2), (32, 256, 4),
                                     (16, 128, 8), (32, 128, 4, 3))],
    # the plain kernel: one tile of BT tokens a CTA (16 for D = 128 when not pipelined), threads
    ("conv", "conv_gates", "build_conv_qkv_gates", (HK, HV, D, KC, BF16, False, False)),
    ("conv", "conv_gates", "build_conv_qkv_gates", (HK, HV, D, KC, BF16, False, False, 32, 128)),
    ("rms_norm", "rms_norm", "build_rms_norm", (D_MODEL, BF16, 1e-6, BF16)),
    *[("rms_norm", "rms_norm", "build_rms_norm", (D_MODEL, BF16, 1e-6, BF16, tile, th))
      for tile, th in ((8192, 256), (4096, 256), (1024, 64), (16384, 512))],
    ("gated_norm", "gated_norm", "build_gated_rms_norm", (D, BF16, 1e-6)),
    *[("gated_norm", "gated_norm", "build_gated_rms_norm", (D, BF16, 1e-6, rows, th))
      for rows, th in ((64, 128), (32, 128), (8, 64), (16, 64))],
    ("silu_mul", "silu_mul", "build_silu_mul", (D_FF, BF16)),
    ("qk_norm_rope", "attn_glue", "build_qk_norm_rope", (H_ATT, HKV_ATT, D_ATT, R_ATT, BF16, 1e-6)),
    ("gate_mul", "attn_glue", "build_gate_mul", (H_ATT, D_ATT, BF16)),
    ("gate_mul_head_major", "attn_glue", "build_gate_mul_head_major", (H_ATT, D_ATT, BF16)),
]


def _compile(module: str, builder: str, args: tuple):
    from flashqla_kernels import toolkit
    from flashqla_kernels.decoder.hopper import attn_glue, conv_gates, gated_norm, rms_norm, silu_mul

    modules = {"attn_glue": attn_glue, "conv_gates": conv_gates, "gated_norm": gated_norm, "rms_norm": rms_norm,
               "silu_mul": silu_mul}
    return toolkit.compile_kernel(getattr(modules[module], builder), *args)


def _inputs(stage: str) -> tuple[list[torch.Tensor], int]:
    """The kernel's arguments for one layer of the benchmark shape, and the bytes a one-pass kernel moves."""
    dev, bf = "cuda", torch.bfloat16
    n = B * T

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, device=dev).to(dtype)

    if stage == "conv":
        C = (2 * HK + HV) * D
        args = [rnd(B, T, C), rnd(C, KC), rnd(C), rnd(1, KC - 1, C), rnd(B, T, HV), rnd(B, T, HV),
                rnd(HV, dtype=torch.float32), rnd(HV, dtype=torch.float32),
                rnd(B, T, HK, D), rnd(B, T, HK, D), rnd(B, T, HV, D), rnd(B, T, HV, dtype=torch.float32),
                rnd(B, T, HV, dtype=torch.float32)]
        return args, 2 * n * C * 2 + n * HV * (2 * 2 + 2 * 4)
    if stage == "rms_norm":
        return [rnd(n, D_MODEL), rnd(D_MODEL), rnd(n, D_MODEL)], 2 * n * D_MODEL * 2
    if stage == "gated_norm":
        rows = n * HV
        return [rnd(rows, D), rnd(rows, D), rnd(D), rnd(rows, D)], 3 * rows * D * 2
    if stage == "silu_mul":
        return [rnd(n, D_FF), rnd(n, D_FF), rnd(n, D_FF)], 3 * n * D_FF * 2
    if stage == "qk_norm_rope":
        q_in, k_in = rnd(B, T, H_ATT, 2 * D_ATT), rnd(B, T, HKV_ATT, D_ATT)
        args = [q_in, k_in, rnd(D_ATT, dtype=torch.float32), rnd(D_ATT, dtype=torch.float32), rnd(B, T, R_ATT),
                rnd(B, T, R_ATT), rnd(B, H_ATT, T, D_ATT), rnd(B, HKV_ATT, T, D_ATT)]
        return args, 2 * n * (H_ATT + HKV_ATT) * D_ATT * 2 + n * H_ATT * D_ATT * 2
    if stage == "gate_mul":
        return [rnd(n, H_ATT, D_ATT), rnd(n, H_ATT, 2 * D_ATT), rnd(n, H_ATT, D_ATT)], 3 * n * H_ATT * D_ATT * 2
    if stage == "gate_mul_head_major":
        args = [rnd(B, H_ATT, T, D_ATT), rnd(B, T, H_ATT, 2 * D_ATT), rnd(B, T, H_ATT, D_ATT)]
        return args, 3 * n * H_ATT * D_ATT * 2
    raise ValueError(stage)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src), reps=30, warmup=3) / 1e6


def run(out: Path) -> list[dict]:
    floor = copy_bandwidth()
    rows = [{"stage": "d2d copy 1 GiB", "variant": "", "gb_per_s": floor}]
    inputs = {}
    for stage, module, builder, args in VARIANTS:
        if stage not in inputs:
            inputs[stage] = _inputs(stage)
        tensors, nbytes = inputs[stage]
        kernel = _compile(module, builder, args)
        ms = time_ms(lambda: kernel(*tensors), reps=30, warmup=3)
        rows.append({"stage": stage, "variant": builder + str(args), "ms": ms, "bytes": nbytes,
                     "gb_per_s": nbytes / ms / 1e6, "share_of_copy": nbytes / ms / 1e6 / floor})
        print(json.dumps(rows[-1]), flush=True)
    attn = inputs["gate_mul_head_major"][0][0]
    ms = time_ms(lambda: attn.transpose(1, 2).contiguous(), reps=30, warmup=3)
    nbytes = 2 * attn.numel() * 2
    rows.append({"stage": "transformers' SDPA transpose copy", "variant": "torch", "ms": ms, "bytes": nbytes,
                 "gb_per_s": nbytes / ms / 1e6, "share_of_copy": nbytes / ms / 1e6 / floor})
    out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    (out / "glue_kernels.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    lines = [f"# Glue kernels alone ({env['gpu']}, torch {env['torch']}); one layer of 8 x 4096 tokens", "",
             f"Floor: device-to-device copy {floor:.0f} GB/s.", "",
             "| stage | variant | ms | MB moved | GB/s | of copy |", "|---|---|---|---|---|---|"]
    for r in rows[1:]:
        lines.append(f"| {r['stage']} | `{r['variant']}` | {r['ms']:.3f} | {r['bytes'] / 1e6:.0f} | "
                     f"{r['gb_per_s']:.0f} | {r['share_of_copy']:.0%} |")
    (out / "glue_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--precompile", action="store_true", help="compile every variant (no GPU needed) and stop")
    parser.add_argument("--list", action="store_true", help="print the variants and stop")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{s}: {b}{a}" for s, _, b, a in VARIANTS))
    elif args.precompile:
        for _, module, builder, bargs in VARIANTS:
            _compile(module, builder, bargs)
        print(f"precompiled {len(VARIANTS)} glue kernel variants")
    else:
        run(args.out)


if __name__ == "__main__":
    main()
