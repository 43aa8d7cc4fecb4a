"""CPU CI for the decode step's kernels: the recurrent kernel (``gated_delta_rule/hopper/recurrent.py``) and the conv
stage's in-place state shift compile for sm_90a with the local nvcc, with the structure they are built for.

Numerics run on the GPU (``test_recurrent_gpu.py``); here: the state lives in per-thread registers (no tile
reductions, a fixed handful of barriers a token), the gated-norm variant writes the norm in the same kernel, the
varlen variant reads its spans on the device, and the conv kernel writes the conv state it reads.
"""
from __future__ import annotations

import re

import pytest

from tests.flashqla_kernels.test_hopper_build import needs_nvcc

S128 = 128 ** -0.5

# build_fused_recurrent(Hk, Hv, K, V, dtype, scale, l2norm, has_h0, store_final, varlen[, gated_norm, norm_eps])
RECURRENT = {
    "decode_2b_l2norm": (16, 16, 128, 128, "bfloat16", S128, True, True, True, False),
    "decode_gated_norm": (16, 16, 128, 128, "bfloat16", S128, False, True, True, False, True, 1e-6),
    "varlen_fp16_no_h0": (2, 4, 64, 64, "float16", 0.125, True, False, True, True),
}


def _source(builder, args) -> str:
    pytest.importorskip("tilelang")
    from flashqla_kernels import toolkit

    return toolkit.compile_kernel(builder, *args).get_kernel_source()


@needs_nvcc
@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_kernel_compiles_with_the_state_in_thread_registers(name):
    from flashqla_kernels.gated_delta_rule.hopper import recurrent

    args = RECURRENT[name]
    src = _source(recurrent.build_fused_recurrent, args)
    K, V, gated = args[2], args[3], len(args) > 10 and args[10]
    strip = K * recurrent.block_v(V, gated) // recurrent.THREADS
    assert re.search(rf"float s\[{strip}\];", src), f"{name}: the state strip is not a {strip}-value register array"
    assert "AllReduce" not in src, f"{name}: tile reductions (cross-warp passes) instead of in-thread sums"
    assert src.count("__syncthreads()") <= 5 + int(gated), f"{name}: more barriers a token than the design's"
    assert "final[" in src and "o[" in src
    if gated:
        assert "z[" in src and "weight[" in src and "rsqrtf" in src
    if args[9]:
        assert "cu_seqlens[" in src
    if args[6]:
        assert src.count("rsqrtf") >= 2  # the q and k norm factors


@needs_nvcc
def test_conv_kernel_shifts_the_conv_state_in_place_for_the_decode_step():
    from flashqla_kernels.decoder.hopper import conv_gates

    src = _source(conv_gates.build_conv_qkv_gates, (16, 16, 128, 4, "bfloat16", True, False, 0,
                                                    conv_gates.THREADS, 0, 2, True))
    assert re.search(r"\bprefix\[[^\]]*\] = ", src), "the conv state is not written"
    assert "const bfloat16_t* __restrict__ prefix" not in src
    with pytest.raises(AssertionError, match="update_prefix needs the plain kernel and a prefix"):
        conv_gates.build_conv_qkv_gates(16, 16, 128, 4, "bfloat16", False, False, 0, conv_gates.THREADS, 0, 2, True)
