"""intervene edits exactly what it is asked to, on prefill and decode steps, and leaves no hook behind."""
from __future__ import annotations

import pytest
import torch

from hooks import capture, intervene
from tests.factories import D_MODEL, FAMILIES, HYBRID_FAMILIES, tiny_model


def _ids(B=1, T=7, seed=3):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _generate(model, ids, n=6):
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_edit_lands_exactly_at_the_chosen_positions(family):
    model = tiny_model(family)
    ids = _ids(B=2)
    delta = torch.randn(D_MODEL)

    def add_at_2_and_4(act, ctx):
        mask = torch.isin(ctx.positions, torch.tensor([2, 4]))
        return act + mask[None, :, None] * delta

    with torch.no_grad():
        with capture(model, ["resid_post.1"]) as base:
            model(input_ids=ids, use_cache=False)
        with intervene(model, {"resid_post.1": add_at_2_and_4}) as handle, \
                capture(model, ["resid_post.1", "resid_pre.2"]) as edited:
            model(input_ids=ids, use_cache=False)
    diff = edited["resid_post.1"] - base["resid_post.1"]
    expected = torch.zeros_like(diff)
    expected[:, [2, 4]] = delta
    torch.testing.assert_close(diff, expected, atol=1e-6, rtol=0)
    # The next block reads the edited residual.
    assert torch.equal(edited["resid_pre.2"], edited["resid_post.1"])
    assert handle.fired == {"resid_post.1": 1}
    assert _hook_count(model) == 0


@pytest.mark.parametrize("point", ["attn_out.1", "attn_out.0", "mlp_out.2", "resid_pre.3"])
def test_every_writable_point_changes_the_logits(point):
    # attn_out.1 is full attention (a tuple output), attn_out.0 Gated DeltaNet (a Tensor), resid_pre a pre-hook.
    model = tiny_model("qwen3_5")
    ids = _ids()
    with torch.no_grad():
        base = model(input_ids=ids, use_cache=False).logits
        with intervene(model, {point: lambda act, ctx: act * 0.0}):
            zeroed = model(input_ids=ids, use_cache=False).logits
        with intervene(model, {point: lambda act, ctx: None}):
            same = model(input_ids=ids, use_cache=False).logits
    assert not torch.allclose(base, zeroed)
    assert torch.equal(base, same)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_a_noop_intervention_equals_the_unhooked_model(family):
    model = tiny_model(family)
    ids = _ids()
    with torch.no_grad():
        plain = _generate(model, ids)
        with intervene(model, {f"resid_post.{n}": (lambda act, ctx: act) for n in range(4)}) as handle:
            hooked = _generate(model, ids)
    assert torch.equal(plain, hooked)
    assert handle.fired["resid_post.0"] == 6


def test_context_reports_prefill_then_decode_positions():
    model = tiny_model("qwen3_5")
    seen = []
    with torch.no_grad(), intervene(model, {"resid_post.0": lambda act, ctx: seen.append(
            (ctx.step, ctx.is_prefill, ctx.past_length, ctx.positions.tolist()))}):
        _generate(model, _ids(T=5), n=3)
    assert seen == [(0, True, 0, [0, 1, 2, 3, 4]), (1, False, 5, [5]), (2, False, 6, [6])]


@pytest.mark.parametrize("family", HYBRID_FAMILIES + ("qwen3",))
def test_decode_steps_are_steered_separately_from_the_prefill(family):
    # Steering only generated positions leaves the prefill (and so the first new token) untouched, but must
    # still change what comes after: the edit reaches decode steps, not just the GDN state of the prefill.
    model = tiny_model(family)
    ids = _ids(T=6)
    P = ids.shape[1]
    vec = 30.0 * torch.randn(D_MODEL, generator=torch.Generator().manual_seed(0))

    def generated_only(act, ctx):
        return act + (ctx.positions >= P)[None, :, None] * vec

    with torch.no_grad():
        plain = _generate(model, ids, n=8)
        with intervene(model, {"resid_post.1": generated_only}) as handle:
            steered = _generate(model, ids, n=8)
    assert handle.fired["resid_post.1"] == 8
    assert steered[0, P] == plain[0, P]
    assert not torch.equal(steered[:, P + 1:], plain[:, P + 1:])
    # And each steered decode step equals a cache-less forward with the same edit at those positions.
    with torch.no_grad(), intervene(model, {"resid_post.1": generated_only}):
        logits = model(input_ids=steered[:, :-1], use_cache=False).logits
    assert torch.equal(logits[0, P - 1:].argmax(-1), steered[0, P:])


def test_bad_return_shape_and_capture_only_points_are_refused():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match=r"resid_post.0 returned \(2, 7\); expected a Tensor of shape \(2, 7, 64\)"):
        with torch.no_grad(), intervene(model, {"resid_post.0": lambda act, ctx: act[..., 0]}):
            model(input_ids=_ids(B=2), use_cache=False)
    with pytest.raises(ValueError, match="capture-only"):
        with intervene(model, {"blocks.1.hook_resid_mid": lambda act, ctx: act}):
            pass
    assert _hook_count(model) == 0


def test_hooks_are_removed_after_an_exception_inside_the_block():
    model = tiny_model("qwen3_5_vl")
    with pytest.raises(KeyError):
        with torch.no_grad(), intervene(model, {"resid_post.2": lambda act, ctx: act,
                                                "attn_out.1": [lambda a, c: a, lambda a, c: a]}) as handle:
            assert _hook_count(model) == 4
            model(input_ids=_ids(), use_cache=False)
            assert handle.fired == {"resid_post.2": 1, "attn_out.1": 1}
            {}["missing"]
    assert _hook_count(model) == 0
