"""Which TileLang kernels ``gdn_layer.py`` and the decoder GPU tests compile: the precompile list of the whole-model
benchmark (the chunk kernels of the default and base paths, every glue specialisation), compiled on a CPU box with
nvcc into TileLang's cache so the device loads them instead of JIT-compiling (``gdn_layer.py --precompile``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch


def kernel_specs() -> list[tuple[str, str, tuple]]:
    """(module, builder, args) of every TileLang kernel the arms and the GPU tests use."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import chunk_kernels

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.flashqla_kernels import test_decoder_gpu as gpu_tests

    from flashqla_kernels.decoder.hopper import conv_gates, swiglu_gemm

    glue = "flashqla_kernels.decoder.hopper."
    bf16, names = "bfloat16", {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    specs = []
    # the chunk kernels of the benchmark (Hv = 16; 1 and 8 sequences) and the layer tests (Hv = 32, 2 sequences),
    # as benchmarks/chunk_kernels.py names them
    layouts = {(16, Hv, 128, bf16, n) for Hv in (16, 32) for n in (1, 2, 8)}
    # the ours_op arm (the op patch alone): transformers asks for the l2norm inside the op
    layouts |= {(16, 16, 128, bf16, n, True) for n in (1, 8)}
    for stage, args in chunk_kernels.chunk_specs(layouts, 132, final=(False, True)):
        specs.append(("chunk:" + stage, stage, args))
    bt, tiles = conv_gates.pipelined_shape(128)
    for Hv in (16, 32):
        for has_prefix in (False, True):
            # the plain kernel (PIPELINED off) and the launcher's default, the pipelined one
            for extra in ((), (bt, conv_gates.THREADS, tiles)):
                specs.append((glue + "conv_gates", "build_conv_qkv_gates",
                              (16, Hv, 128, 4, bf16, has_prefix, False, *extra)))
    for B, T, Hk, Hv, D, Kc, dtype, prefix, bias in gpu_tests.CONV_CASES.values():
        specs.append((glue + "conv_gates", "build_conv_qkv_gates", (Hk, Hv, D, Kc, names[dtype], prefix, bias)))
        # the pipelined conv of the GPU tests: (tokens a tile, tiles a CTA), and the launcher's default shape
        for BT, n_tiles in {(16, 8), (16, 3), (32, 4), conv_gates.pipelined_shape(D)}:
            specs.append((glue + "conv_gates", "build_conv_qkv_gates",
                          (Hk, Hv, D, Kc, names[dtype], prefix, bias, BT, conv_gates.THREADS, n_tiles)))
    for V, dtype in ((128, bf16), (64, "float16"), (256, bf16)):
        specs.append((glue + "gated_norm", "build_gated_rms_norm", (V, dtype, 1e-6)))
    for D, dtype in ((2048, bf16), (256, bf16), (2048, "float16"), (64, bf16)):
        # the weight read in its own dtype: the model's (bf16 / fp16) and fp32 (the tests' reference weights)
        specs.append((glue + "rms_norm", "build_rms_norm", (D, dtype, 1e-6)))
        specs.append((glue + "rms_norm", "build_rms_norm", (D, dtype, 1e-6, dtype)))
    for D, dtype in ((2048, bf16), (2048, "float16"), (64, bf16)):
        # the decoder's residual add + post-attention norm: the 2B model and the GPU tests' cases
        specs.append((glue + "rms_norm", "build_add_rms_norm", (D, dtype, 1e-6, dtype)))
    specs.append((glue + "silu_mul", "build_silu_mul", (6144, bf16)))  # the 2B model's MLP (intermediate 6144)
    # the 2B MLP's gate/up GEMM with the SwiGLU epilogue, persistent over the H200's 132 SMs
    specs.append((glue + "swiglu_gemm", "build_swiglu_gemm",
                  swiglu_gemm.builder_args(6144, 2048, bf16, swiglu_gemm.DEFAULT_CONFIG, 132)))
    # the gated attention layers' glue: the 2B model (8 query heads, 2 key heads, head dim 256, 64 rotary channels)
    # and the GPU tests' cases
    attn = {(8, 2, 256, 64, bf16)} | {(H, Hkv, D, R, names[dtype]) for _, _, H, Hkv, D, R, dtype, _
                                      in gpu_tests.ATTN_CASES.values()}
    for H, Hkv, D, R, dtype in sorted(attn):
        specs.append((glue + "attn_glue", "build_qk_norm_rope", (H, Hkv, D, R, dtype, 1e-6)))
        specs.append((glue + "attn_glue", "build_gate_mul", (H, D, dtype)))
        specs.append((glue + "attn_glue", "build_gate_mul_head_major", (H, D, dtype)))
    for shape, dtype in gpu_tests.SILU_CASES.values():
        specs.append((glue + "silu_mul", "build_silu_mul", (shape[-1], names[dtype])))
    # the backward kernels under grad: the 2B model's (bf16 weights, and fp32 ones as under autocast) and the GPU
    # tests' cases
    conv_bwd = {(16, 16, 128, 4, bf16, False)} | {(Hk, Hv, D, Kc, names[dt], bias) for _, _, Hk, Hv, D, Kc, dt, bias
                                                  in gpu_tests.CONV_BWD_CASES.values()}
    for args in sorted(conv_bwd):
        specs.append((glue + "conv_gates", "build_conv_qkv_gates_bwd", args))
    for V, dtype in ((128, bf16), (64, "float16"), (256, bf16)):
        specs.append((glue + "gated_norm", "build_gated_rms_norm_bwd", (V, dtype, 1e-6)))
    for D, dtype, wdtype in ((2048, bf16, bf16), (2048, bf16, "float32"), (64, "float16", "float32"),
                             (2048, "float32", "float32")):
        for residual in (False, True):
            specs.append((glue + "rms_norm", "build_rms_norm_bwd", (D, dtype, 1e-6, wdtype, residual)))
    # the fp32 residual stream of fp32 weights under bf16 autocast: its norms and its add of a bf16 mixer output
    specs.append((glue + "rms_norm", "build_rms_norm", (2048, "float32", 1e-6)))
    from flashqla_kernels.decoder.hopper import rms_norm

    cta = (rms_norm.TILE_ELEMS, rms_norm.THREADS)
    specs.append((glue + "rms_norm", "build_add_rms_norm", (2048, "float32", 1e-6, "float32", *cta, bf16)))
    # ... and its norms' output in autocast's bf16 (the sum stays fp32), their backward reading the bf16 gradient
    specs.append((glue + "rms_norm", "build_rms_norm", (2048, "float32", 1e-6, "float32", *cta, bf16)))
    specs.append((glue + "rms_norm", "build_add_rms_norm", (2048, "float32", 1e-6, "float32", *cta, bf16, bf16)))
    for residual in (False, True):
        specs.append((glue + "rms_norm", "build_rms_norm_bwd",
                      (2048, "float32", 1e-6, "float32", residual, *cta, bf16)))
    for D, dtype in ((6144, bf16), (64, "float16")):
        specs.append((glue + "silu_mul", "build_silu_mul_bwd", (D, dtype)))
    return list(dict.fromkeys(specs))


# The GDN op's backward under the fused layer's training step (the l2norm in the glue, no states in or out): the 2B
# model's layout, which the training benchmark and the decoder's training GPU test run
TRAIN_LAYOUTS = ((16, 16, 128, 128, "bfloat16", False, False, False),)


def _glue_modules() -> dict:
    """The decoder's kernel modules by dotted name (importing them imports tilelang)."""
    from flashqla_kernels.decoder.hopper import attn_glue, conv_gates, gated_norm, rms_norm, silu_mul, swiglu_gemm

    return {m.__name__: m for m in (attn_glue, conv_gates, gated_norm, rms_norm, silu_mul, swiglu_gemm)}


def _compile_spec(spec: tuple[str, str, tuple]) -> str:
    module, builder, args = spec
    glue = _glue_modules()
    if module.startswith("chunk:"):  # a chunk kernel: compiled as chunk_kernels compiles its stages
        import chunk_kernels

        _, _, err = chunk_kernels.build_one((builder, args))
        return f"{builder}{args}: {err[:200]}" if err else ""
    from flashqla_kernels import toolkit

    try:
        toolkit.compile_kernel(getattr(glue[module], builder), *args)
        return ""
    except Exception as err:  # report and go on: one broken specialisation must not stop the others
        return f"{builder}{args}: {type(err).__name__}: {str(err)[:200]}"


def precompile(jobs: int = 1) -> int:
    """Compile (sm_90a, no GPU needed) every kernel of ``kernel_specs`` into tilelang's cache, on ``jobs``
    processes; returns the number of failures."""
    import multiprocessing as mp

    specs = kernel_specs()
    if jobs > 1:
        with mp.get_context("spawn").Pool(jobs) as pool:
            errors = [e for e in pool.map(_compile_spec, specs, chunksize=1) if e]
    else:
        errors = [e for e in map(_compile_spec, specs) if e]
    print(f"precompiled {len(specs) - len(errors)}/{len(specs)} kernels (chunk kernels Hk = 16, Hv = 16 / 32, "
          "K = V = 128, bf16; every glue specialisation of the benchmark and the GPU tests)")
    for e in errors:
        print("FAILED", e)
    from flashqla_kernels.gated_delta_rule.hopper import backward

    try:
        print(f"precompiled {backward.precompile(TRAIN_LAYOUTS, workers=jobs)} GDN backward kernels (the layer's "
              "training layout)")
    except RuntimeError as err:
        print("FAILED", err)
        return len(errors) + 1
    return len(errors)
