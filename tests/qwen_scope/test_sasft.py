"""SASFT on the nano model: code-specific features found against prose, their prose-average pre-activations as
targets, the loss equal to its formula, a few SFT steps that switch them off on held-out prose while the held-out LM
loss stays within 0.02 nats/byte of plain SFT; per-token RL rewards in TRL's layout; repetition; clear errors."""
from __future__ import annotations

import pytest
import torch

from hooks import capture_forward
from qwen_scope import FeaturePenalty, nano_scope
from qwen_scope.applications import (class_targets, contrast_features, repetition_rate, response_mask,
                                     reward_function, split_by_repetition, token_rewards)
from tests.qwen_scope.scope_helpers import corpus_windows

LAYER = 3


@pytest.fixture(scope="module")
def data():
    code, prose = corpus_windows(width=64)
    return code, prose


@pytest.fixture(scope="module")
def picks(data):
    code, prose = data
    scope = nano_scope([LAYER])
    found = contrast_features(scope, code[:16], prose[:16], layer=LAYER, top=4)
    return found, class_targets(scope, found, prose[:16])


def _ids(scope, texts):
    return torch.tensor([scope.tokenizer(t, add_special_tokens=False)["input_ids"][:64] for t in texts])


def test_finder_scores_and_targets_equal_their_definitions(data, picks):
    code, prose = data
    found, targets = picks
    scope = nano_scope([LAYER])
    sae = scope.sae(LAYER)

    def acts(texts, pre=False):
        rows = []
        for t in texts:
            r = capture_forward(scope.model, [f"resid_post.{LAYER}"], input_ids=scope.tokenize(t))
            x = r[f"resid_post.{LAYER}"][0, 1:].float()
            rows.append(sae.pre_acts(x) if pre else sae.encode(x))
        return torch.cat(rows)

    a, b = acts(code[:16]), acts(prose[:16])
    score = a.mean(0) - b.mean(0)
    assert [p.feature for p in found] == score.argsort(descending=True)[:4].tolist()
    assert [p.score for p in found] == pytest.approx(score.sort(descending=True).values[:4].tolist(), abs=1e-5)
    torch.testing.assert_close(targets, acts(prose[:16], pre=True)[:, [p.feature for p in found]].mean(0))


def test_sasft_penalty_is_the_mean_relu_over_response_tokens_and_features(data, picks):
    _, prose = data
    found, targets = picks
    scope = nano_scope([LAYER])
    feats = [p.feature for p in found]
    pen = FeaturePenalty.sasft(scope.sae(LAYER), LAYER, feats, targets)
    ids = _ids(scope, prose[16:20])
    mask = response_mask(ids, [10, 20, 30, 40])
    assert mask.sum(1).tolist() == [54, 44, 34, 24]
    with pen.watch(scope.model) as last:
        scope.model(input_ids=ids, use_cache=False)
        got = last(mask=mask)
    resid = capture_forward(scope.model, [f"resid_post.{LAYER}"], input_ids=ids)[f"resid_post.{LAYER}"]
    excess = (scope.sae(LAYER).pre_acts(resid)[..., feats].float() - targets).clamp(min=0).mean(-1)
    torch.testing.assert_close(got, (excess * mask).sum() / mask.sum())


def _train(scope, pen, ids, lam: float, steps: int = 8) -> None:
    torch.manual_seed(0)
    opt = torch.optim.AdamW(scope.model.parameters(), lr=3e-4)
    mask = torch.ones(8, ids.shape[1])
    mask[:, 0] = 0
    scope.model.train()
    with pen.watch(scope.model) as last:
        for step in range(steps):
            x = ids[(step * 8) % len(ids):(step * 8) % len(ids) + 8]
            loss = scope.model(input_ids=x, labels=x, use_cache=False).loss + lam * last(mask=mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
    scope.model.eval()


def test_sasft_switches_the_code_features_off_on_held_out_prose_within_the_lm_loss_margin(data, picks):
    code, prose = data
    found, targets = picks
    feats = [p.feature for p in found]
    out = {}
    for lam in (0.0, 1.0):
        scope = nano_scope([LAYER])
        train, held = _ids(scope, prose[16:48]), _ids(scope, prose[48:64])
        _train(scope, FeaturePenalty.sasft(scope.sae(LAYER), LAYER, feats, targets), train, lam)
        with torch.no_grad():
            resid = capture_forward(scope.model, [f"resid_post.{LAYER}"], input_ids=held)[f"resid_post.{LAYER}"]
            act = float(scope.sae(LAYER).encode(resid[:, 1:].float())[..., feats].mean())
            loss = float(scope.model(input_ids=held, labels=held, use_cache=False).loss)
        out[lam] = (act, loss)
    print({"plain SFT": out[0.0], "SASFT": out[1.0]})
    (act0, loss0), (act1, loss1) = out[0.0], out[1.0]
    assert act1 < 0.1 * act0, out  # measured: 0.0158 (plain SFT) vs 0.0000 (SASFT) mean activation on held-out prose
    assert abs(loss1 - loss0) < 0.02, out  # held-out prose LM loss within 0.02 nats/byte of plain SFT


def test_token_rewards_are_minus_the_feature_activation_per_response_token_in_trl_layout(data, picks):
    code, _ = data
    found, _ = picks
    scope = nano_scope([LAYER])
    feats = [p.feature for p in found]
    seq = _ids(scope, code[16:18])
    rewards = token_rewards(scope, LAYER, feats, seq, 40, response_lengths=[24, 10])
    assert rewards.shape == (2, 24) and (rewards[1, 10:] == 0).all() and (rewards <= 0).all()
    resid = capture_forward(scope.model, [f"resid_post.{LAYER}"], input_ids=seq)[f"resid_post.{LAYER}"]
    want = -scope.sae(LAYER).encode(resid[:, 40:].float())[..., feats].sum(-1)
    torch.testing.assert_close(rewards[0], want[0])
    reward = reward_function(scope, LAYER, feats)
    assert len(reward(["def f(x):", "The"], ["\n    return x", " module"])) == 2


def test_repetition_split_and_errors(data):
    code, prose = data
    assert repetition_rate([1, 2, 3, 4] * 5, n=4) > 0.7 and repetition_rate(list(range(20)), n=4) == 0.0
    scope = nano_scope([LAYER])
    rep, normal = split_by_repetition(scope, ["abcabcabcabcabcabc" * 2, prose[0]])
    assert rep == ["abcabcabcabcabcabc" * 2] and normal == [prose[0]]
    with pytest.raises(ValueError, match="texts_b is empty"):
        contrast_features(scope, code[:2], [], layer=LAYER)
    with pytest.raises(ValueError, match="no feature at layer 3 is more active on texts_a"):
        contrast_features(scope, prose[:2], prose[:2], layer=LAYER)
