"""The MLP patch (``flashqla_kernels.patching.mlp``): opt-out, restorable, off Hopper transformers' forward exactly;
the reasons that send an MLP to transformers' forward or keep its projections module calls; ``ops.swiglu``'s torch
formulation."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.decoder import hopper, ops
from flashqla_kernels.patching import mlp as mlp_patch
from flashqla_kernels.patching import patched_gdn_layers, unpatch_gdn_layers
from tests.factories import tiny_model
from tests.flashqla_kernels.test_decoder_gdn_layer import family_module, mlp_of

@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    unpatch_gdn_layers()


@pytest.mark.parametrize("family,cls_name", [("qwen3_5", "Qwen3_5MLP"), ("qwen3_next", "Qwen3NextMLP"),
                                             ("qwen3_5_moe", "Qwen3_5MoeMLP")])
def test_mlp_patch_is_opt_out_restorable_and_exact_off_hopper(family, cls_name):
    cls = getattr(family_module(family), cls_name)
    original = cls.__dict__["forward"]
    model = tiny_model(family)
    mlp = mlp_of(model)
    assert type(mlp) is cls
    x = torch.randn(2, 9, mlp.hidden_size)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        want, want_logits = mlp(x), model(ids, use_cache=False).logits
        with patched_gdn_layers(backend="torch", mlp=False) as targets:
            assert cls.__dict__["forward"] is original and not any(t.endswith("MLP.forward") for t in targets)
        for backend in (None, "tilelang"):  # off Hopper even the forced kernels hand the MLP to transformers
            with patched_gdn_layers(backend=backend, rms_norms=False) as targets:
                assert f"{cls.__module__}.{cls_name}.forward" in targets
                patched = cls.__dict__["forward"]
                assert patched is not original and patched.__wrapped__ is original
                assert torch.equal(mlp(x), want)
        with patched_gdn_layers(backend="torch"):
            got_logits = model(ids, use_cache=False).logits
    assert cls.__dict__["forward"] is original
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)


def test_mlp_kernel_reasons_name_what_sends_the_mlp_to_transformers():
    mlp = mlp_of(tiny_model("qwen3_5"))
    x = torch.randn(1, 3, mlp.hidden_size, dtype=torch.bfloat16)
    assert "tensors are on cpu" in mlp_patch.kernel_reason(mlp, x)
    handle = mlp.act_fn.register_forward_hook(lambda *a: None)
    assert "act_fn has hooks" in mlp_patch.kernel_reason(mlp, x)
    handle.remove()
    mlp.act_fn = torch.nn.GELU()
    assert "act_fn GELU is not SiLU" in mlp_patch.kernel_reason(mlp, x)
    mlp.act_fn = torch.nn.SiLU()
    mlp.gate_proj = torch.nn.Linear(mlp.hidden_size, 96, bias=False)
    assert "intermediate size 96 is not a multiple of 64" in mlp_patch.kernel_reason(mlp, x)


def test_fused_gemm_reasons_keep_hooked_biased_or_wrapped_projections_on_their_modules(monkeypatch):
    mlp = mlp_of(tiny_model("qwen3_5"))
    monkeypatch.setattr(mlp_patch, "FUSED_MLP_GEMM", False)
    assert mlp_patch.fused_gemm_reason(mlp) == "FUSED_MLP_GEMM is off"
    monkeypatch.setattr(mlp_patch, "FUSED_MLP_GEMM", True)
    assert mlp_patch.fused_gemm_reason(mlp) is None
    handle = mlp.up_proj.register_forward_pre_hook(lambda *a: None)
    assert mlp_patch.fused_gemm_reason(mlp) == "up_proj has hooks, which the fused GEMM would skip"
    handle.remove()
    mlp.gate_proj.bias = torch.nn.Parameter(torch.zeros(mlp.gate_proj.out_features))
    assert mlp_patch.fused_gemm_reason(mlp) == "gate_proj has a bias"
    mlp.gate_proj = torch.nn.Sequential(torch.nn.Linear(mlp.hidden_size, mlp.up_proj.out_features, bias=False))
    assert mlp_patch.fused_gemm_reason(mlp) == "gate_proj is a Sequential, not a plain nn.Linear"


def test_fused_gemm_reasons_name_the_tensors_the_kernel_refuses(monkeypatch):
    mlp = mlp_of(tiny_model("qwen3_5"))
    monkeypatch.setattr(mlp_patch, "FUSED_MLP_GEMM", True)
    x = torch.randn(1, 3, mlp.hidden_size, dtype=torch.bfloat16)
    assert mlp_patch.fused_gemm_reason(mlp, x) == "weights in torch.float32 for torch.bfloat16 activations"
    assert "tensors are on cpu" in mlp_patch.fused_gemm_reason(mlp, x.float())
    monkeypatch.setattr(mlp_patch.ops, "glue_kernel_reason", lambda *t: None)  # as on an H200
    assert mlp_patch.fused_gemm_reason(mlp, x.float()) == hopper.swiglu_shape_reason(
        *mlp.gate_proj.weight.shape, torch.float32)
    assert "dtype torch.float32 unsupported by the SwiGLU GEMM" in mlp_patch.fused_gemm_reason(mlp, x.float())


def test_swiglu_torch_path_is_the_mlp_expression_and_the_patched_mlp_equals_transformers_off_hopper(monkeypatch):
    """ops.swiglu's torch formulation rounds each projection like transformers' MLP (bit for bit in fp32 and bf16);
    with FUSED_MLP_GEMM on, the patched MLP off Hopper is still transformers' forward, exactly."""
    model = tiny_model("qwen3_5")
    mlp = mlp_of(model)
    x = torch.randn(2, 9, mlp.hidden_size)
    wg, wu = mlp.gate_proj.weight, mlp.up_proj.weight
    with torch.no_grad():
        want = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        assert torch.equal(ops.swiglu(x, wg, wu), want)
        xb, gb, ub = x.bfloat16(), wg.bfloat16(), wu.bfloat16()
        got = ops.swiglu(xb, gb, ub, backend="torch")
        lin = torch.nn.functional.linear
        assert torch.equal(got, (torch.nn.functional.silu(lin(xb, gb).float()) * lin(xb, ub).float()).bfloat16())
        with pytest.raises(ValueError, match="cannot run swiglu_gemm on these inputs: tensors are on cpu"):
            ops.swiglu(xb, gb, ub, backend="tilelang")
        monkeypatch.setattr(mlp_patch, "FUSED_MLP_GEMM", True)
        with patched_gdn_layers():
            assert torch.equal(mlp(x), mlp.down_proj(want))
