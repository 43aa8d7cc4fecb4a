"""One grammar for hook names: canonical names, TransformerLens / sae-lens / HF aliases, and helpful errors."""
from __future__ import annotations

import pytest

from hooks import HookPoint, parse_hook_name, resid_post


@pytest.mark.parametrize("name, kind, layer", [
    ("resid_post.3", "resid_post", 3),
    ("blocks.3.hook_resid_post", "resid_post", 3),
    ("blocks.3.hook_out", "resid_post", 3),
    ("model.layers.3", "resid_post", 3),
    ("model.model.layers.3", "resid_post", 3),
    ("model.language_model.layers.3", "resid_post", 3),
    ("layers.3", "resid_post", 3),
    ("blocks.0.hook_resid_pre", "resid_pre", 0),
    ("blocks.0.hook_in", "resid_pre", 0),
    ("blocks.2.hook_resid_mid", "resid_mid", 2),
    ("blocks.1.hook_attn_out", "attn_out", 1),
    ("blocks.1.linear_attn.hook_out", "attn_out", 1),
    ("model.layers.1.self_attn", "attn_out", 1),
    ("model.layers.1.linear_attn", "attn_out", 1),
    ("blocks.1.hook_mlp_out", "mlp_out", 1),
    ("model.layers.1.mlp", "mlp_out", 1),
    ("mlp_out.0", "mlp_out", 0),
    ("blocks.1.mlp.hook_post", "mlp_post", 1),
    ("blocks.3.attn.hook_q", "attn_q", 3),
    ("blocks.3.attn.hook_k", "attn_k", 3),
    ("blocks.3.attn.hook_v", "attn_v", 3),
    ("blocks.3.attn.hook_z", "attn_z", 3),
    ("blocks.3.attn.hook_pattern", "attn_pattern", 3),
    ("blocks.2.linear_attn.hook_beta", "gdn_beta", 2),
    ("blocks.2.linear_attn.hook_decay", "gdn_decay", 2),
    ("blocks.2.linear_attn.hook_core", "gdn_core", 2),
])
def test_aliases_parse_to_the_canonical_point(name, kind, layer):
    assert parse_hook_name(name, n_layers=4) == HookPoint(kind, layer)
    assert parse_hook_name(name).name == f"{kind}.{layer}"


def test_negative_layer_counts_from_the_end_when_depth_is_known():
    assert parse_hook_name("resid_post.-1", n_layers=4).name == "resid_post.3"
    with pytest.raises(ValueError, match="n_layers"):
        parse_hook_name("resid_post.-1")


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        parse_hook_name("resid_posst.3", n_layers=4)
    msg = str(err.value)
    assert "resid_posst.3" in msg
    for kind in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
        assert f"{kind}.0 … {kind}.3" in msg
    assert "blocks.{n}.hook_resid_post" in msg and "model.layers.{n}" in msg


def test_out_of_range_layer_names_the_depth():
    with pytest.raises(ValueError, match="layer 4 out of range for a model with 4 blocks"):
        parse_hook_name("resid_post.4", n_layers=4)


def test_resid_post_builds_the_canonical_name_of_the_sae_site():
    assert resid_post(12) == "resid_post.12" == HookPoint("resid_post", 12).name
    assert parse_hook_name(resid_post(-1), n_layers=4) == HookPoint("resid_post", 3)


@pytest.mark.parametrize("name", ["embed", "hook_embed", "model.embed_tokens", "model.language_model.embed_tokens"])
def test_the_embedding_is_one_model_wide_point(name):
    point = parse_hook_name(name, n_layers=4)
    assert point == HookPoint("embed", 0) and point.name == "embed" and point.writable
