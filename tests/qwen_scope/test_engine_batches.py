"""Scope.steer / sweep / generate on the engine equal the transformers path, and say why when they fall back."""
from __future__ import annotations

import logging

import pytest
import torch

from qwen_scope.engine.batches import generate, sweep_batched
from qwen_scope.steering import ablate, add, clamp, steer, sweep
from tests.qwen_scope.scope_helpers import tiny_scope

PROMPT = "The cat sat"
EDITS = {
    "raw-all": [add(1, 11, 40.0)],
    "unit-generated": [add(1, 11, 3.0, scale="unit", positions="generated")],
    "norm-prompt": [add(2, 5, 0.7, scale="norm", positions="prompt")],
    "clamp-spec": [clamp(1, 7, 9.0, positions="0-3,generated")],
    "ablate+add-layers": [ablate(2, 9), add(1, 3, 20.0, positions="2,5,9-12")],
}


def _same(a, b):
    assert torch.equal(a.token_ids, b.token_ids)
    torch.testing.assert_close(a.probs, b.probs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a.top_probs, b.top_probs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("name", sorted(EDITS))
def test_engine_steer_equals_the_transformers_path(family, name):
    scope = tiny_scope(family, layers=(1, 2))
    want = steer(scope, PROMPT, EDITS[name], max_new_tokens=7, engine="transformers")
    got = steer(scope, PROMPT, EDITS[name], max_new_tokens=7)
    assert got.generated_by == "engine" and want.generated_by.startswith("transformers")
    _same(got.baseline, want.baseline)
    _same(got.steered, want.steered)
    assert got.fired == want.fired


def test_a_batched_sweep_over_prompts_equals_each_generation_run_alone():
    scope = tiny_scope("qwen3_next", layers=(1,))
    prompts, strengths = ["The cat sat", "Once"], [0.0, 30.0, -50.0]
    sweeps = sweep_batched(scope, prompts, 1, 11, strengths, max_new_tokens=6, positions="generated")
    one = sweep(scope, prompts[0], 1, 11, strengths, max_new_tokens=6, positions="generated", engine="auto")
    assert [r.text for r in one.runs] == [r.text for r in sweeps[0].runs]
    for prompt, result in zip(prompts, sweeps):
        _same(result.baseline, steer(scope, prompt, [], max_new_tokens=6, engine="transformers").steered)
        for s, run in zip(strengths, result.runs):
            alone = steer(scope, prompt, [add(1, 11, s, positions="generated")], max_new_tokens=6, baseline=False,
                          engine="transformers")
            _same(run, alone.steered)


def test_sampled_batch_rows_equal_the_same_seeded_generation_alone():
    scope = tiny_scope("qwen3_5", layers=(1,))
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    rows = generate(scope, ["The cat sat", "Once"], [add(1, 11, 10.0)], **kw)
    for prompt, row in zip(["The cat sat", "Once"], rows):
        assert torch.equal(row.token_ids, generate(scope, prompt, [add(1, 11, 10.0)], **kw)[0].token_ids)
    again = generate(scope, ["The cat sat", "Once"], [add(1, 11, 10.0)], **kw)
    assert all(torch.equal(a.token_ids, b.token_ids) for a, b in zip(rows, again))


def test_scope_generate_without_edits_is_plain_greedy_generation():
    scope = tiny_scope("qwen3", layers=(1,))
    ids = scope.tokenize(PROMPT)
    with torch.no_grad():
        plain = scope.model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    assert torch.equal(scope.generate(PROMPT, max_new_tokens=5)[0].token_ids, plain)


def test_requests_the_engine_cannot_host_fall_back_and_say_why(caplog):
    scope = tiny_scope("qwen3_5", layers=(1,))
    with caplog.at_level(logging.INFO, logger="qwen_scope.steering"):
        beams = steer(scope, PROMPT, [add(1, 11, 5.0)], max_new_tokens=3, repetition_penalty=1.3)
    assert beams.generated_by.startswith("transformers (generate keywords ['repetition_penalty']")
    assert "repetition_penalty" in caplog.text
    handle = scope.model.model.layers[0].register_forward_hook(lambda m, a, o: None)
    try:
        hooked = steer(scope, PROMPT, [add(1, 11, 5.0)], max_new_tokens=3)
        assert "'model.layers.0' has forward hooks" in hooked.generated_by
        with pytest.raises(ValueError, match="engine='static' cannot run this request: module 'model.layers.0'"):
            steer(scope, PROMPT, [add(1, 11, 5.0)], max_new_tokens=3, engine="static")
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="engine must be 'auto', 'static' or 'transformers'"):
        steer(scope, PROMPT, [], engine="fast")
