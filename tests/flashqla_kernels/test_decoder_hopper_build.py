"""CPU CI for the decoder's glue kernels (``flashqla_kernels.decoder.hopper``): they lower and compile for sm_90a with
the local nvcc (no GPU needed), the package imports without tilelang, and the shape reasons name the shape.

The default run builds the Qwen3.5-2B layout (Hk = Hv = 16, K = V = 128, conv width 4, d_model 2048, MLP 6144, bf16);
``-m slow`` adds the prefix/bias, GVA, fp16 and other head-dim specialisations. The compile cache is the toolkit's
(``flashqla_kernels.toolkit``; TileLang's disk cache, ~/.tilelang/cache), so re-runs are fast.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from flashqla_kernels import toolkit

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                                reason="needs nvcc to compile for sm_90a")

# conv: (Hk, Hv, D, Kc, dtype, has_prefix, has_bias); norm (gated): (V, dtype, eps); rms: (D, dtype, eps);
# silu (the MLP's silu(gate) * up): (D, dtype); qkrope (attention q/k norm + partial RoPE): (H, Hkv, D, R, dtype,
# eps); gate (attention output * sigmoid(gate)): (H, D, dtype); addrms (the decoder's residual add + RMSNorm):
# (D, dtype, eps, weight dtype). The backward kernels: conv_bwd (Hk, Hv, D, Kc, dtype, has_bias); norm_bwd (V, dtype,
# eps); rms_bwd (D, dtype, eps, weight dtype, with the residual path's gradient); silu_bwd (D, dtype). The RMSNorms'
# fp32 rows under autocast (AUTOCAST_NORMS) add the CTA's (tile elements, threads), b's dtype (addrms) and y's
# (rms, addrms) or dy's (rms_bwd) dtype
CORE = [
    ("conv", (16, 16, 128, 4, "bfloat16", False, False)),
    ("norm", (128, "bfloat16", 1e-6)),
    ("rms", (2048, "bfloat16", 1e-6)),
    ("silu", (6144, "bfloat16")),
    ("qkrope", (8, 2, 256, 64, "bfloat16", 1e-6)),
    ("gate", (8, 256, "bfloat16")),
    ("addrms", (2048, "bfloat16", 1e-6, "bfloat16")),
    ("conv_bwd", (16, 16, 128, 4, "bfloat16", False)),
    ("norm_bwd", (128, "bfloat16", 1e-6)),
    ("rms_bwd", (2048, "bfloat16", 1e-6, "float32", True)),
    ("silu_bwd", (6144, "bfloat16")),
]
EXTRA = [
    ("conv", (16, 16, 128, 4, "bfloat16", True, False)),
    ("conv", (2, 4, 64, 4, "float16", True, True)),
    ("conv", (16, 32, 128, 4, "bfloat16", False, False)),
    ("conv", (2, 2, 256, 2, "bfloat16", True, False)),
    ("norm", (64, "float16", 1e-5)),
    ("norm", (256, "bfloat16", 1e-6)),
    ("rms", (256, "bfloat16", 1e-6)),
    ("rms", (64, "float16", 1e-5)),
    ("silu", (64, "float16")),
    ("silu", (1472, "bfloat16")),
    ("qkrope", (16, 2, 256, 64, "bfloat16", 1e-6)),
    ("qkrope", (4, 4, 128, 128, "float16", 1e-5)),
    ("qkrope", (4, 1, 64, 32, "bfloat16", 1e-6)),
    ("gate", (16, 256, "bfloat16")),
    ("gate", (4, 64, "float16")),
    ("gate_hm", (8, 256, "bfloat16")),
    ("rms", (2048, "bfloat16", 1e-6, "bfloat16")),
    ("conv", (16, 16, 128, 4, "bfloat16", False, False, 32, 256)),
    ("norm", (128, "bfloat16", 1e-6, 32, 128)),
    ("conv_pipe", (2, 4, 64, 4, "float16", True, True, 16, 128, 3)),
    ("conv_bwd", (2, 4, 64, 4, "float16", True)),
    ("conv_bwd", (2, 2, 256, 2, "bfloat16", False)),
    ("norm_bwd", (64, "float16", 1e-5)),
    ("rms_bwd", (2048, "bfloat16", 1e-6, "bfloat16", False)),
    ("rms_bwd", (64, "float16", 1e-5, "float32", True)),
    ("silu_bwd", (64, "float16")),
    # fp32 rows: the residual stream of fp32 weights under bf16 autocast
    ("rms", (2048, "float32", 1e-6)),
    ("addrms", (2048, "float32", 1e-6, "float32", 2048, 128, "bfloat16")),
    ("rms_bwd", (2048, "float32", 1e-6, "float32", True)),
]
# the 2B model's norms under bf16 autocast with fp32 weights: fp32 rows written in bf16, their gradient read in bf16
AUTOCAST_NORMS = [
    ("rms", (2048, "float32", 1e-6, "float32", 2048, 128, "bfloat16")),
    ("addrms", (2048, "float32", 1e-6, "float32", 2048, 128, "bfloat16", "bfloat16")),
    ("rms_bwd", (2048, "float32", 1e-6, "float32", False, 2048, 128, "bfloat16")),
    ("rms_bwd", (2048, "float32", 1e-6, "float32", True, 2048, 128, "bfloat16")),
]


def _compile(stage, args):
    pytest.importorskip("tilelang")
    from flashqla_kernels.decoder.hopper import attn_glue, conv_gates, gated_norm, rms_norm, silu_mul

    builder = {"conv": conv_gates.build_conv_qkv_gates, "norm": gated_norm.build_gated_rms_norm,
               "rms": rms_norm.build_rms_norm, "silu": silu_mul.build_silu_mul,
               "qkrope": attn_glue.build_qk_norm_rope, "gate": attn_glue.build_gate_mul,
               "gate_hm": attn_glue.build_gate_mul_head_major,
               "conv_pipe": conv_gates.build_conv_qkv_gates, "addrms": rms_norm.build_add_rms_norm,
               "conv_bwd": conv_gates.build_conv_qkv_gates_bwd, "norm_bwd": gated_norm.build_gated_rms_norm_bwd,
               "rms_bwd": rms_norm.build_rms_norm_bwd, "silu_bwd": silu_mul.build_silu_mul_bwd}[stage]
    src = toolkit.compile_kernel(builder, *args).get_kernel_source()
    assert "__global__" in src and ("rsqrtf" in src or stage in ("silu", "gate", "gate_hm", "silu_bwd")), \
        f"{stage}{args}: unexpected CUDA"
    if stage == "qkrope":
        # one kernel: the norm's reduction, both q and k outputs, and the rotary products with cos and sin
        assert "AllReduce" in src and "q[" in src or "(q + " in src
        assert "cos" in src and "sin" in src and ("k[" in src or "(k + " in src)
    if stage == "addrms":
        # one kernel writes both the sum and its norm
        assert re.search(r"\bs\[", src) or "(s + " in src, "the sum is not stored"
        assert re.search(r"\by\[", src) or "(y + " in src, "the norm is not stored"
    if stage == "conv_bwd":
        # dx and both partial sums leave the one kernel that recomputes the conv
        assert "(dx + " in src and "dw_part" in src and ("db_part" in src) == args[-1]
    if stage in ("rms_bwd", "norm_bwd"):
        assert "dw_part" in src and "AllReduce" in src
    if stage in ("conv", "conv_pipe"):
        # the gates (softplus, exp) and the q/k/v stores are in the same kernel as the conv
        assert "log1pf" in src and "beta[" in src and "(q + " in src and "(v + " in src
    return src


@needs_nvcc
@pytest.mark.parametrize("stage,args", CORE, ids=[f"{s}-{a}" for s, a in CORE])
def test_glue_kernel_compiles_for_sm90a(stage, args):
    _compile(stage, args)


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("stage,args", EXTRA, ids=[f"{s}-{a}" for s, a in EXTRA])
def test_other_glue_specialisations_compile_for_sm90a(stage, args):
    _compile(stage, args)


@needs_nvcc
@pytest.mark.parametrize("stage,args", AUTOCAST_NORMS, ids=[f"{s}-{a}" for s, a in AUTOCAST_NORMS])
def test_rms_norm_kernels_write_and_read_autocasts_dtype_from_fp32_rows(stage, args):
    """The new specialisations compile with y (dy) bf16 and everything else as the fp32 kernel had it; y / dy in
    the rows' own dtype, spelled out, is the default specialisation's CUDA byte for byte (the GPU-verified kernels
    unchanged)."""
    src = _compile(stage, args)
    head = src[src.index("__global__"):src.index("{", src.index("__launch_bounds__"))]
    bf16_args = set(re.findall(r"bfloat16_t\* __restrict__ (\w+)", head))
    assert bf16_args == {"rms": {"y"}, "addrms": {"b", "y"}, "rms_bwd": {"dy"}}[stage], head
    assert "float* __restrict__ x" in head or "float* __restrict__ a" in head
    assert _compile(stage, (*args[:-1], "float32")) == _compile(stage, args[:-1])
    # the bf16 rounding of y is the round-to-nearest-even conversion, as torch's cast to bf16
    assert stage == "rms_bwd" or "__float22bfloat162_rn" in src


@needs_nvcc
@pytest.mark.parametrize("D,dtype", [(6144, "bfloat16"), (64, "float16")])
def test_silu_mul_kernel_moves_16_byte_vectors(D, dtype):
    """Memory-bound: every global access of gate, up and out is one uint4 (8 bf16/fp16 values), and the sigmoid
    is in the same kernel."""
    src = _compile("silu", (D, dtype))
    body = src[src.index("__launch_bounds__"):]
    for name in ("gate", "up"):
        loads = re.findall(rf"= \*\((\w+)\*\)\({name} \+", body)
        assert loads and set(loads) == {"uint4"}, f"{name} loads: {loads}"
    stores = re.findall(r"\*\((\w+)\*\)\(out \+", body)
    assert stores and set(stores) == {"uint4"}, f"out stores: {stores}"
    assert not re.search(r"\b(gate|up|out)\[", body), "scalar global access left in the kernel"
    assert "expf" in body


def test_importing_the_glue_hopper_package_does_not_import_tilelang():
    code = ("import sys, flashqla_kernels.decoder.hopper as h, flashqla_kernels.decoder, flashqla_kernels.patching; "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'; print(h.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert all(name in out.stdout for name in ("conv_qkv_gates_fwd", "gated_rms_norm_fwd", "rms_norm_fwd",
                                               "silu_mul_fwd", "qk_norm_rope_fwd", "gate_mul_fwd"))


def test_conv_shape_reasons_name_the_shape():
    from flashqla_kernels.decoder.hopper import conv_shape_reason

    assert conv_shape_reason(16, 128, 32, 128, 4) is None
    assert "K == V" in conv_shape_reason(16, 128, 32, 64, 4)
    assert "head dim 96" in conv_shape_reason(16, 96, 32, 96, 4)
    assert "conv width 1" in conv_shape_reason(16, 128, 32, 128, 1)


@needs_nvcc
def test_pipelined_conv_double_buffers_with_predicated_async_copies():
    """The pipelined conv kernel of the 2B layer: cp.async prefetch of the next tile (zero-filled past the sequence),
    waited on one group behind, no TMA / warp-specialised producer (whose layout replicated the fragments)."""
    src = _compile("conv_pipe", (16, 16, 128, 4, "bfloat16", False, False, 16, 128, 8))
    body = src[src.index("__launch_bounds__"):]
    assert "cp_async_gs_conditional<16>" in body and "cp_async_wait<1>" in body
    assert "tma_load" not in body and "CUtensorMap" not in src
