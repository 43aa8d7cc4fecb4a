"""Device-side token choice: transformers' warpers exactly, seeded draws, and the stop / budget bookkeeping."""
from __future__ import annotations

import pytest
import torch

from qwen_scope.engine.sampling import SamplingBuffers, SamplingConfig, _warp, choose_tokens


def _hf_warp(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    scores = TemperatureLogitsWarper(temperature)(None, logits)
    scores = TopKLogitsWarper(top_k)(None, scores)
    return TopPLogitsWarper(top_p)(None, scores)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 50, 1.0), (0.7, 10, 0.9), (1.3, 256, 0.5)])
def test_warpers_equal_transformers_temperature_top_k_top_p(temperature, top_k, top_p):
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * 3
    buffers = SamplingBuffers(SamplingConfig(True, temperature, top_k, top_p), 3, 256, torch.device("cpu"))
    assert torch.equal(_warp(logits, buffers), _hf_warp(logits, temperature, top_k, top_p))


def test_seeded_draws_repeat_stay_in_the_kept_set_and_top_k_one_is_greedy():
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    config = SamplingConfig(True, 1.0, 5, 1.0, seed=11)
    a = [choose_tokens(logits, b) for b in [SamplingBuffers(config, 4, 256, torch.device("cpu"))] for _ in range(3)]
    b = [choose_tokens(logits, b) for b in [SamplingBuffers(config, 4, 256, torch.device("cpu"))] for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    kept = logits.topk(5, dim=-1).indices
    assert all((kept == x[:, None]).any(-1).all() for x in a)
    greedy = SamplingBuffers(SamplingConfig(True, 1.0, 1, 1.0), 4, 256, torch.device("cpu"))
    assert torch.equal(choose_tokens(logits, greedy), logits.argmax(-1))
    assert torch.equal(choose_tokens(logits, None), logits.argmax(-1))


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    buffers = SamplingBuffers(SamplingConfig(True, seed=0), 1, 3, torch.device("cpu"))
    counts = torch.bincount(torch.cat([choose_tokens(logits, buffers) for _ in range(4000)]), minlength=3)
    torch.testing.assert_close(counts / 4000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="temperature must be > 0.*do_sample=False"):
        SamplingConfig(True, 0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingConfig(True, top_p=1.5)
    with pytest.raises(ValueError, match="top_k must be a non-negative int"):
        SamplingConfig(True, top_k=-1)
