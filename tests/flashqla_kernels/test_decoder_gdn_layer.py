"""The fused GDN layer (``flashqla_kernels.decoder.gdn_layer``) with its torch formulation against transformers' own
layer forward, on tiny models of every hybrid family (fp32, tight): prefill across a chunk boundary, prefill
continuation and decode with the model's cache, padding masks, patched greedy generation, the fallback cases,
``explain_gdn_layer``, the b/a projections as one GEMM, and unpatching. The tiny-model accessors here are shared by
the patching tests."""
from __future__ import annotations

import inspect

import re

import pytest
import torch
from transformers import DynamicCache

from flashqla_kernels.decoder import explain_gdn_layer, gdn_layer_forward, layer_unsupported_reason, ops, torch_path
from flashqla_kernels.decoder import gdn_layer as gdn_layer_mod
from flashqla_kernels.patching import families, gdn_layers_patched, patched_gdn_layers, unpatch_gdn_layers
from tests.factories import HYBRID_FAMILIES, tiny_model

ATOL = 2e-5


def family_module(family):
    """transformers' modeling module of a hybrid family (``"qwen3_5"``...)."""
    return next(f for f in families.FAMILIES if f.name == family).module()


def text_model(model):
    inner = model.model
    return getattr(inner, "language_model", inner)


def gdn_of(model):
    return next(layer.linear_attn for layer in text_model(model).layers if hasattr(layer, "linear_attn"))


def new_cache(model):
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def call_with_cache(layer, h, cache):
    """The layer's forward with a cache: ``cache=`` from transformers 5.24, ``cache_params=`` before (5.17-5.23)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(type(layer).forward).parameters else "cache_params"
    return layer(h, **{name: cache})


def states(cache, idx):
    """(conv state, recurrent state) of layer idx through whichever cache API this transformers has."""
    return gdn_layer_mod.cached_states(cache, idx)


def mlp_of(model):
    """The model's first dense gate/up/down MLP: the decoder MLP, else the MoE block's shared expert."""
    mlp = text_model(model).layers[0].mlp
    return getattr(mlp, "shared_expert", mlp)


def attn_call(model, ids):
    """The first gated attention layer and the (args, kwargs) its decoder layer calls it with in a cache-less
    forward of ``ids`` (the real call convention of this transformers version)."""
    attn = next(layer.self_attn for layer in text_model(model).layers if hasattr(layer, "self_attn"))
    seen = []
    handle = attn.register_forward_pre_hook(lambda m, a, kw: seen.append((a, dict(kw))), with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        handle.remove()
    return attn, seen[0]


def _spread_params(layer):
    """Non-trivial conv bias-free weights, gates and norm weight so every term of the layer matters."""
    with torch.no_grad():
        layer.A_log.uniform_(-2, 1)
        layer.dt_bias.normal_(0, 0.5)
        layer.norm.weight.normal_(1, 0.2)


@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    unpatch_gdn_layers()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_prefill_matches_transformers_across_chunk_boundary(family):
    model = tiny_model(family)
    layer = gdn_of(model)
    _spread_params(layer)
    h = torch.randn(2, 70, layer.hidden_size)
    with torch.no_grad():
        want = layer(h)
        got = gdn_layer_forward(layer, h, backend="torch")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_cached_prefill_continuation_and_decode_match_transformers(family):
    model = tiny_model(family)
    layer = gdn_of(model)
    _spread_params(layer)
    ours, theirs = new_cache(model), new_cache(model)
    steps = [torch.randn(2, n, layer.hidden_size) for n in (66, 5, 1, 1, 2)]
    for i, h in enumerate(steps):
        with torch.no_grad():
            want = call_with_cache(layer, h, theirs)
            got = gdn_layer_forward(layer, h, cache=ours, backend="torch")
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5, msg=lambda m: f"step {i}: {m}")
        idx = layer.layer_idx
        torch.testing.assert_close(states(ours, idx)[0], states(theirs, idx)[0], atol=0, rtol=0)
        torch.testing.assert_close(states(ours, idx)[1], states(theirs, idx)[1], atol=ATOL, rtol=1e-5)


def test_short_first_prefill_pads_the_conv_state_like_transformers():
    model = tiny_model("qwen3_5")
    layer = gdn_of(model)
    ours, theirs = new_cache(model), new_cache(model)
    h = torch.randn(1, 2, layer.hidden_size)  # T = 2 < conv kernel 4
    with torch.no_grad():
        call_with_cache(layer, h, theirs)
        gdn_layer_forward(layer, h, cache=ours, backend="torch")
        nxt = torch.randn(1, 1, layer.hidden_size)
        want, got = call_with_cache(layer, nxt, theirs), gdn_layer_forward(layer, nxt, cache=ours, backend="torch")
    assert torch.equal(states(ours, layer.layer_idx)[0], states(theirs, layer.layer_idx)[0])
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
            layer = gdn_of(model)
            handle = layer.register_forward_hook(lambda m, a, o: calls.append(o.shape[1]))
            got = model.generate(ids, **kw)
            handle.remove()
    assert torch.equal(got, want)
    assert calls[0] == 9 and set(calls[1:]) == {1}, calls  # one prefill, then decode steps through our path


def test_patch_routes_through_fused_path_and_unpatch_restores():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    original = m.Qwen3_5GatedDeltaNet.__dict__["forward"]
    model = tiny_model("qwen3_5")
    layer = gdn_of(model)
    seen = []
    spy = torch_path.conv_split_l2norm_gates

    def counting(*a, **k):
        seen.append(1)
        return spy(*a, **k)

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
    assert not gdn_layers_patched() and layer is gdn_of(model)


def test_unsupported_calls_fall_back_to_transformers():
    model = tiny_model("qwen3_5")
    layer = gdn_of(model)
    cache = new_cache(model)
    # transformers 5.25's GDN forward reads how many intermediate recurrent states to record; its default (None)
    # breaks that forward itself, so ask for none where the layers take the argument
    takes = any("recurrent_states_to_keep" in inspect.signature(lay.activate_past_recording).parameters
                for lay in cache.layers if hasattr(lay, "activate_past_recording"))
    cache.activate_past_recording(**({"recurrent_states_to_keep": 0} if takes else {}))
    assert "crop" in layer_unsupported_reason(layer, cache)
    assert "packed" in layer_unsupported_reason(layer, None, {"cu_seq_lens_q": torch.tensor([0, 3])})
    assert layer_unsupported_reason(layer, new_cache(model)) is None
    h = torch.randn(1, 6, layer.hidden_size)
    with torch.no_grad():
        want = call_with_cache(layer, h, new_cache(model))
        with patched_gdn_layers(backend="torch"):
            got = call_with_cache(layer, h, cache)  # recording cache: transformers' own forward runs
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert cache.layers[layer.layer_idx].conv_states[0].shape[-1] == 6  # the full history, as only it keeps


def test_norm_hooks_still_fire_under_the_fused_path():
    model = tiny_model("qwen3_5")
    layer = gdn_of(model)
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
    layer = gdn_of(model)
    h = torch.randn(1, 4, layer.hidden_size)
    ours, theirs = new_cache(model), new_cache(model)
    with torch.no_grad():
        want = call_with_cache(layer, h, theirs)
        with patched_gdn_layers(backend="torch"):
            got = layer(h, cache_params=ours)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert torch.equal(states(ours, layer.layer_idx)[0], states(theirs, layer.layer_idx)[0])


def test_explain_gdn_layer_names_each_stage_and_the_reason():
    model = tiny_model("qwen3_5")
    layer = gdn_of(model)
    h = torch.randn(2, 70, layer.hidden_size)
    text = explain_gdn_layer(layer, h)
    assert text.startswith("layer: fused")
    assert "conv_qkv_gates: torch (tensors are on cpu" in text
    # the chunk op's line is explain_backend's text: it names the torch backend
    assert re.search(r"chunk op: .*backend:? torch", text) and "gated_norm: torch (tensors are on cpu" in text
    assert "requested with backend='torch'" in explain_gdn_layer(layer, h, backend="torch")
    cache = new_cache(model)
    with torch.no_grad():
        call_with_cache(layer, h, cache)
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
    layer = gdn_of(model)

    class OldCache:
        def update_conv_state(self, *args, **kwargs):
            raise AssertionError("never reached")

    assert "lacks get_conv_state, get_recurrent_state, update_recurrent_state" in layer_unsupported_reason(
        layer, OldCache())
    with pytest.raises(ValueError, match=r"OldCache \(transformers .*\) lacks get_conv_state.*patch_gdn_layers"):
        gdn_layer_forward(layer, torch.randn(1, 3, layer.hidden_size), cache=OldCache())


def test_b_and_a_projections_run_as_one_gemm_only_when_plain():
    model = tiny_model("qwen3_5")
    gdn = next(layer.linear_attn for layer in text_model(model).layers if hasattr(layer, "linear_attn"))
    h = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = (gdn.in_proj_b(h), gdn.in_proj_a(h))
        got = gdn_layer_mod._project_b_a(gdn, h)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
        gdn.in_proj_a.weight.data.mul_(3)  # an in-place edit through .data (no version bump) is seen
        torch.testing.assert_close(gdn_layer_mod._project_b_a(gdn, h)[1], gdn.in_proj_a(h), atol=1e-6, rtol=1e-6)
    seen = []
    handle = gdn.in_proj_a.register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad():
        b, a = gdn_layer_mod._project_b_a(gdn, h)
    handle.remove()
    assert len(seen) == 1 and seen[0] is a
