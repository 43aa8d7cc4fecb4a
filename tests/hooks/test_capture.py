"""capture reads each point from its own module: hidden_states[n+1] for every block but the last, pre-norm last."""
from __future__ import annotations

import pytest
import torch

from hooks import capture, capture_forward, get_adapter
from tests.factories import D_MODEL, FAMILIES, N_LAYERS, tiny_model

ALL_POINTS = [f"{k}.{n}" for n in range(N_LAYERS) for k in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")]


def _ids(B=2, T=9, seed=1):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_resid_post_matches_hidden_states_and_last_block_is_pre_norm(family):
    model = tiny_model(family)
    ids = _ids()
    with torch.no_grad(), capture(model, ALL_POINTS) as cap:
        out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    hs = out.hidden_states
    last = N_LAYERS - 1
    for n in range(N_LAYERS):
        assert torch.equal(cap[f"resid_pre.{n}"], hs[n])
        if n < last:
            assert torch.equal(cap[f"resid_post.{n}"], hs[n + 1])
        # The block is residual: pre + mixer + mlp, with the mid-block residual in between.
        torch.testing.assert_close(cap[f"resid_mid.{n}"], cap[f"resid_pre.{n}"] + cap[f"attn_out.{n}"])
        torch.testing.assert_close(cap[f"resid_post.{n}"], cap[f"resid_mid.{n}"] + cap[f"mlp_out.{n}"])
    # The last entry of hidden_states is final_norm(block output); capture gives the raw block output.
    final_norm = get_adapter(model).final_norm
    assert not torch.allclose(cap[f"resid_post.{last}"], hs[-1])
    torch.testing.assert_close(final_norm(cap[f"resid_post.{last}"]), hs[-1])
    assert cap["blocks.3.hook_resid_post"] is cap[f"resid_post.{last}"]


def test_capture_never_requests_hidden_states():
    # transformers installs its own recording hooks the first time output_hidden_states is asked for;
    # a capture-only run must leave the model without any hook afterwards.
    model = tiny_model("qwen3_5")
    with torch.no_grad(), capture(model, ["resid_post.1", "attn_out.2"]) as cap:
        model(input_ids=_ids(), use_cache=False)
    assert cap["resid_post.1"].shape == (2, 9, D_MODEL)
    assert _hook_count(model) == 0


def test_hooks_are_removed_even_when_the_block_raises():
    model = tiny_model("qwen3_next")
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model, ALL_POINTS):
            assert _hook_count(model) == len(ALL_POINTS) + 1
            raise RuntimeError("boom")
    assert _hook_count(model) == 0


def test_positions_dtype_and_device_selection():
    model = tiny_model("qwen3_5")
    ids = _ids(T=10)
    with torch.no_grad(), capture(model, ["resid_post.2"]) as full:
        model(input_ids=ids, use_cache=False)
    with torch.no_grad(), capture(model, ["resid_post.2"], positions="0,2,5-7", dtype=torch.float64,
                                  device="cpu") as some:
        model(input_ids=ids, use_cache=False)
    picked = some["resid_post.2"]
    assert picked.dtype == torch.float64
    assert torch.equal(picked, full["resid_post.2"][:, [0, 2, 5, 6, 7]].double())
    assert some.positions("resid_post.2").tolist() == [0, 2, 5, 6, 7]
    with torch.no_grad(), capture(model, ["resid_post.2"], positions=-1) as last:
        model(input_ids=ids, use_cache=False)
    assert torch.equal(last["resid_post.2"], full["resid_post.2"][:, -1:])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_capture_during_generate_concatenates_prefill_and_decode_steps(family):
    model = tiny_model(family)
    ids = _ids(B=1, T=6)
    with torch.no_grad(), capture(model, ["resid_post.1"]) as cap:
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert [c.shape[1] for c in cap.calls("resid_post.1")] == [6, 1, 1, 1]
    assert cap.positions("resid_post.1").tolist() == list(range(9))
    # The cached decode steps see the same residual a cache-less forward over the whole sequence sees.
    with torch.no_grad(), capture(model, ["resid_post.1"]) as ref:
        model(input_ids=out[:, :-1], use_cache=False)
    torch.testing.assert_close(cap["resid_post.1"], ref["resid_post.1"], atol=1e-5, rtol=1e-4)


def test_two_separate_passes_are_not_silently_concatenated():
    model = tiny_model("qwen3")
    with torch.no_grad(), capture(model, ["resid_post.0"]) as cap:
        model(input_ids=_ids(), use_cache=False)
        model(input_ids=_ids(seed=2), use_cache=False)
    assert len(cap.calls("resid_post.0")) == 2
    with pytest.raises(ValueError, match="separate forward passes"):
        cap["resid_post.0"]


def test_capture_forward_stops_after_the_deepest_point_with_the_same_values():
    model = tiny_model("qwen3_5")
    ids = _ids()
    ran = []
    handle = model.model.layers[3].register_forward_hook(lambda *a: ran.append(3))
    try:
        cap = capture_forward(model, ["resid_post.1", "blocks.2.hook_resid_post"], input_ids=ids)
        assert ran == []
        with torch.no_grad(), capture(model, ["resid_post.1", "resid_post.2"]) as ref:
            model(input_ids=ids, use_cache=False)
        assert ran == [3]
    finally:
        handle.remove()
    assert torch.equal(cap["resid_post.1"], ref["resid_post.1"])
    assert torch.equal(cap["resid_post.2"], ref["resid_post.2"])
    assert _hook_count(model) == 0


def test_capture_forward_accepts_use_cache_among_the_forward_kwargs():
    # Callers forward their usual model kwargs; capture_forward forces use_cache=False and must not raise
    # "got multiple values for keyword argument 'use_cache'".
    model = tiny_model("qwen3")
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture(model, ["resid_post.1"]) as ref:
        model(input_ids=ids, use_cache=False)
    for use_cache in (False, True):
        cap = capture_forward(model, ["resid_post.1"], input_ids=ids, use_cache=use_cache)
        assert torch.equal(cap["resid_post.1"], ref["resid_post.1"])
    assert not model.model.layers[1]._forward_hooks and not model.model._forward_pre_hooks


def test_capture_accessors_name_the_recorded_points_for_a_missing_one():
    model = tiny_model("qwen3")
    with capture(model, ["resid_post.1"]) as cap:
        pass  # the model never ran
    assert cap.calls("resid_post.1") == []
    # positions() must not die in torch.cat with "expected a non-empty list of Tensors".
    with pytest.raises(KeyError, match=r"nothing captured at resid_post.1"):
        cap.positions("resid_post.1")
    for accessor in (cap.calls, cap.positions, cap.__getitem__):
        with pytest.raises(KeyError, match=r"nothing captured at resid_post.2.*\['resid_post.1'\]"):
            accessor("blocks.2.hook_resid_post")


def _eager(family: str):
    model = tiny_model(family)
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_embedding_mlp_and_attention_internals_reproduce_the_module_outputs(family):
    model = _eager(family)
    adapter = get_adapter(model)
    n = adapter.layer_types.index("full_attention")
    points = ["hook_embed", f"resid_pre.{n}", f"attn_out.{n}", f"mlp_out.{n}", f"blocks.{n}.mlp.hook_post",
              f"attn_q.{n}", f"attn_k.{n}", f"attn_v.{n}", f"attn_z.{n}", f"blocks.{n}.attn.hook_pattern"]
    ids = _ids()
    with torch.no_grad(), capture(model, points) as cap:
        model(input_ids=ids, use_cache=False)
    block, attn = adapter.layers[n], adapter.mixer(n)
    with torch.no_grad():
        assert torch.equal(cap["embed"], adapter.embed(ids))
        x = block.input_layernorm(cap[f"resid_pre.{n}"])
        H, D = adapter.config.num_attention_heads, attn.head_dim
        q = attn.q_proj(x).view(2, 9, H, -1)[..., :D]  # Qwen3.5: the query half of query + gate
        torch.testing.assert_close(cap[f"attn_q.{n}"], q)
        torch.testing.assert_close(cap[f"attn_k.{n}"], attn.k_proj(x).view(2, 9, -1, D))
        torch.testing.assert_close(cap[f"attn_v.{n}"], attn.v_proj(x).view(2, 9, -1, D))
        torch.testing.assert_close(attn.o_proj(cap[f"attn_z.{n}"].flatten(-2)), cap[f"attn_out.{n}"])
        torch.testing.assert_close(adapter.mlp(n).down_proj(cap[f"mlp_post.{n}"]), cap[f"mlp_out.{n}"])
    pattern = cap[f"attn_pattern.{n}"]  # [B, T, H, T_k]
    assert pattern.shape == (2, 9, H, 9)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(2, 9, H))
    # Causal: query t gives no weight to keys after it.
    seen = torch.ones(9, 9, dtype=torch.bool).tril()  # [T, T_k]
    by_head = pattern.transpose(1, 2)  # [B, H, T, T_k]
    assert bool((by_head[..., ~seen] == 0).all()) and bool((by_head[..., seen] > 0).all())


def test_gated_deltanet_internals_are_the_values_the_layer_uses():
    model = tiny_model("qwen3_5")
    adapter = get_adapter(model)
    n = adapter.layer_types.index("linear_attention")
    with torch.no_grad(), capture(model, [f"resid_pre.{n}", f"attn_out.{n}", f"gdn_beta.{n}", f"gdn_decay.{n}",
                                          f"gdn_core.{n}"]) as cap:
        model(input_ids=_ids(), use_cache=False)
    gdn = adapter.mixer(n)
    with torch.no_grad():
        x = adapter.layers[n].input_layernorm(cap[f"resid_pre.{n}"])
        torch.testing.assert_close(cap[f"gdn_beta.{n}"], gdn.in_proj_b(x).sigmoid())
        decay = -gdn.A_log.float().exp() * torch.nn.functional.softplus(gdn.in_proj_a(x).float() + gdn.dt_bias)
        torch.testing.assert_close(cap[f"gdn_decay.{n}"], decay)
        assert bool((cap[f"gdn_decay.{n}"] < 0).all())
        core = cap[f"gdn_core.{n}"]  # [B, T, Hv, Dv]
        assert core.shape == (2, 9, gdn.num_v_heads, gdn.head_v_dim)
        gate = gdn.in_proj_z(x).reshape(-1, gdn.head_v_dim)
        out = gdn.out_proj(gdn.norm(core.reshape(-1, gdn.head_v_dim), gate).reshape(2, 9, -1))
        torch.testing.assert_close(out, cap[f"attn_out.{n}"])


def test_internal_points_say_where_they_exist_and_what_they_need():
    model = tiny_model("qwen3_5")
    adapter = get_adapter(model)
    gdn_layer, attn_layer = adapter.layer_types.index("linear_attention"), adapter.layer_types.index("full_attention")
    with pytest.raises(ValueError, match=rf"attn_q\.{gdn_layer}: block {gdn_layer} is a linear_attention layer.*"
                                         rf"full_attention layers \[1, 3\]"):
        with capture(model, [f"attn_q.{gdn_layer}"]):
            pass
    with pytest.raises(ValueError, match=r"needs eager attention .*attn_implementation='eager'"):
        with capture(model, [f"attn_pattern.{attn_layer}"]):
            pass
    with pytest.raises(ValueError, match=r"gdn_beta\.1: block 1 is a full_attention layer"):
        with capture(model, [f"gdn_beta.{attn_layer}"]):
            pass
    with pytest.raises(ValueError, match=r"mlp_post\.1 needs a dense MLP"):
        with capture(tiny_model("qwen3_moe"), ["mlp_post.1"]):
            pass
    assert _hook_count(model) == 0


def test_embed_and_mlp_post_are_writable():
    from hooks import intervene

    model = tiny_model("qwen3")
    ids = _ids()
    with torch.no_grad():
        base = model(input_ids=ids, use_cache=False).logits
        with intervene(model, {"hook_embed": lambda act, ctx: act * 0, "mlp_post.0": lambda act, ctx: act}):
            zeroed = model(input_ids=ids, use_cache=False).logits
        with intervene(model, {"mlp_post.2": lambda act, ctx: act}):
            same = model(input_ids=ids, use_cache=False).logits
    assert not torch.allclose(base, zeroed) and torch.equal(base, same)
    with pytest.raises(ValueError, match=r"attn_z\.1 is capture-only"):
        with intervene(model, {"attn_z.1": lambda act, ctx: act}):
            pass
