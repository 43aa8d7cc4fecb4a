"""SAE-guided penalty: the value equals the formula on captured activations, the hook is scoped, and a few steps
of fine-tuning the nano model with it switch the penalised feature off on held-out text (and not without it)."""
from __future__ import annotations

import random

import pytest
import torch

from hooks import capture
from qwen_scope import nano_corpus, nano_scope
from qwen_scope.applications import FeaturePenalty
from tests.qwen_scope.test_classify import _chunks, _is_code

LAYER = 3


@pytest.fixture(scope="module")
def code_texts():
    chunks = [c for t in nano_corpus(sources=["source"]) for c in _chunks(t) if _is_code(c)]
    return random.Random(2).sample(chunks, 24)


def _ids(scope, texts):
    enc = [scope.tokenizer(t, add_special_tokens=False)["input_ids"][:64] for t in texts]
    n = min(len(e) for e in enc)
    return torch.tensor([e[:n] for e in enc])


def _top_feature(scope, ids) -> int:
    with torch.no_grad():
        acts = scope.sae(LAYER).encode(capture_resid(scope.model, ids))
    return int(acts[:, 1:].flatten(0, 1).mean(0).argmax())


def capture_resid(model, ids):
    with capture(model, [f"resid_post.{LAYER}"]) as cap:
        model(input_ids=ids, use_cache=False)
    return cap[f"resid_post.{LAYER}"]


def test_penalty_is_the_formula_on_the_captured_layer_and_the_hook_is_scoped(code_texts):
    scope = nano_scope([LAYER])
    ids = _ids(scope, code_texts[:4])
    sae, feats = scope.sae(LAYER), [5, 17, _top_feature(scope, ids)]
    pen = FeaturePenalty(sae, LAYER, feats, target=0.1)
    mask = torch.zeros(ids.shape)
    mask[:, 3:] = 1
    with pen.watch(scope.model) as last:
        with pytest.raises(RuntimeError, match="no forward pass reached resid_post.3"):
            last()
        scope.model(input_ids=ids, use_cache=False)
        got, got_masked = last(), last(mask=mask)
    resid = capture_resid(scope.model, ids)
    excess = (sae.pre_acts(resid)[..., feats].float() - 0.1).clamp(min=0).pow(2).sum(-1)
    torch.testing.assert_close(got, excess.mean())
    torch.testing.assert_close(got_masked, (excess * mask).sum() / mask.sum())
    assert got > 0 and got.requires_grad
    assert not any(m._forward_hooks for m in scope.model.modules())  # removed on exit
    with pytest.raises(ValueError, match="outside the SAE's 0..1023"):
        FeaturePenalty(sae, LAYER, [1024])
    with pytest.raises(ValueError, match="mask must be"):
        pen(resid, torch.ones(2, 2))
    # the device copies of the rows and targets follow an edited or reassigned target
    pen.target.fill_(0.5)
    excess = (sae.pre_acts(resid)[..., feats].float() - 0.5).clamp(min=0).pow(2).sum(-1)
    torch.testing.assert_close(pen(resid), excess.mean())
    pen.target = torch.tensor([0.0, 0.2, 0.3])
    excess = (sae.pre_acts(resid)[..., feats].float() - pen.target).clamp(min=0).pow(2).sum(-1)
    torch.testing.assert_close(pen(resid), excess.mean())


def _finetune(scope, ids, pen, weight: float, steps: int = 8) -> float:
    opt = torch.optim.Adam(scope.model.parameters(), lr=2e-3)
    scope.model.train()
    with pen.watch(scope.model) as last:
        for _ in range(steps):
            out = scope.model(input_ids=ids, labels=ids, use_cache=False)
            loss = out.loss + weight * last()
            opt.zero_grad()
            loss.backward()
            opt.step()
    scope.model.eval()
    with torch.no_grad():
        return float(scope.model(input_ids=ids, labels=ids, use_cache=False).loss)


def test_fine_tuning_with_the_penalty_switches_the_feature_off_on_held_out_text(code_texts):
    torch.manual_seed(0)
    train, held = code_texts[:16], code_texts[16:]
    results = {}
    for weight in (0.0, 1.0):
        scope = nano_scope([LAYER])  # a fresh copy of the model each time
        ids, held_ids = _ids(scope, train), _ids(scope, held)
        feature = _top_feature(scope, ids)
        pen = FeaturePenalty(scope.sae(LAYER), LAYER, feature)
        with torch.no_grad():
            lm_before = float(scope.model(input_ids=ids, labels=ids, use_cache=False).loss)
            before = float(scope.sae(LAYER).encode(capture_resid(scope.model, held_ids))[:, 1:, feature].mean())
        lm_after = _finetune(scope, ids, pen, weight)
        with torch.no_grad():
            after = float(scope.sae(LAYER).encode(capture_resid(scope.model, held_ids))[:, 1:, feature].mean())
        results[weight] = (before, after, lm_before, lm_after)
    print({w: [round(v, 3) for v in r] for w, r in results.items()})  # (before, after, lm before, lm after)
    before, after, lm_before, lm_after = results[1.0]
    assert before > 0 and after < 0.2 * before, results  # the feature is (nearly) off on unseen code
    assert lm_after < lm_before + 0.5, results  # the LM loss does not blow up
    assert results[0.0][1] > 0.5 * results[0.0][0], results  # without the penalty the feature stays on
