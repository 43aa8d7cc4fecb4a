"""The decoder's glue ops (``flashqla_kernels.decoder.ops``) dispatch through ``flashqla_kernels.dispatch``: off Hopper
the torch formulation runs, and a forced kernel raises the reason."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.decoder import ops


def test_dispatch_uses_torch_off_hopper_and_forced_kernels_raise_the_reason():
    B, T, Hk, Hv, D = 1, 5, 2, 4, 16
    qkv = torch.randn(B, T, (2 * Hk + Hv) * D, dtype=torch.bfloat16)
    a, b = torch.randn(B, T, Hv, dtype=torch.bfloat16), torch.randn(B, T, Hv, dtype=torch.bfloat16)
    w = torch.randn((2 * Hk + Hv) * D, 4, dtype=torch.bfloat16)
    A_log, dt_bias = torch.zeros(Hv), torch.zeros(Hv)
    assert "CUDA" in ops.glue_kernel_reason(qkv)
    q, k, v, g, beta = ops.conv_qkv_gates(qkv, w, None, a, b, A_log, dt_bias, Hk=Hk, K=D, Hv=Hv, V=D)
    assert q.dtype == torch.bfloat16 and g.dtype == torch.float32
    torch.testing.assert_close(q.float().norm(dim=-1), torch.ones(B, T, Hk), atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="cannot run conv_qkv_gates on these inputs: tensors are on cpu"):
        ops.conv_qkv_gates(qkv, w, None, a, b, A_log, dt_bias, Hk=Hk, K=D, Hv=Hv, V=D, backend="tilelang")
    with pytest.raises(ValueError, match="cannot run gated_norm on these inputs"):
        ops.gated_norm(v, v, torch.ones(D), 1e-6, backend="tilelang")
    with pytest.raises(ValueError, match="cannot run rms_norm on these inputs"):
        ops.rms_norm(v, torch.zeros(D), 1e-6, backend="tilelang")
    torch.testing.assert_close(ops.rms_norm(v.float(), torch.zeros(D), 1e-6).pow(2).mean(-1),
                               torch.ones(v.shape[:-1]), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="cannot run silu_mul on these inputs: tensors are on cpu"):
        ops.silu_mul(v, v, backend="tilelang")
    assert torch.equal(ops.silu_mul(v, v), (torch.nn.functional.silu(v.float()) * v.float()).bfloat16())
    with pytest.raises(ValueError, match="backend must be None"):
        ops.gated_norm(v, v, torch.ones(D), 1e-6, backend="triton")
    # the attention gate on SDPA's head-major output: torch off Hopper (the transpose, then the gate), the reason when
    # the kernel is forced
    attn, qg = torch.randn(2, 3, 5, 8, dtype=torch.bfloat16), torch.randn(2, 5, 3, 16, dtype=torch.bfloat16)
    want = attn.transpose(1, 2).reshape(2, 5, 24) * torch.sigmoid(qg[..., 8:].reshape(2, 5, 24))
    assert torch.equal(ops.gate_mul_head_major(attn, qg), want)
    with pytest.raises(ValueError, match="cannot run gate_mul_head_major on these inputs: tensors are on cpu"):
        ops.gate_mul_head_major(attn, qg, backend="tilelang")
    pytest.importorskip("tilelang")
    from flashqla_kernels.decoder.hopper import attn_glue

    with pytest.raises(ValueError, match=r"qg must be \[B, L, H, 2 D\] = \(2, 5, 3, 16\)"):
        attn_glue.gate_mul_head_major(attn, qg[:, :4])  # the launcher checks shapes before any kernel is built


def test_stages_with_backward_kernels_take_them_under_grad_and_forward_only_stages_take_torch(monkeypatch):
    """As on an H200 (the device verifier passing): a bf16 input that requires grad sends rms_norm to its autograd
    pairing of forward and backward kernels, while a forward-only stage (the SwiGLU GEMM) takes the differentiable
    torch path with backend=None and a forced kernel names the grad; the decision functions say the same."""
    from flashqla_kernels import dispatch
    from flashqla_kernels.decoder import autograd

    monkeypatch.setattr(dispatch, "hopper_reason", lambda *tensors: None)
    calls = []
    monkeypatch.setattr(autograd, "rms_norm", lambda x, w, eps, out_dtype: calls.append(("grad", eps)) or x)
    monkeypatch.setattr(ops.hopper, "rms_norm_fwd", lambda x, w, eps, out_dtype: calls.append(("fwd", eps)) or x)
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(64)
    ops.rms_norm(x, w, 1e-6)
    ops.rms_norm(x, w, 1e-5, backend="tilelang")
    with torch.no_grad():
        ops.rms_norm(x, w, 1e-4)
    ops.rms_norm(x.detach(), w, 1e-3)
    assert calls == [("grad", 1e-6), ("grad", 1e-5), ("fwd", 1e-4), ("fwd", 1e-3)]
    monkeypatch.setattr(ops, "GRAD_KERNELS", False)  # grad calls back on the torch formulation
    y = ops.rms_norm(x, w, 1e-6)
    assert y.requires_grad and torch.equal(y, ops.torch_path.rms_norm_zero_centred(x, w, 1e-6))
    with pytest.raises(ValueError, match="cannot run rms_norm on these inputs: an input requires grad"):
        ops.rms_norm(x, w, 1e-6, backend="tilelang")
    assert ops.glue_kernel_reason(x, grad_ok=True) == dispatch.grad_reason(x)
    assert len(calls) == 4
    monkeypatch.setattr(ops, "GRAD_KERNELS", True)
    wg = torch.randn(128, 64, dtype=torch.bfloat16)
    y = ops.swiglu(x, wg, wg)
    assert y.requires_grad and torch.equal(y, ops.torch_path.silu_mul(x @ wg.t(), x @ wg.t()))
    with pytest.raises(ValueError, match="cannot run swiglu_gemm on these inputs: an input requires grad"):
        ops.swiglu(x, wg, wg, backend="tilelang")
    assert ops.glue_kernel_reason(x) == dispatch.grad_reason(x)
    assert ops.glue_kernel_reason(x, grad_ok=True) is None
    with torch.no_grad():
        assert ops.glue_kernel_reason(x) is None
    # a conv state under grad: the conv kernel's backward takes fresh sequences only
    qkv = torch.randn(1, 2, 8 * 128, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(1, 2, 4, dtype=torch.bfloat16)
    assert ops.conv_qkv_gates_decision(qkv, a, a, Hk=2, K=128, Hv=4, V=128, Kc=4).kernel
    decision = ops.conv_qkv_gates_decision(qkv, a, a, Hk=2, K=128, Hv=4, V=128, Kc=4, has_prefix=True)
    assert not decision.kernel and "conv state (prefix) under grad" in decision.reasons[0]
    with torch.no_grad():
        assert ops.conv_qkv_gates_decision(qkv, a, a, Hk=2, K=128, Hv=4, V=128, Kc=4, has_prefix=True).kernel
    o = torch.randn(1, 2, 4, 96, dtype=torch.bfloat16)
    decision = ops.gated_norm_decision(o, o)
    assert not decision.kernel and "head dim V=96 unsupported" in decision.reasons[0]
    qkv = torch.randn(1, 2, 8 * 128, dtype=torch.bfloat16)
    a = torch.randn(1, 2, 4, dtype=torch.bfloat16)
    assert ops.conv_qkv_gates_decision(qkv, a, a, Hk=2, K=128, Hv=4, V=128, Kc=4).kernel
    assert "conv width 9" in ops.conv_qkv_gates_decision(qkv, a, a, Hk=2, K=128, Hv=4, V=128, Kc=9).reasons[0]
    assert "dtype torch.float32 unsupported by the glue kernels" in ops.dtype_reason(qkv.float())


def test_norms_write_out_dtype_on_every_path_and_fall_back_where_the_kernel_lacks_it(monkeypatch):
    """``out_dtype``: off Hopper the torch formulation rounds its result to it (fp32 rows to bf16 rounded once); as on
    an H200, fp32 rows to bf16 / fp16 go to the kernels (under grad to their autograd Functions) with the dtype, while
    a combination the kernels lack (bf16 rows written in fp32) takes torch with backend=None and names the reason
    when the kernel is forced."""
    from flashqla_kernels import dispatch
    from flashqla_kernels.decoder import autograd, torch_path

    x, w = 3 * torch.randn(3, 64), 0.1 * torch.randn(64)
    r = torch.randn(3, 64, dtype=torch.bfloat16)
    ref = torch_path.rms_norm_zero_centred(x, w, 1e-6)
    y = ops.rms_norm(x, w, 1e-6, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref.bfloat16())
    s, y = ops.add_rms_norm(x, r, w, 1e-6, out_dtype=torch.float16)
    assert s.dtype == torch.float32 and torch.equal(s, x + r)
    assert torch.equal(y, torch_path.rms_norm_zero_centred(x + r, w, 1e-6).half())

    monkeypatch.setattr(dispatch, "hopper_reason", lambda *tensors: None)
    calls = []
    monkeypatch.setattr(ops.hopper, "rms_norm_fwd", lambda x, w, eps, *, out_dtype: calls.append(out_dtype) or x)
    monkeypatch.setattr(ops.hopper, "add_rms_norm_fwd",
                        lambda a, b, w, eps, *, out_dtype: calls.append(out_dtype) or (a, a))
    monkeypatch.setattr(autograd, "rms_norm", lambda x, w, eps, *, out_dtype: calls.append(("grad", out_dtype)) or x)
    ops.rms_norm(x, w, 1e-6, out_dtype=torch.bfloat16)
    ops.add_rms_norm(x, r, w, 1e-6, out_dtype=torch.float16)
    ops.rms_norm(x, w.clone().requires_grad_(True), 1e-6, out_dtype=torch.bfloat16)
    ops.rms_norm(x.bfloat16(), w, 1e-6, out_dtype=None)
    assert calls == [torch.bfloat16, torch.float16, ("grad", torch.bfloat16), None]
    xb = x.bfloat16()
    y = ops.rms_norm(xb, w, 1e-6, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and len(calls) == 4  # the torch formulation ran
    with pytest.raises(ValueError, match="cannot run rms_norm on these inputs: the RMSNorm kernels write "
                                         "torch.bfloat16 rows in their own dtype"):
        ops.rms_norm(xb, w, 1e-6, out_dtype=torch.float32, backend="tilelang")
    with pytest.raises(ValueError, match="cannot run add_rms_norm on these inputs: the RMSNorm kernels"):
        ops.add_rms_norm(xb, xb, w, 1e-6, out_dtype=torch.float16, backend="tilelang")
