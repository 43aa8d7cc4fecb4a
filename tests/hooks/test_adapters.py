"""Adapters are found from the loaded model's config and module tree, for every Qwen family, and nothing else."""
from __future__ import annotations

import pytest
import torch

from hooks import HYBRID_FAMILIES, get_adapter, supported_families
from tests.factories import D_MODEL, FAMILIES, N_LAYERS, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_exposes_the_decoder_stack_of_every_family(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    assert adapter.family == family
    assert adapter.n_layers == N_LAYERS == len(adapter.layers)
    assert adapter.d_model == D_MODEL
    assert adapter.unembed is model.lm_head
    assert adapter.embed.weight.shape == (model.config.get_text_config().vocab_size, D_MODEL)
    expected = (["linear_attention", "full_attention"] * 2 if family in HYBRID_FAMILIES else ["full_attention"] * 4)
    assert adapter.layer_types == expected
    for n, kind in enumerate(adapter.layer_types):
        assert hasattr(adapter.layers[n], "linear_attn" if kind == "linear_attention" else "self_attn")
        assert adapter.mixer(n) is getattr(adapter.layers[n], "linear_attn" if kind == "linear_attention" else "self_attn")


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_is_declared_exactly_where_the_model_has_gated_deltanet_layers(family):
    adapter = get_adapter(tiny_model(family))
    assert adapter.hybrid == ("linear_attention" in adapter.layer_types) == (family in HYBRID_FAMILIES)
    assert set(HYBRID_FAMILIES) == {"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"}


def test_vl_wrapper_finds_the_language_model_layers():
    model = tiny_model("qwen3_5_vl")
    assert get_adapter(model).layers is model.model.language_model.layers


def test_bare_text_model_has_no_unembedding():
    adapter = get_adapter(tiny_model("qwen3_5").model)
    assert adapter.n_layers == N_LAYERS and adapter.unembed is None


def test_family_comes_from_config_not_class_name():
    # A subclass with an unrelated name is still recognised from its config and module tree.
    import transformers as tf
    from tests.factories import tiny_config

    Renamed = type("MyFineTune", (tf.Qwen3_5ForCausalLM,), {})
    assert get_adapter(Renamed(tiny_config("qwen3_5"))).family == "qwen3_5"


@pytest.mark.parametrize("make", ["gpt2", "llama"])
def test_non_qwen_model_error_names_supported_families(make):
    import transformers as tf

    torch.manual_seed(0)
    if make == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                                   num_attention_heads=2, vocab_size=32))
    with pytest.raises(TypeError) as err:
        get_adapter(model)
    msg = str(err.value)
    assert make in msg and type(model).__name__ in msg
    for label in supported_families():
        assert label in msg


@pytest.mark.parametrize("family", FAMILIES)
def test_unpadded_masks_give_the_text_model_exactly_its_own_masking(family):
    """``unpadded_masks``: None per layer type where the text model takes a mapping (the same forward, bit for bit,
    with and without right padding past the real tokens), None where it does not (Qwen3-MoE)."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    masks = adapter.unpadded_masks()
    if family == "qwen3_moe":
        assert masks is None
        return
    assert masks == dict.fromkeys(set(adapter.layer_types))
    ids = torch.randint(0, 100, (2, 11))
    with torch.no_grad():
        ref = adapter.text_model(input_ids=ids, use_cache=False).last_hidden_state
        got = adapter.text_model(input_ids=ids, attention_mask=masks, use_cache=False).last_hidden_state
        # right padding after the real tokens leaves them unchanged: causal attention, causal recurrence
        padded = torch.cat([ids, torch.zeros(2, 5, dtype=ids.dtype)], dim=1)
        tail = adapter.text_model(input_ids=padded, attention_mask=masks, use_cache=False).last_hidden_state
    assert torch.equal(got, ref)
    torch.testing.assert_close(tail[:, :11], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_unpadded_masks_are_none_where_the_attention_needs_a_real_mask(impl):
    """eager attention takes transformers' additive causal mask even for an unpadded batch: no mapping of Nones for it
    (its tokens would see the future), and the forward with whatever ``unpadded_masks`` gives is the model's own."""
    model = tiny_model("qwen3_5")
    model.config._attn_implementation = impl
    adapter = get_adapter(model)
    masks = adapter.unpadded_masks()
    assert (masks is None) == (impl == "eager")
    ids = torch.randint(0, 100, (2, 11))
    with torch.no_grad():
        ref = adapter.text_model(input_ids=ids, use_cache=False).last_hidden_state
        got = adapter.text_model(input_ids=ids, attention_mask=masks, use_cache=False).last_hidden_state
    assert torch.equal(got, ref)
