"""The gated attention patch (``flashqla_kernels.patching.attention``): bit for bit transformers' forward off Hopper,
the head-major gate on an unpadded SDPA prefill, and the calls it hands to transformers (a KV cache, hooked q/k
norms)."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.decoder import ops
from flashqla_kernels.patching import attention as attention_patch
from flashqla_kernels.patching import patched_gdn_layers, unpatch_gdn_layers
from tests.factories import HYBRID_FAMILIES, tiny_model
from tests.flashqla_kernels.test_decoder_gdn_layer import attn_call

@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    unpatch_gdn_layers()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_patch_is_transformers_bit_for_bit_off_hopper(family, dtype, monkeypatch):
    """The gated attention forward on the fused wiring (q/k norm + RoPE in one op, the gate read in place) with the
    torch formulation equals transformers' forward bit for bit, called as the decoder layer calls it; the whole
    model's logits too."""
    model = tiny_model(family, dtype=dtype)
    ids = torch.randint(0, 256, (2, 13))
    attn, (args, kwargs) = attn_call(model, ids)
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
    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (2, 11))
    attn, (args, kwargs) = attn_call(model, ids)
    q = torch.zeros(2, attn.config.num_attention_heads, 11, attn.head_dim)
    assert attention_patch.plain_causal_sdpa(attn, q, None, kwargs)
    assert not attention_patch.plain_causal_sdpa(attn, q, torch.ones(2, 1, 11, 11, dtype=torch.bool), kwargs)
    assert not attention_patch.plain_causal_sdpa(attn, q[:, :, :1], None, kwargs)
    assert not attention_patch.plain_causal_sdpa(attn, q, None, {**kwargs, "output_attentions": True})
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
    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (1, 9))
    attn, (args, kwargs) = attn_call(model, ids)
    fused = []
    real = ops.qk_norm_rope
    monkeypatch.setattr(ops, "qk_norm_rope", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    pe = kwargs.get("position_embeddings")
    assert attention_patch.attention_fallback_reason(attn, None, pe, None) is None
    assert "KV cache" in attention_patch.attention_fallback_reason(attn, None, pe, object())
    assert "position embeddings" in attention_patch.attention_fallback_reason(attn, None, None, None)
    with torch.no_grad(), patched_gdn_layers(backend="torch"):
        want = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert not fused  # generation runs with a cache: every attention call took transformers' forward
        handle = attn.q_norm.register_forward_hook(lambda m, i, o: None)
        try:
            assert "hooks" in attention_patch.attention_fallback_reason(attn, None, pe, None)
            attn(*args, **kwargs)
            assert not fused
        finally:
            handle.remove()
        attn(*args, **kwargs)
        assert fused
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), want)
