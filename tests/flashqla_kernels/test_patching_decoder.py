"""The decoder-layer patch (``flashqla_kernels.patching.decoder``) on CPU: its wiring makes transformers' own module
calls in transformers' order (bit for bit against the unpatched decoder on tiny models of every hybrid family, with
and without a cache), the two residual fusions computed with torch's operations equal transformers' adds (fp32,
tight), hooks on the fused parts keep them module calls, and both cache spellings (5.17-5.23 and 5.24+) reach the
mixers."""
from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

from flashqla_kernels.decoder import gdn_layer as gdn_layer_mod
from flashqla_kernels.decoder import ops
from flashqla_kernels.patching import decoder as decoder_patch
from flashqla_kernels.patching import mlp as mlp_patch
from flashqla_kernels.patching import patched_gdn_layers, registry, unpatch_gdn_layers
from tests.factories import HYBRID_FAMILIES, tiny_model

@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    unpatch_gdn_layers()


def _layers(model):
    inner = model.model
    return getattr(inner, "language_model", inner).layers


def _decoder_outputs(model, ids, **kw):
    """Every decoder layer's output for one forward, and the logits."""
    outs, handles = [], [layer.register_forward_hook(lambda m, a, o: outs.append(o)) for layer in _layers(model)]
    try:
        with torch.no_grad():
            logits = model(ids, **kw).logits
    finally:
        for h in handles:
            h.remove()
    return outs, logits


def _spread_norms(model):
    """Non-zero norm weights, so a post-attention norm applied to the wrong tensor cannot pass unnoticed."""
    with torch.no_grad():
        for layer in _layers(model):
            layer.post_attention_layernorm.weight.normal_(0, 0.3)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_decoder_patch_makes_transformers_calls_bit_for_bit(family):
    model = tiny_model(family)
    _spread_norms(model)
    ids = torch.randint(0, 256, (2, 13))
    cls = type(_layers(model)[0])
    with patched_gdn_layers(backend="torch", decoder=False) as targets:
        assert not any("DecoderLayer" in t for t in targets)
        want, want_logits = _decoder_outputs(model, ids, use_cache=False)
    with patched_gdn_layers(backend="torch") as targets:
        assert f"{cls.__module__}.{cls.__name__}.forward" in targets
        assert registry.backend_of(cls.forward, "absent") == "torch"
        got, got_logits = _decoder_outputs(model, ids, use_cache=False)
    assert len(got) == len(want) == len(_layers(model))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"decoder layer {i} differs"
    assert torch.equal(got_logits, want_logits)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_patched_decoder_generation_with_cache_equals_unpatched(family):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (2, 9))
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        with patched_gdn_layers(backend="torch"):
            got = model.generate(ids, **kw)
    assert torch.equal(got, want)


def _fuse_everywhere(monkeypatch, calls, norm_checks=False):
    """Let both fusions run on CPU (torch's operations stand in for the kernels) and count them; with
    ``norm_checks`` the mid-layer fusion keeps every check but the device's."""
    if norm_checks:
        check = decoder_patch.add_norm_reason
        monkeypatch.setattr(decoder_patch, "add_norm_reason", lambda norm, residual, h: None if check(
            norm, residual, h) == ops.glue_kernel_reason(residual, h) else check(norm, residual, h))
    else:
        monkeypatch.setattr(decoder_patch, "add_norm_reason", lambda norm, residual, h: None)
    monkeypatch.setattr(decoder_patch, "down_residual_reason", lambda mlp, h, s: None)
    add_rms_norm, activation = ops.add_rms_norm, mlp_patch.activation

    def counted_add_rms_norm(*a, **k):
        calls.append("add_rms_norm")
        return add_rms_norm(*a, **k)

    def counted_activation(*a, **k):
        calls.append("down_residual")
        return activation(*a, **k)

    monkeypatch.setattr(ops, "add_rms_norm", counted_add_rms_norm)
    monkeypatch.setattr(mlp_patch, "activation", counted_activation)


def test_fused_residual_adds_equal_transformers_adds_in_fp32(monkeypatch):
    model = tiny_model("qwen3_5")
    _spread_norms(model)
    ids = torch.randint(0, 256, (2, 11))
    want, want_logits = _decoder_outputs(model, ids, use_cache=False)
    calls: list[str] = []
    _fuse_everywhere(monkeypatch, calls)
    with patched_gdn_layers(backend=None):
        got, got_logits = _decoder_outputs(model, ids, use_cache=False)
    n = len(_layers(model))
    assert calls.count("add_rms_norm") == n and calls.count("down_residual") == n, calls
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5, msg=lambda m: f"decoder layer {i}: {m}")
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def test_down_residual_fusion_is_skipped_for_moe_blocks(monkeypatch):
    model = tiny_model("qwen3_5_moe")
    ids = torch.randint(0, 256, (1, 7))
    want, _ = _decoder_outputs(model, ids, use_cache=False)
    monkeypatch.setattr(decoder_patch, "add_norm_reason", lambda norm, residual, h: None)
    with patched_gdn_layers(backend=None):
        got, _ = _decoder_outputs(model, ids, use_cache=False)  # the block's (out, router logits) tuple unpacked
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
    h = torch.randn(1, 7, 64)
    assert "not a dense gate/up/down MLP" in decoder_patch.down_residual_reason(_layers(model)[0].mlp, h, h.clone())


def test_hooks_on_the_fused_parts_keep_them_module_calls():
    model = tiny_model("qwen3_5")
    layer = _layers(model)[0]
    h = torch.randn(1, 5, 64)
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    # CPU: only the device stands in the way
    assert decoder_patch.add_norm_reason(norm, h, h) == ops.glue_kernel_reason(h, h)
    handle = norm.register_forward_pre_hook(lambda m, a: None)
    assert "post_attention_layernorm has hooks" in decoder_patch.add_norm_reason(norm, h, h)
    handle.remove()
    for module, expected in ((mlp, "the MLP has hooks"), (mlp.down_proj, "down_proj has hooks")):
        handle = module.register_forward_hook(lambda m, a, o: None)
        assert expected in decoder_patch.down_residual_reason(mlp, h, h.clone())
        handle.remove()
    mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(64))
    assert "down_proj has a bias" in decoder_patch.down_residual_reason(mlp, h, h.clone())


def test_down_residual_fusion_is_skipped_for_an_mlp_input_in_autocasts_dtype(monkeypatch):
    """Under autocast with fp32 weights the fused norm hands the MLP bf16 rows beside the fp32 sum: the MLP's bf16
    output cannot accumulate into the fp32 sum in place, so the end-of-layer add stays an add."""
    from flashqla_kernels import dispatch

    monkeypatch.setattr(dispatch, "hopper_reason", lambda *tensors: None)
    mlp = _layers(tiny_model("qwen3_5"))[0].mlp
    s = torch.randn(1, 5, 64)
    with torch.no_grad():  # as the held-out evaluations run
        assert decoder_patch.down_residual_reason(mlp, s.bfloat16(), s) == (
            "down_proj weight torch.float32, the MLP input torch.bfloat16 and the sum (1, 5, 64) torch.float32 do "
            "not fit an in-place GEMM")
        # a bf16 model's: one dtype throughout, fused
        mlp = mlp.to(torch.bfloat16)
        assert decoder_patch.down_residual_reason(mlp, s.bfloat16(), s.bfloat16()) is None


def test_a_hooked_post_attention_norm_sees_the_sum_and_keeps_it(monkeypatch):
    """A hook on the norm keeps the sum it was given (no clone): the end-of-layer add must not write into it."""
    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (1, 6))
    seen = {}

    def run():
        handles = [layer.post_attention_layernorm.register_forward_hook(
            lambda m, a, o, i=i: seen.update({i: (a[0], o)})) for i, layer in enumerate(_layers(model))]
        try:
            return _decoder_outputs(model, ids, use_cache=False)[0]
        finally:
            for handle in handles:
                handle.remove()

    want = run()
    want_seen = dict(seen)
    calls: list[str] = []
    _fuse_everywhere(monkeypatch, calls, norm_checks=True)
    with patched_gdn_layers(backend=None):
        got = run()
    assert not calls, "a fusion ran although a hook observes the post-attention norm"
    with patched_gdn_layers(backend=None):
        _decoder_outputs(model, ids, use_cache=False)
    assert calls.count("add_rms_norm") == calls.count("down_residual") == len(_layers(model))  # unhooked: fused
    for i in want_seen:
        for g, w in zip(seen[i], want_seen[i]):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got[i], want[i], atol=2e-5, rtol=1e-5)
        assert not torch.equal(seen[i][0], got[i])


class _Recorder(torch.nn.Module):
    """A stand-in mixer that records the keyword arguments it was called with."""

    def __init__(self, returns_tuple: bool):
        super().__init__()
        self.returns_tuple, self.kwargs = returns_tuple, {}

    def forward(self, hidden_states, **kwargs):
        self.kwargs = kwargs
        out = hidden_states * 2
        return (out, None) if self.returns_tuple else out


class _FakeDecoder(torch.nn.Module):
    gradient_checkpointing = False  # as every transformers decoder layer (GradientCheckpointingLayer) has it

    def __init__(self, block_type):
        super().__init__()
        self.block_type = block_type
        self.input_layernorm = torch.nn.Identity()
        self.post_attention_layernorm = torch.nn.Identity()
        self.mlp = torch.nn.Identity()
        if block_type == "linear_attention":
            self.linear_attn = _Recorder(False)
        else:
            self.self_attn = _Recorder(True)


def _old_forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                 past_key_values=None, **kwargs):  # the 5.17-5.23 signature
    return "transformers' forward"


def _new_forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, cache=None,
                 **kwargs):  # the 5.24+ signature
    return "transformers' forward"


@pytest.mark.parametrize("original,gdn_kw,attn_kw", [(_old_forward, "cache_params", "past_key_values"),
                                                      (_new_forward, "cache", "cache")])
def test_mixers_get_the_cache_as_this_transformers_version_spells_it(original, gdn_kw, attn_kw):
    forward = decoder_patch.make_forward(original, "torch", True, True)
    assert forward.__wrapped__ is original
    cache, pe = object(), (torch.ones(1), torch.zeros(1))
    x = torch.ones(1, 2, 4)
    for caller_kw in ("cache", "past_key_values"):  # the model passes either spelling; both reach the mixer
        gdn = _FakeDecoder("linear_attention")
        out = forward(gdn, x, pe, None, None, **{caller_kw: cache}, use_cache=True)
        assert gdn.linear_attn.kwargs[gdn_kw] is cache and gdn.linear_attn.kwargs["use_cache"] is True
        assert torch.equal(out, x + 2 * x + (x + 2 * x))  # (residual + mixer) + mlp(identity of it)
        attn = _FakeDecoder("full_attention")
        forward(attn, x, pe, None, torch.arange(2), **{caller_kw: cache})
        assert attn.self_attn.kwargs[attn_kw] is cache
        assert attn.self_attn.kwargs["position_embeddings"] is pe
    odd = _FakeDecoder("linear_attention")
    odd.block_type = "sliding_attention"
    assert forward(odd, x, pe) == "transformers' forward"
    assert "neither of" in decoder_patch.decoder_fallback_reason(odd)


def test_transformers_decoder_signature_is_read_through_its_deprecation_wrapper():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    params = inspect.signature(mod.Qwen3_5DecoderLayer.__dict__["forward"]).parameters
    assert "cache" in params or "past_key_values" in params


def test_cached_prefill_through_the_patched_decoder_keeps_states_equal():
    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (1, 12))
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        want = model(ids, **{kw: caches[0]}, use_cache=True).logits
        with patched_gdn_layers(backend="torch"):
            got = model(ids, **{kw: caches[1]}, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for idx, layer in enumerate(_layers(model)):
        if hasattr(layer, "linear_attn"):
            theirs, ours = gdn_layer_mod.cached_states(caches[0], idx), gdn_layer_mod.cached_states(caches[1], idx)
            assert ours[0] is not None and ours[1] is not None, f"layer {idx}: no state written"
            torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=1e-5)
