"""Long-tail synthesis on the nano model: the targeted loop covers a training footprint's gap with fewer samples
than random sampling from the same generator; the loop's bookkeeping with a scripted generator; clear errors."""
from __future__ import annotations

import pytest
import torch

from qwen_scope import FeatureFootprint, nano_scope
from qwen_scope.applications import (FeaturePrompt, TextGenerator, coverage_figure, document_scores, efficiency,
                                     feature_prompts, sample_coverage, synthesize)
from tests.qwen_scope.scope_helpers import corpus_windows, window_scores

LAYER, STRONG = 3, 2.0


@pytest.fixture(scope="module")
def setup():
    scope = nano_scope([LAYER])
    code, prose = corpus_windows()
    code_scores, prose_scores = window_scores()
    train = FeatureFootprint.from_scores({LAYER: prose_scores[LAYER][:40]}, threshold=STRONG)
    pool = prose[40:64] + code[:24]
    target = FeatureFootprint.from_scores({LAYER: torch.cat([prose_scores[LAYER][40:64], code_scores[LAYER][:24]])},
                                          threshold=STRONG, min_docs=2)
    gap = {LAYER: train.missing(target)[LAYER][:24]}
    return scope, pool, gap


def test_targeted_loop_beats_random_sampling_from_the_same_generator(setup):
    scope, pool, gap = setup
    prompts = feature_prompts(scope, gap, pool, n_examples=2, context_tokens=24)
    assert all(p.prompts and p.lens for p in prompts)
    run = synthesize(scope, TextGenerator(scope.model, scope.tokenizer, max_new_tokens=24, temperature=0.8),
                     prompts, budget=64, batch_size=16, attempts=2, threshold=STRONG)
    random_prompts = [t[i:i + 24] for t in pool for i in (0, 80, 160)]
    base = sample_coverage(scope, TextGenerator(scope.model, scope.tokenizer, max_new_tokens=24, temperature=0.8),
                           random_prompts, gap, budget=80, batch_size=16, threshold=STRONG)
    eff = efficiency(run, base)
    print(run, base, eff, sep="\n")
    assert eff.ratio > 1.5, eff
    # every kept sample really hits what it claims
    kept = document_scores(scope, [c.text for c in run.kept], LAYER)[LAYER]
    for row, c in zip(kept, run.kept):
        assert all(float(row[f]) > STRONG for _, f in c.hits)
    assert len(coverage_figure({"targeted": run, "random": base}).data) == 2


def _prompt(f: int) -> FeaturePrompt:
    return FeaturePrompt(LAYER, f, (f"p{f}a", f"p{f}b"))


def test_loop_retries_misses_with_the_next_variant_and_stops_at_the_budget(setup):
    scope, pool, gap = setup
    f = int(gap[LAYER][0])
    hit = next(t for t in pool if float(document_scores(scope, [t], LAYER)[LAYER][0, f]) > STRONG)
    seen = []

    def scripted(prompts):
        seen.extend(prompts)
        return [hit if p == f"p{f}b" else "x" for p in prompts]

    other = int(gap[LAYER][-1])
    run = synthesize(scope, scripted, [_prompt(f), _prompt(other)], budget=3, batch_size=2, attempts=3,
                     threshold=STRONG)
    assert seen[:2] == [f"p{f}a", f"p{other}a"] and seen[2] == f"p{f}b"  # retried with the second variant
    assert run.generated == 3 and (LAYER, f) in run.covered and run.kept[0].aimed_at == (LAYER, f)
    assert run.curve[0] == (0, 0) and run.attempts[(LAYER, f)] == 2


def test_a_generator_that_never_hits_a_target_says_so(setup):
    scope, _, gap = setup
    with pytest.raises(ValueError, match=r"the generator hit none of the 2 target features in 4 samples "
                                         r"\(2 attempts each"):
        synthesize(scope, lambda ps: ["x"] * len(ps), [_prompt(int(gap[LAYER][0])), _prompt(int(gap[LAYER][1]))],
                   budget=10, attempts=2, threshold=STRONG)
    with pytest.raises(TypeError, match="one str per prompt"):
        synthesize(scope, lambda ps: [], [_prompt(1)], budget=2)
    with pytest.raises(ValueError, match="no target features"):
        feature_prompts(scope, {LAYER: []}, ["x"])
