"""flashqla_kernels.toolkit: kernel outputs poisoned on request, the kept arguments no kernel reads, compiling
many kernels (in order, once each, on worker processes), and the direct launch."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels import toolkit
from tests.flashqla_kernels.test_hopper_bwd_build import needs_nvcc


def test_outputs_are_nan_or_minus_one_only_inside_poisoned_outputs():
    with toolkit.poisoned_outputs():
        assert torch.isnan(toolkit.empty((2, 3), torch.float32, "cpu")).all()
        assert (toolkit.empty_like(torch.zeros(4, dtype=torch.int32)) == -1).all()
        with toolkit.poisoned_outputs():
            pass
        assert torch.isnan(toolkit.empty((1,), torch.bfloat16, "cpu")).all()  # the nested exit restored "on"
    assert toolkit.empty((2,), torch.float32, "cpu").shape == (2,)


def test_unread_arguments_are_one_kept_tensor_per_shape_dtype_and_device():
    a = toolkit.unread((1, 4, 2), torch.float32, torch.device("cpu"))
    assert a is toolkit.unread((1, 4, 2), torch.float32, torch.device("cpu"))
    assert a is not toolkit.unread((1, 4, 2), torch.bfloat16, torch.device("cpu"))
    assert a.shape == (1, 4, 2) and a.dtype == torch.float32


def test_unread_arguments_are_poisoned_fresh_tensors_inside_poisoned_outputs():
    """So a kernel that reads an argument its specialisation should not read shows NaN in the GPU tests."""
    kept = toolkit.unread((1, 4, 2), torch.float32, torch.device("cpu"))
    with toolkit.poisoned_outputs():
        f = toolkit.unread((1, 4, 2), torch.float32, torch.device("cpu"))
        i = toolkit.unread((3,), torch.int32, torch.device("cpu"))
    assert f is not kept and f.shape == (1, 4, 2) and f.isnan().all()
    assert i.dtype == torch.int32 and (i == -1).all()
    assert toolkit.unread((1, 4, 2), torch.float32, torch.device("cpu")) is kept


def _refusing_builder(width):
    raise ValueError(f"no kernel for width {width}")


def test_compile_many_compiles_each_spec_once_in_a_fixed_order(monkeypatch):
    asked = []
    monkeypatch.setattr(toolkit, "compile_kernel", lambda builder, *args: asked.append((builder.__name__, args)))

    def build_b(*a):
        return a

    def build_a(*a):
        return a

    specs = [(build_b, (2,)), (build_a, (1, "x")), (build_b, (2,)), (build_b, (1,))]
    assert toolkit.compile_many(specs) == []
    assert asked == [("build_a", (1, "x")), ("build_b", (1,)), ("build_b", (2,))]


def test_compile_many_on_processes_compiles_past_failures_and_returns_each():
    pytest.importorskip("tilelang")
    failed = toolkit.compile_many([(_refusing_builder, (32,)), (_refusing_builder, (16,))], workers=2)
    assert failed == [(_refusing_builder, (16,), "ValueError: no kernel for width 16"),
                      (_refusing_builder, (32,), "ValueError: no kernel for width 32")]


@needs_nvcc
def test_direct_launch_calls_the_executable_the_jit_kernel_calls(monkeypatch):
    """FLASHQLA_KERNELS_DIRECT_LAUNCH: the kernel's calls reach the same TVM FFI executable (its argument checks
    answer the same wrong call with the same error), and the JIT kernel's other attributes stay reachable."""
    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.hopper import layout

    args = (256, 128, 128, "bfloat16")
    jit = toolkit.compile_kernel(layout.build_channel_slice_to_tokens, *args)
    monkeypatch.setattr(toolkit, "DIRECT_LAUNCH", True)
    toolkit._compile_cached.cache_clear()
    direct = toolkit.compile_kernel(layout.build_channel_slice_to_tokens, *args)
    toolkit._compile_cached.cache_clear()
    assert isinstance(direct, toolkit.DirectKernel) and direct._run is jit.adapter._get_executable()
    assert direct.get_kernel_source() == jit.get_kernel_source()
    wrong = (torch.zeros(2), torch.zeros(2))  # 1-D where the kernel takes [B, C, T] and [rows, F]
    errors = []
    for kernel in (jit, direct):
        with pytest.raises(RuntimeError) as err:
            kernel(*wrong)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "ndim" in errors[0]
