"""Steering edits are exactly the ones asked for: at the hooked layer, at the chosen positions, on every step."""
from __future__ import annotations

import pytest
import torch

from hooks import Positions, capture
from qwen_scope.scope import Scope
from qwen_scope.steering import FeatureEdit, ablate, add, clamp, parse_steer_positions, steer, steering, sweep
from tests.factories import FAMILIES, HYBRID_FAMILIES, tiny_model, tiny_tokenizer
from tests.qwen_scope.scope_helpers import orthonormal_sae, tiny_scope

PROMPT = "The cat sat"


def _resid(scope, ids, points, edits=()):
    with torch.no_grad(), steering(scope, list(edits)), capture(scope.model, points) as cap:
        scope.model(input_ids=ids, use_cache=False)
    return {p: cap[p][0] for p in points}


@pytest.mark.parametrize("family", FAMILIES)
def test_additive_steering_adds_exactly_a_times_the_decoder_column_at_the_chosen_positions(family):
    scope = tiny_scope(family, layers=(1,))
    ids = scope.tokenize(PROMPT)
    a, i = 7.5, 17
    base = _resid(scope, ids, ["resid_post.1"])["resid_post.1"]
    steered = _resid(scope, ids, ["resid_post.1"], [add(1, i, a, positions="0,2,5-8")])["resid_post.1"]
    expected = torch.zeros_like(base)
    expected[[0, 2, 5, 6, 7, 8]] = a * scope.sae(1).W_dec[:, i]
    torch.testing.assert_close(steered - base, expected, atol=1e-5, rtol=0)
    assert torch.equal((steered - base)[[1, 3, 4, 9, 10]], torch.zeros(5, base.shape[-1]))


def test_unit_and_norm_scales():
    scope = tiny_scope(layers=(2,))
    ids = scope.tokenize(PROMPT)
    base = _resid(scope, ids, ["resid_post.2"])["resid_post.2"]
    d = scope.sae(2).W_dec[:, 3]
    unit = d / d.norm()
    got_unit = _resid(scope, ids, ["resid_post.2"], [add(2, 3, 2.0, scale="unit")])["resid_post.2"] - base
    torch.testing.assert_close(got_unit, (2.0 * unit).expand_as(base), atol=1e-5, rtol=0)
    got_norm = _resid(scope, ids, ["resid_post.2"], [add(2, 3, 0.5, scale="norm")])["resid_post.2"] - base
    torch.testing.assert_close(got_norm, 0.5 * base.norm(dim=-1, keepdim=True) * unit, atol=1e-5, rtol=1e-5)


def test_clamp_moves_the_code_to_the_value_keeping_the_error_term():
    scope = tiny_scope(layers=(1,))
    sae, ids = scope.sae(1), scope.tokenize(PROMPT)
    base = _resid(scope, ids, ["resid_post.1"])["resid_post.1"]
    z = sae.encode(base)
    i = int(z[3].argmax())  # a feature active at token 3
    steered = _resid(scope, ids, ["resid_post.1"], [clamp(1, i, 9.0)])["resid_post.1"]
    # decode(z') + error(h) with z'_i = 9: the residual moves by (9 - z_i) W_dec[:, i] at every token.
    expected = base - sae.decode(z) + sae.decode(torch.cat([z[:, :i], torch.full_like(z[:, :1], 9.0), z[:, i + 1:]], -1))
    torch.testing.assert_close(steered, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(steered - base, (9.0 - z[:, i : i + 1]) * sae.W_dec[:, i], atol=1e-5, rtol=0)


def test_clamp_reproduces_the_value_and_ablation_zeroes_it_on_an_exact_sae():
    sae = orthonormal_sae()
    scope = Scope(tiny_model("qwen3_5"), tiny_tokenizer(), {2: sae})
    ids = scope.tokenize(PROMPT)
    base = _resid(scope, ids, ["resid_post.2"])["resid_post.2"]
    z = sae.encode(base)
    i = int((z > 0).sum(0).argmax())
    active = z[:, i] > 0
    assert active.sum() >= 3
    clamped = _resid(scope, ids, ["resid_post.2"], [clamp(2, i, 4.25)])["resid_post.2"]
    torch.testing.assert_close(sae.encode(clamped)[active, i], torch.full((int(active.sum()),), 4.25), atol=1e-5,
                               rtol=0)
    ablated = _resid(scope, ids, ["resid_post.2"], [ablate(2, i)])["resid_post.2"]
    assert sae.encode(ablated)[:, i].abs().max() < 1e-5
    # Every other feature keeps its code.
    others = torch.arange(sae.d_sae) != i
    torch.testing.assert_close(sae.encode(ablated)[:, others], z[:, others], atol=1e-5, rtol=0)


def test_several_features_and_layers_at_once():
    scope = tiny_scope(layers=(1, 2))
    ids = scope.tokenize(PROMPT)
    layer1 = [add(1, 4, 3.0), add(1, 9, -2.0, positions="1-3")]
    only1 = _resid(scope, ids, ["resid_post.1", "resid_post.2"], layer1)
    both = _resid(scope, ids, ["resid_post.1", "resid_post.2"], layer1 + [add(2, 5, 6.0, positions=[0])])
    base = _resid(scope, ids, ["resid_post.1"])["resid_post.1"]
    W1, W2 = scope.sae(1).W_dec, scope.sae(2).W_dec
    exp1 = 3.0 * W1[:, 4].expand_as(base).clone()
    exp1[1:4] += -2.0 * W1[:, 9]
    torch.testing.assert_close(both["resid_post.1"] - base, exp1, atol=1e-5, rtol=0)
    exp2 = torch.zeros_like(base)
    exp2[0] = 6.0 * W2[:, 5]
    torch.testing.assert_close(both["resid_post.2"] - only1["resid_post.2"], exp2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_edit_and_zero_strength_equal_the_unhooked_model(family):
    scope = tiny_scope(family, layers=(1,))
    ids = scope.tokenize(PROMPT)
    with torch.no_grad():
        plain = scope.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    result = steer(scope, PROMPT, [add(1, 3, 0.0)], max_new_tokens=6)
    assert torch.equal(result.baseline.token_ids, plain)
    assert torch.equal(result.steered.token_ids, plain)
    assert result.first_difference is None
    assert result.fired == {"resid_post.1": len(plain)}


def test_per_step_probabilities_are_the_model_softmax():
    scope = tiny_scope(layers=(1,))
    result = steer(scope, PROMPT, [add(1, 3, 40.0)], max_new_tokens=5, top_n=3)
    for gen, edits in ((result.baseline, []), (result.steered, list(result.edits))):
        full = torch.cat([scope.tokenize(PROMPT)[0], gen.token_ids])[None]
        P = len(PROMPT)
        with torch.no_grad(), steering(scope, edits, prompt_length=P):
            probs = scope.model(input_ids=full[:, :-1], use_cache=False).logits[0, P - 1:].softmax(-1)
        torch.testing.assert_close(gen.probs, probs.gather(-1, gen.token_ids[:, None])[:, 0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gen.top_probs, probs.topk(3, -1).values, atol=1e-5, rtol=1e-4)
        assert gen.top_ids[:, 0].tolist() == gen.token_ids.tolist()  # greedy picks the likeliest
    assert "| steered" in result.side_by_side()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_generated_only_steering_reaches_decode_steps(family):
    # The prefill is untouched, so the first new token is the baseline's; the decode steps must be steered.
    scope = tiny_scope(family, layers=(1,))
    result = steer(scope, PROMPT, [add(1, 11, 60.0, positions="generated")], max_new_tokens=8)
    assert result.steered.token_ids[0] == result.baseline.token_ids[0]
    assert result.steered.probs[0] == pytest.approx(float(result.baseline.probs[0]), abs=1e-6)
    assert result.first_difference is not None and result.first_difference >= 1
    assert result.fired["resid_post.1"] == len(result.steered.token_ids)


def test_prompt_only_steering_changes_the_first_token_distribution():
    scope = tiny_scope("qwen3_5", layers=(1,))
    result = steer(scope, PROMPT, [add(1, 11, 60.0, positions="prompt")], max_new_tokens=3)
    assert not torch.allclose(result.steered.top_probs[0], result.baseline.top_probs[0])


def test_position_specs():
    assert parse_steer_positions("all") == (None, False, False)
    assert parse_steer_positions("0,2,5-8") == (Positions(((0, 0), (2, 2), (5, 8))), False, False)
    assert parse_steer_positions("3-4,generated") == (Positions(((3, 4),)), False, True)
    assert parse_steer_positions("prompt") == (Positions(), True, False)
    with pytest.raises(ValueError, match="bad position"):
        add(1, 2, 3.0, positions="0,x")
    with pytest.raises(ValueError, match="mode must be"):
        FeatureEdit(1, 2, "boost")


def test_edit_errors_name_the_layer_and_feature():
    scope = tiny_scope(layers=(1,))
    with pytest.raises(KeyError, match=r"no SAE at layer 2.*layers \[1\]"):
        steer(scope, PROMPT, [add(2, 0, 1.0)])
    with pytest.raises(ValueError, match="feature 999 out of range.*d_sae 256"):
        steer(scope, PROMPT, [add(1, 999, 1.0)])


def test_sweep_zero_strength_is_the_baseline():
    scope = tiny_scope(layers=(1,))
    result = sweep(scope, PROMPT, 1, 11, [0.0, 80.0], max_new_tokens=5)
    assert torch.equal(result.runs[0].token_ids, result.baseline.token_ids)
    assert not torch.equal(result.runs[1].token_ids, result.baseline.token_ids)
    assert len(result.table().splitlines()) == 3


def test_steer_command_side_by_side_edits_and_sweep(tmp_path, capsys):
    import json

    from qwen_scope.cli import main
    from tests.qwen_scope.scope_helpers import write_tiny_checkpoint

    model_dir, release_dir = write_tiny_checkpoint(tmp_path)
    common = ["--model", str(model_dir), "--release", str(release_dir), "--prompt", PROMPT, "--max-new-tokens", "4"]
    out = tmp_path / "steer.json"
    assert main(["steer", *common, "--layer", "1", "--feature", "7", "--strength", "strong",
                 "--edit", "2:9:clamp:3@generated", "--json", str(out)]) == 0
    assert "| steered" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["fired"] == {"resid_post.1": 4, "resid_post.2": 4}
    assert [e["value"] for e in data["edits"]] == [3.0, 100.0]
    assert len(data["steered"]["tokens"]) == 4 and len(data["steered"]["top"][0]) == 5
    assert main(["steer", *common, "--layer", "1", "--feature", "7", "--sweep", "0,50"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3
    assert main(["steer", *common]) == 2
    assert "qwen-scope steer: error: nothing to steer" in capsys.readouterr().err


def test_bf16_model_with_fp32_sae_steers_within_bf16_rounding():
    scope = Scope(tiny_model("qwen3_5", dtype=torch.bfloat16), tiny_tokenizer(), {1: orthonormal_sae()})
    ids = scope.tokenize(PROMPT)
    base = _resid(scope, ids, ["resid_post.1"])["resid_post.1"]
    steered = _resid(scope, ids, ["resid_post.1"], [add(1, 2, 4.0, positions="prompt")])["resid_post.1"]
    assert steered.dtype == torch.bfloat16
    expected = (base.float() + 4.0 * scope.sae(1).W_dec[:, 2]).bfloat16()
    torch.testing.assert_close(steered, expected, atol=0, rtol=0)


def test_add_with_an_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match=r"'huge' is not a preset.*'light': 5\.0"):
        add(1, 3, "huge")
    assert add(1, 3, "strong").value == 100.0


def test_sweep_generates_once_per_strength_plus_one_baseline(monkeypatch):
    scope = tiny_scope(layers=(1,))
    calls = []
    generate = scope.model.generate
    monkeypatch.setattr(scope.model, "generate", lambda *a, **k: calls.append(1) or generate(*a, **k))
    result = sweep(scope, "ab", 1, 3, [0.0, 50.0], max_new_tokens=2, baseline=True)
    assert len(calls) == 3 and len(result.runs) == 2
    assert result.runs[0].token_ids.tolist() == result.baseline.token_ids.tolist()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e38])
def test_non_finite_or_absurd_strengths_and_clamps_are_refused_naming_the_edit(value):
    for make in (lambda: add(12, 7, value), lambda: clamp(12, 7, value), lambda: FeatureEdit(12, 7, "add", value)):
        with pytest.raises(ValueError, match=r"at layer 12 feature 7 must be finite and at most 1e\+06"):
            make()
    with pytest.raises(TypeError, match=r"clamp value of clamp at layer 12 feature 7 must be a number, got 'x'"):
        clamp(12, 7, "x")
    assert add(12, 7, -20).value == -20.0 and isinstance(clamp(1, 2, 3).value, float)


def test_a_huge_position_range_steers_without_expanding():
    # "0-99999999999" is one range: the mask is computed per pass, never a set of 10^11 positions.
    scope = tiny_scope("qwen3", layers=(1,))
    ids = scope.tokenize(PROMPT)
    base = _resid(scope, ids, ["resid_post.1"])["resid_post.1"]
    steered = _resid(scope, ids, ["resid_post.1"], [add(1, 2, 4.0, positions="0-99999999999")])["resid_post.1"]
    torch.testing.assert_close(steered - base, (4.0 * scope.sae(1).W_dec[:, 2].detach()).expand_as(base),
                               atol=1e-5, rtol=0)
