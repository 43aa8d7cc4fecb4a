"""The LM head's cross entropy (``flashqla_kernels.decoder.hopper.cross_entropy`` and ``ops.cross_entropy_`` /
``ops.scale_``): each row's loss, the logits overwritten by softmax - onehot, and the in-place scale.

CPU: the torch formulation against a float64 reference (loss and gradient, ragged blocks), the dispatcher's reasons,
and the kernels compile for sm_90a with 16-byte accesses where the row is walked. GPU (sm_90): the kernels against
the float64 reference at the 2B vocabulary and at small and ragged widths, bf16 / fp16 / fp32, the outputs poisoned
with NaN first, the target in the last, partial tile and in column 0, extreme logits, and no host sync.
"""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.decoder import hopper, ops, torch_path

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                                reason="needs nvcc to compile for sm_90a")


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (loss per row, softmax - onehot)."""
    x = logits.double()
    loss = torch.logsumexp(x, dim=1) - x.gather(1, targets[:, None]).squeeze(1)
    grad = torch.softmax(x, dim=1)
    grad[torch.arange(len(targets)), targets] -= 1.0
    return loss, grad


def _rel(x, ref) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_formulation_is_the_float64_loss_and_writes_the_gradient_over_the_logits(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(37, 203) * 4).to(dtype)
    targets = torch.randint(0, 203, (37,))
    ref_loss, ref_grad = _reference(logits, targets)
    buf = logits.clone()
    loss = ops.cross_entropy_(buf, targets, block_rows=16)  # blocks of 16, 16 and 5 rows
    assert loss.dtype == torch.float32 and loss.shape == (37,)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert _rel(buf, ref_grad) < tol
    s = torch.tensor([0.25])
    ops.scale_(buf, s)
    assert _rel(buf, ref_grad * 0.25) < tol


def test_the_dispatcher_names_why_the_kernel_cannot_run():
    x = torch.zeros(4, 12)
    assert "8-entry vectors" in hopper.logits_shape_reason(x)
    assert "contiguous" in hopper.logits_shape_reason(torch.zeros(16, 4).t())
    assert "dtype torch.float64" in hopper.logits_shape_reason(torch.zeros(4, 16, dtype=torch.float64))
    assert hopper.logits_shape_reason(torch.zeros(4, 16, dtype=torch.bfloat16)) is None
    with pytest.raises(ValueError, match="tensors are on cpu"):
        ops.cross_entropy_(torch.zeros(4, 16), torch.zeros(4, dtype=torch.long), backend="tilelang")
    with pytest.raises(ValueError, match="targets must be int64 \\[4\\]"):
        hopper.cross_entropy_fwd(torch.zeros(4, 16), torch.zeros(4, dtype=torch.int32))


def _source(builder, *args) -> str:
    pytest.importorskip("tilelang")
    return toolkit.compile_kernel(builder, *args).get_kernel_source()


@needs_nvcc
@pytest.mark.parametrize("V,dtype", [(248320, "bfloat16"), (152, "float16"), (1000, "float32")])
def test_kernels_compile_for_sm90a_and_write_the_row_in_16_byte_vectors(V, dtype):
    from flashqla_kernels.decoder.hopper import cross_entropy

    src = _source(cross_entropy.build_cross_entropy, V, dtype)
    body = src[src.index("__launch_bounds__"):]
    # the gradient's walk: one 16-byte load and one 16-byte store a thread and step; the reductions across the CTA
    stores = re.findall(r"\*\((\w+)\*\)\(logits \+", body)
    assert {"uint4", "float4"} & set(stores), f"logits accesses: {stores}"  # 8 bf16 / fp16 or 4 fp32
    assert body.count("AllReduce<tl::MaxOp") == 1 and body.count("AllReduce<tl::SumOp") == 1
    assert "exp2f" in body and "logf" in body and "__syncthreads" in body
    scale = _source(cross_entropy.build_scale, V, dtype)
    body = scale[scale.index("__launch_bounds__"):]
    assert set(re.findall(r"\*\((\w+)\*\)\(x \+", body)) <= {"uint4", "float4"}
    assert re.findall(r"\*\((\w+)\*\)\(x \+", body)


CASES = {  # rows, V, dtype, logit scale
    "2B_vocab_bf16": (70, 248320, torch.bfloat16, 3.0),
    "ragged_tail_fp16": (33, 4096 + 8 * 37, torch.float16, 5.0),
    "narrow_fp32": (129, 152, torch.float32, 2.0),
    "one_step_bf16": (9, 4096, torch.bfloat16, 30.0),
}


def _gpu_case(name):
    rows, V, dtype, scale = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(sorted(CASES).index(name))
    logits = (torch.randn(rows, V, device="cuda", generator=g) * scale).to(dtype)
    targets = torch.randint(0, V, (rows,), device="cuda", generator=g)
    targets[0], targets[1], targets[2] = V - 1, 0, V - 8  # the last column, the first, the last vector
    logits[3, 5] = 60.0 if dtype != torch.float16 else 11.0  # one dominant logit: p near 1 in row 3
    return logits, targets


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_loss_and_gradient_against_float64(name):
    logits, targets = _gpu_case(name)
    ref_loss, ref_grad = _reference(logits, targets)
    buf = logits.clone()
    with toolkit.poisoned_outputs():
        loss = ops.cross_entropy_(buf, targets, backend="tilelang")
    assert torch.isfinite(loss).all() and torch.isfinite(buf).all()
    assert _rel(loss, ref_loss) < 1e-5, _rel(loss, ref_loss)
    # the gradient rounded once to the logits' dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[logits.dtype]
    assert _rel(buf, ref_grad) < tol, _rel(buf, ref_grad)
    # the torch formulation on the same logits: the same loss, the gradient within one rounding
    tbuf = logits.clone()
    tloss = torch_path.cross_entropy_(tbuf, targets)
    assert _rel(loss, tloss) < 1e-5 and _rel(buf, tbuf) < tol
    s = torch.tensor([0.37], device="cuda")
    expect = (buf.float() * 0.37).to(buf.dtype)
    ops.scale_(buf, s, backend="tilelang")
    # bit for bit where the product is a normal number; the kernels flush fp32 subnormals to zero (fast math), so
    # a product below 2^-126 may come out 0
    normal = expect.float().abs() >= 2.0**-126
    assert torch.equal(buf[normal], expect[normal])
    assert (buf[~normal].float().abs() < 2.0**-126).all()


@pytest.mark.gpu
@pytest.mark.hopper
def test_kernels_do_not_wait_for_the_gpu():
    logits, targets = _gpu_case("2B_vocab_bf16")
    ops.cross_entropy_(logits.clone(), targets, backend="tilelang")  # compiled outside the checked region
    ops.scale_(logits.clone(), torch.ones(1, device="cuda"), backend="tilelang")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = ops.cross_entropy_(logits, targets, backend="tilelang")
        ops.scale_(logits, loss[:1] * 0 + 0.5, backend="tilelang")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(logits).all()
