"""The fused GDN layer's torch formulation against transformers' own layer forward, on tiny models of every hybrid
family (fp32, tight): prefill across a chunk boundary, prefill continuation and decode with the model's cache,
padding masks, patched greedy generation, the fallback cases, and unpatching."""
from __future__ import annotations

import importlib

import pytest
import torch
from transformers import DynamicCache

from flashqla_kernels.gdn_layer import gdn_layer_forward, layer_unsupported_reason, patched_gdn_layers
from flashqla_kernels.gdn_layer import patch as gdn_patch
from flashqla_kernels.gdn_layer import torch_path
from tests.factories import HYBRID_FAMILIES, tiny_model

ATOL = 2e-5


def _text_model(model):
    inner = model.model
    return getattr(inner, "language_model", inner)


def _gdn(model):
    return next(layer.linear_attn for layer in _text_model(model).layers if hasattr(layer, "linear_attn"))


def _cache(model):
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def _call(layer, h, cache):
    """The layer's forward with a cache: ``cache=`` from transformers 5.24, ``cache_params=`` before (5.17-5.23)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(type(layer).forward).parameters else "cache_params"
    return layer(h, **{name: cache})


def _states(cache, idx):
    """(conv state, recurrent state) of layer idx through whichever cache API this transformers has."""
    from flashqla_kernels.gdn_layer import layer as layer_mod

    return layer_mod._cached_states(cache, idx)


def _spread_params(layer):
    """Non-trivial conv bias-free weights, gates and norm weight so every term of the layer matters."""
    with torch.no_grad():
        layer.A_log.uniform_(-2, 1)
        layer.dt_bias.normal_(0, 0.5)
        layer.norm.weight.normal_(1, 0.2)


@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    gdn_patch.unpatch_gdn_layers()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_prefill_matches_transformers_across_chunk_boundary(family):
    model = tiny_model(family)
    layer = _gdn(model)
    _spread_params(layer)
    h = torch.randn(2, 70, layer.hidden_size)
    with torch.no_grad():
        want = layer(h)
        got = gdn_layer_forward(layer, h, backend="torch")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_cached_prefill_continuation_and_decode_match_transformers(family):
    model = tiny_model(family)
    layer = _gdn(model)
    _spread_params(layer)
    ours, theirs = _cache(model), _cache(model)
    steps = [torch.randn(2, n, layer.hidden_size) for n in (66, 5, 1, 1, 2)]
    for i, h in enumerate(steps):
        with torch.no_grad():
            want = _call(layer, h, theirs)
            got = gdn_layer_forward(layer, h, cache=ours, backend="torch")
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5, msg=lambda m: f"step {i}: {m}")
        idx = layer.layer_idx
        torch.testing.assert_close(_states(ours, idx)[0], _states(theirs, idx)[0], atol=0, rtol=0)
        torch.testing.assert_close(_states(ours, idx)[1], _states(theirs, idx)[1], atol=ATOL, rtol=1e-5)


def test_short_first_prefill_pads_the_conv_state_like_transformers():
    model = tiny_model("qwen3_5")
    layer = _gdn(model)
    ours, theirs = _cache(model), _cache(model)
    h = torch.randn(1, 2, layer.hidden_size)  # T = 2 < conv kernel 4
    with torch.no_grad():
        _call(layer, h, theirs)
        gdn_layer_forward(layer, h, cache=ours, backend="torch")
        nxt = torch.randn(1, 1, layer.hidden_size)
        want, got = _call(layer, nxt, theirs), gdn_layer_forward(layer, nxt, cache=ours, backend="torch")
    assert torch.equal(_states(ours, layer.layer_idx)[0], _states(theirs, layer.layer_idx)[0])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_patched_model_equals_unpatched_with_left_padding(family):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits
        with patched_gdn_layers(backend="torch"):
            got = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_patched_greedy_generation_equals_unpatched(family):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (2, 9))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        calls = []
        with patched_gdn_layers(backend="torch"):
            layer = _gdn(model)
            handle = layer.register_forward_hook(lambda m, a, o: calls.append(o.shape[1]))
            got = model.generate(ids, **kw)
            handle.remove()
    assert torch.equal(got, want)
    assert calls[0] == 9 and set(calls[1:]) == {1}, calls  # one prefill, then decode steps through our path


def test_patch_routes_through_fused_path_and_unpatch_restores():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    original = m.Qwen3_5GatedDeltaNet.__dict__["forward"]
    model = tiny_model("qwen3_5")
    layer = _gdn(model)
    seen = []
    spy = torch_path.conv_split_l2norm_gates

    def counting(*a, **k):
        seen.append(1)
        return spy(*a, **k)

    import flashqla_kernels.gdn_layer.ops as ops
    ops.torch_path.conv_split_l2norm_gates = counting
    try:
        with patched_gdn_layers(backend="torch") as targets:
            assert any(t.endswith("Qwen3_5GatedDeltaNet.forward") for t in targets)
            assert m.Qwen3_5GatedDeltaNet.forward is not original
            model(torch.randint(0, 256, (1, 5)), use_cache=False)
        assert len(seen) == 2  # the tiny model's two GDN layers
        assert m.Qwen3_5GatedDeltaNet.__dict__["forward"] is original
        model(torch.randint(0, 256, (1, 5)), use_cache=False)
        assert len(seen) == 2
    finally:
        ops.torch_path.conv_split_l2norm_gates = spy
    assert not gdn_patch.gdn_layers_patched() and layer is _gdn(model)


def test_nested_context_restores_outer_backend():
    with patched_gdn_layers(backend="torch"):
        with patched_gdn_layers(backend=None):
            assert gdn_patch._current_backend() is None
        assert gdn_patch._current_backend() == "torch"
    assert not gdn_patch.gdn_layers_patched()


def test_unsupported_calls_fall_back_to_transformers():
    model = tiny_model("qwen3_5")
    layer = _gdn(model)
    cache = _cache(model)
    cache.activate_past_recording()
    assert "crop" in layer_unsupported_reason(layer, cache)
    assert "packed" in layer_unsupported_reason(layer, None, {"cu_seq_lens_q": torch.tensor([0, 3])})
    assert layer_unsupported_reason(layer, _cache(model)) is None
    h = torch.randn(1, 6, layer.hidden_size)
    with torch.no_grad():
        want = _call(layer, h, _cache(model))
        with patched_gdn_layers(backend="torch"):
            got = _call(layer, h, cache)  # recording cache: transformers' own forward runs
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert cache.layers[layer.layer_idx].conv_states[0].shape[-1] == 6  # the full history, as only it keeps


def test_norm_hooks_still_fire_under_the_fused_path():
    model = tiny_model("qwen3_5")
    layer = _gdn(model)
    shapes = []
    layer.norm.register_forward_hook(lambda m, a, o: shapes.append(tuple(o.shape)))
    h = torch.randn(2, 3, layer.hidden_size)
    with torch.no_grad():
        want = layer(h)
        got = gdn_layer_forward(layer, h, backend="torch")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert shapes == [(2 * 3 * layer.num_v_heads, layer.head_v_dim)] * 2


def test_old_cache_params_spelling_is_accepted():
    model = tiny_model("qwen3_5")
    layer = _gdn(model)
    h = torch.randn(1, 4, layer.hidden_size)
    ours, theirs = _cache(model), _cache(model)
    with torch.no_grad():
        want = _call(layer, h, theirs)
        with patched_gdn_layers(backend="torch"):
            got = layer(h, cache_params=ours)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert torch.equal(_states(ours, layer.layer_idx)[0], _states(theirs, layer.layer_idx)[0])


def test_patch_transformers_fused_layer_composes_with_the_op_patch():
    import flashqla_kernels.patch as op_patch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    original_forward = m.Qwen3_5GatedDeltaNet.__dict__["forward"]
    original_chunk = m.torch_chunk_gated_delta_rule
    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (1, 70))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        try:
            with op_patch.patched_transformers(backend="torch"):
                with op_patch.patched_transformers(backend="torch", fused_layer=True) as targets:
                    assert any(t.endswith("GatedDeltaNet.forward") for t in targets)
                    got = model(ids, use_cache=False).logits
                # the outer op-only patch is back, the layer forward is transformers' again
                assert m.torch_chunk_gated_delta_rule is not original_chunk
                assert m.Qwen3_5GatedDeltaNet.__dict__["forward"] is original_forward
            assert m.torch_chunk_gated_delta_rule is original_chunk
            op_patch.patch_transformers(fused_layer=True)
            assert op_patch.is_patched() and gdn_patch.gdn_layers_patched()
            restored = op_patch.unpatch_transformers()
            assert any(t.endswith("Qwen3_5GatedDeltaNet.forward") for t in restored)
        finally:
            op_patch.unpatch_transformers()
    assert m.Qwen3_5GatedDeltaNet.__dict__["forward"] is original_forward and not op_patch.is_patched()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_formulation_is_transformers_bit_for_bit(dtype):
    model = tiny_model("qwen3_5").to(dtype)
    norm = _text_model(model).layers[0].input_layernorm
    x = (3 * torch.randn(2, 7, norm.weight.shape[0])).to(dtype)
    with torch.no_grad():
        assert torch.equal(torch_path.rms_norm_zero_centred(x, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize("family,cls_name", [("qwen3_5", "Qwen3_5RMSNorm"), ("qwen3_next", "Qwen3NextRMSNorm"),
                                             ("qwen3_5_moe", "Qwen3_5MoeRMSNorm")])
def test_rms_norm_patch_is_opt_out_restorable_and_exact_off_hopper(family, cls_name):
    import importlib

    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls_name)
    original = cls.__dict__["forward"]
    model = tiny_model(family)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        with patched_gdn_layers(backend="torch", rms_norms=False):
            assert cls.__dict__["forward"] is original
        with patched_gdn_layers(backend="torch") as targets:
            assert f"{cls.__module__}.{cls_name}.forward" in targets
            assert cls.__dict__["forward"] is not original
            got = model(ids, use_cache=False).logits
    assert cls.__dict__["forward"] is original
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _mlp(model):
    """The model's first dense gate/up/down MLP: the decoder MLP, else the MoE block's shared expert."""
    mlp = _text_model(model).layers[0].mlp
    return getattr(mlp, "shared_expert", mlp)


@pytest.mark.parametrize("family,cls_name", [("qwen3_5", "Qwen3_5MLP"), ("qwen3_next", "Qwen3NextMLP"),
                                             ("qwen3_5_moe", "Qwen3_5MoeMLP")])
def test_mlp_patch_is_opt_out_restorable_and_exact_off_hopper(family, cls_name):
    import importlib

    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls_name)
    original = cls.__dict__["forward"]
    model = tiny_model(family)
    mlp = _mlp(model)
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


def test_mlp_patch_restores_the_state_found_on_entry():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5MLP, Qwen3_5RMSNorm

    originals = [c.__dict__["forward"] for c in (Qwen3_5GatedDeltaNet, Qwen3_5MLP, Qwen3_5RMSNorm)]
    gdn_patch.patch_gdn_layers(backend="torch", mlp=False)
    outer = Qwen3_5GatedDeltaNet.__dict__["forward"]
    with patched_gdn_layers():
        assert Qwen3_5MLP.__dict__["forward"] is not originals[1]
    assert Qwen3_5MLP.__dict__["forward"] is originals[1], "mlp=False state not restored"
    assert getattr(Qwen3_5GatedDeltaNet.forward, "_flashqla_fused_backend") == "torch" and outer is not originals[0]
    assert Qwen3_5RMSNorm.__dict__["forward"] is not originals[2]
    gdn_patch.patch_gdn_layers()  # idempotent: the originals saved first stay saved
    gdn_patch.patch_gdn_layers()
    restored = gdn_patch.unpatch_gdn_layers()
    assert "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5MLP.forward" in restored
    assert [c.__dict__["forward"] for c in (Qwen3_5GatedDeltaNet, Qwen3_5MLP, Qwen3_5RMSNorm)] == originals


def test_silu_mul_formulation_is_transformers_bit_for_bit_in_fp32_and_rounds_once_in_bf16():
    mlp = _mlp(tiny_model("qwen3_5"))
    x = torch.randn(2, 9, mlp.hidden_size)
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        assert torch.equal(torch_path.silu_mul(gate, up), mlp.act_fn(gate) * up)
        assert torch.equal(mlp.down_proj(torch_path.silu_mul(gate, up)), mlp(x))
        got = torch_path.silu_mul(gate.bfloat16(), up.bfloat16())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (torch.nn.functional.silu(gate.bfloat16().float()) * up.bfloat16().float()).bfloat16())


def test_mlp_kernel_reasons_name_what_sends_the_mlp_to_transformers():
    mlp = _mlp(tiny_model("qwen3_5"))
    x = torch.randn(1, 3, mlp.hidden_size, dtype=torch.bfloat16)
    assert "tensors are on cpu" in gdn_patch._mlp_kernel_reason(mlp, x)
    handle = mlp.act_fn.register_forward_hook(lambda *a: None)
    assert "act_fn has hooks" in gdn_patch._mlp_kernel_reason(mlp, x)
    handle.remove()
    mlp.act_fn = torch.nn.GELU()
    assert "act_fn GELU is not SiLU" in gdn_patch._mlp_kernel_reason(mlp, x)
    mlp.act_fn = torch.nn.SiLU()
    mlp.gate_proj = torch.nn.Linear(mlp.hidden_size, 96, bias=False)
    assert "intermediate size 96 is not a multiple of 64" in gdn_patch._mlp_kernel_reason(mlp, x)


def test_fused_gemm_reasons_keep_hooked_biased_or_wrapped_projections_on_their_modules(monkeypatch):
    mlp = _mlp(tiny_model("qwen3_5"))
    monkeypatch.setattr(gdn_patch, "FUSED_MLP_GEMM", False)
    assert gdn_patch._fused_gemm_reason(mlp) == "FUSED_MLP_GEMM is off"
    monkeypatch.setattr(gdn_patch, "FUSED_MLP_GEMM", True)
    assert gdn_patch._fused_gemm_reason(mlp) is None
    handle = mlp.up_proj.register_forward_pre_hook(lambda *a: None)
    assert gdn_patch._fused_gemm_reason(mlp) == "up_proj has hooks, which the fused GEMM would skip"
    handle.remove()
    mlp.gate_proj.bias = torch.nn.Parameter(torch.zeros(mlp.gate_proj.out_features))
    assert gdn_patch._fused_gemm_reason(mlp) == "gate_proj has a bias"
    mlp.gate_proj = torch.nn.Sequential(torch.nn.Linear(mlp.hidden_size, mlp.up_proj.out_features, bias=False))
    assert gdn_patch._fused_gemm_reason(mlp) == "gate_proj is a Sequential, not a plain nn.Linear"


def test_fused_gemm_reasons_name_the_tensors_the_kernel_refuses(monkeypatch):
    mlp = _mlp(tiny_model("qwen3_5"))
    monkeypatch.setattr(gdn_patch, "FUSED_MLP_GEMM", True)
    x = torch.randn(1, 3, mlp.hidden_size, dtype=torch.bfloat16)
    assert gdn_patch._fused_gemm_reason(mlp, x) == "weights in torch.float32 for torch.bfloat16 activations"
    assert "tensors are on cpu" in gdn_patch._fused_gemm_reason(mlp, x.float())
    hopper = importlib.import_module("flashqla_kernels.gdn_layer.hopper")
    monkeypatch.setattr(gdn_patch.ops, "glue_kernel_reason", lambda *t: None)  # as on an H200
    assert gdn_patch._fused_gemm_reason(mlp, x.float()) == hopper.swiglu_shape_reason(
        *mlp.gate_proj.weight.shape, torch.float32)
    assert "dtype torch.float32 unsupported by the SwiGLU GEMM" in gdn_patch._fused_gemm_reason(mlp, x.float())


def test_swiglu_torch_path_is_the_mlp_expression_and_the_patched_mlp_equals_transformers_off_hopper(monkeypatch):
    """ops.swiglu's torch formulation rounds each projection like transformers' MLP (bit for bit in fp32 and bf16);
    with FUSED_MLP_GEMM on, the patched MLP off Hopper is still transformers' forward, exactly."""
    from flashqla_kernels.gdn_layer import ops

    model = tiny_model("qwen3_5")
    mlp = _mlp(model)
    x = torch.randn(2, 9, mlp.hidden_size)
    wg, wu = mlp.gate_proj.weight, mlp.up_proj.weight
    with torch.no_grad():
        want = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        assert torch.equal(ops.swiglu(x, wg, wu), want)
        xb, gb, ub = x.bfloat16(), wg.bfloat16(), wu.bfloat16()
        got = ops.swiglu(xb, gb, ub, backend="torch")
        lin = torch.nn.functional.linear
        assert torch.equal(got, (torch.nn.functional.silu(lin(xb, gb).float()) * lin(xb, ub).float()).bfloat16())
        with pytest.raises(ValueError, match="cannot run the swiglu_gemm kernel: tensors are on cpu"):
            ops.swiglu(xb, gb, ub, backend="tilelang")
        monkeypatch.setattr(gdn_patch, "FUSED_MLP_GEMM", True)
        with patched_gdn_layers():
            assert torch.equal(mlp(x), mlp.down_proj(want))


def test_explain_gdn_layer_names_each_stage_and_the_reason():
    from flashqla_kernels.gdn_layer import explain_gdn_layer

    model = tiny_model("qwen3_5")
    layer = _gdn(model)
    h = torch.randn(2, 70, layer.hidden_size)
    text = explain_gdn_layer(layer, h)
    assert text.startswith("layer: fused")
    assert "conv_qkv_gates: torch (tensors are on cpu" in text
    assert "chunk op: backend: torch" in text and "gated_norm: torch (tensors are on cpu" in text
    assert "requested with backend='torch'" in explain_gdn_layer(layer, h, backend="torch")
    cache = _cache(model)
    with torch.no_grad():
        _call(layer, h, cache)
    assert "recurrent op" in explain_gdn_layer(layer, h[:, :1], cache)
    cache.activate_past_recording()
    assert explain_gdn_layer(layer, h, cache).startswith("layer: transformers' forward (the cache records")


def test_patched_generation_with_a_static_cache_equals_unpatched():
    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (2, 70))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(ids, **kw)
        with patched_gdn_layers(backend="torch"):
            got = model.generate(ids, **kw)
    assert torch.equal(got, want)


def test_a_cache_without_the_hybrid_cache_api_is_refused_by_name():
    """transformers before 5.23 keeps GDN states in another cache API (seen on the H200 with 5.17): the direct call
    says what is missing and what to do; the patched layer hands such calls to transformers instead."""
    model = tiny_model("qwen3_5")
    layer = _gdn(model)

    class OldCache:
        def update_conv_state(self, *args, **kwargs):
            raise AssertionError("never reached")

    assert "lacks get_conv_state, get_recurrent_state, update_recurrent_state" in layer_unsupported_reason(
        layer, OldCache())
    with pytest.raises(ValueError, match=r"OldCache \(transformers .*\) lacks get_conv_state.*patch_gdn_layers"):
        gdn_layer_forward(layer, torch.randn(1, 3, layer.hidden_size), cache=OldCache())


def _attn_call(model, ids):
    """The first gated attention layer and the (args, kwargs) its decoder layer calls it with in a cache-less
    forward of ``ids`` (the real call convention of this transformers version)."""
    attn = next(layer.self_attn for layer in _text_model(model).layers if hasattr(layer, "self_attn"))
    seen = []
    handle = attn.register_forward_pre_hook(lambda m, a, kw: seen.append((a, dict(kw))), with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        handle.remove()
    return attn, seen[0]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_patch_is_transformers_bit_for_bit_off_hopper(family, dtype, monkeypatch):
    """The gated attention forward on the fused wiring (q/k norm + RoPE in one op, the gate read in place) with the
    torch formulation equals transformers' forward bit for bit, called as the decoder layer calls it; the whole
    model's logits too."""
    from flashqla_kernels.gdn_layer import ops

    model = tiny_model(family, dtype=dtype)
    ids = torch.randint(0, 256, (2, 13))
    attn, (args, kwargs) = _attn_call(model, ids)
    cls = type(attn)
    original = cls.__dict__["forward"]
    calls = []
    real = ops.qk_norm_rope
    monkeypatch.setattr(ops, "qk_norm_rope", lambda *a, **kw: calls.append(kw["backend"]) or real(*a, **kw))
    with torch.no_grad():
        want = attn(*args, **kwargs)[0]
        with patched_gdn_layers(backend="torch", attention=False):
            assert cls.__dict__["forward"] is original
            base_logits = model(ids, use_cache=False).logits
        for backend in ("torch", None):
            with patched_gdn_layers(backend=backend) as targets:
                assert f"{cls.__module__}.{cls.__name__}.forward" in targets
                assert cls.__dict__["forward"].__wrapped__ is original
                got = attn(*args, **kwargs)[0]
                assert torch.equal(got, want)
                if backend == "torch":
                    logits = model(ids, use_cache=False).logits
    assert cls.__dict__["forward"] is original
    # the fused wiring ran: the direct call and the model forward's layers with "torch", the direct call with None
    assert calls[0] == "torch" and calls[-1] is None and calls.count("torch") >= 2
    assert torch.equal(logits, base_logits)


def test_unpadded_sdpa_prefill_reads_the_attention_output_head_major(monkeypatch):
    """Prefill without padding on SDPA: one causal GQA call, the gate op reading SDPA's [B, H, L, D] output (no
    transpose copy); a padding mask, the eager implementation or output_attentions keep transformers' interface."""
    from flashqla_kernels.gdn_layer import ops

    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (2, 11))
    attn, (args, kwargs) = _attn_call(model, ids)
    q = torch.zeros(2, attn.config.num_attention_heads, 11, attn.head_dim)
    assert gdn_patch._plain_causal_sdpa(attn, q, None, kwargs)
    assert not gdn_patch._plain_causal_sdpa(attn, q, torch.ones(2, 1, 11, 11, dtype=torch.bool), kwargs)
    assert not gdn_patch._plain_causal_sdpa(attn, q[:, :, :1], None, kwargs)
    assert not gdn_patch._plain_causal_sdpa(attn, q, None, {**kwargs, "output_attentions": True})
    head_major = []
    real = ops.gate_mul_head_major
    monkeypatch.setattr(ops, "gate_mul_head_major", lambda *a, **kw: head_major.append(a[0].shape) or real(*a, **kw))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :3] = 0  # left padding: a 4-D mask reaches the layers, so the interface runs
    with torch.no_grad():
        # the reference: every other patch on, the attention layers on transformers' forward
        with patched_gdn_layers(backend="torch", attention=False):
            want = model(ids, use_cache=False).logits
            want_masked = model(ids, attention_mask=mask, use_cache=False).logits
        with patched_gdn_layers(backend="torch"):
            assert torch.equal(model(ids, use_cache=False).logits, want)
            assert head_major and head_major[0] == (2, attn.config.num_attention_heads, 11, attn.head_dim)
            head_major.clear()
            assert torch.equal(model(ids, attention_mask=mask, use_cache=False).logits, want_masked)
            assert not head_major


def test_attention_calls_with_a_cache_or_hooked_norms_go_to_transformers(monkeypatch):
    from flashqla_kernels.gdn_layer import ops

    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (1, 9))
    attn, (args, kwargs) = _attn_call(model, ids)
    fused = []
    real = ops.qk_norm_rope
    monkeypatch.setattr(ops, "qk_norm_rope", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    assert gdn_patch.attention_fallback_reason(attn, None, kwargs.get("position_embeddings"), None) is None
    assert "KV cache" in gdn_patch.attention_fallback_reason(attn, None, kwargs.get("position_embeddings"), object())
    assert "position embeddings" in gdn_patch.attention_fallback_reason(attn, None, None, None)
    with torch.no_grad(), patched_gdn_layers(backend="torch"):
        want = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert not fused  # generation runs with a cache: every attention call took transformers' forward
        handle = attn.q_norm.register_forward_hook(lambda m, i, o: None)
        try:
            assert "hooks" in gdn_patch.attention_fallback_reason(attn, None, kwargs.get("position_embeddings"), None)
            attn(*args, **kwargs)
            assert not fused
        finally:
            handle.remove()
        attn(*args, **kwargs)
        assert fused
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), want)


def test_attention_glue_formulation_rotates_only_the_first_r_channels():
    """qk_norm_rope by hand: with cos = 1, sin = 0 it is the norm alone; with cos = 0, sin = 1 the first R channels
    are the rotated half (-x2, x1) and the rest untouched; gate_mul is attn * sigmoid(gate)."""
    torch.manual_seed(0)
    B, L, H, Hkv, D, R = 2, 5, 4, 2, 16, 8
    qg, kx = torch.randn(B, L, H, 2 * D), torch.randn(B, L, Hkv, D)
    wq, wk = torch.randn(D) * 0.1, torch.randn(D) * 0.1
    nq = torch_path.rms_norm_zero_centred(qg[..., :D], wq, 1e-6).transpose(1, 2)
    nk = torch_path.rms_norm_zero_centred(kx, wk, 1e-6).transpose(1, 2)
    q, k = torch_path.qk_norm_rope(qg, kx, wq, wk, 1e-6, torch.ones(1, L, R), torch.zeros(1, L, R))
    assert torch.equal(q, nq) and torch.equal(k, nk) and q.is_contiguous() and q.shape == (B, H, L, D)
    q, _ = torch_path.qk_norm_rope(qg, kx, wq, wk, 1e-6, torch.zeros(B, L, R), torch.ones(B, L, R))
    assert torch.equal(q[..., :R // 2], -nq[..., R // 2:R]) and torch.equal(q[..., R // 2:R], nq[..., :R // 2])
    assert torch.equal(q[..., R:], nq[..., R:])
    attn = torch.randn(B, L, H * D)
    want = attn * torch.sigmoid(qg[..., D:].reshape(B, L, H * D))
    assert torch.equal(torch_path.gate_mul(attn, qg), want)
    head_major = attn.view(B, L, H, D).transpose(1, 2).contiguous()
    assert torch.equal(torch_path.gate_mul_head_major(head_major, qg), want)
