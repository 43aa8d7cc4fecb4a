"""The decode engine on CUDA: the captured graph replays exactly what the eager step computes, and matches generate.

The CPU tests prove the engine's math against transformers' ``generate`` in fp32; these prove the CUDA form:
capture succeeds for every family, a replay equals the eager step bit for bit (same kernels), steering and readout
buffers are read inside the graph (a new strength changes the result without a new capture), seeded sampling
replays its generator, and in fp32 the tokens equal ``generate``'s.
"""
from __future__ import annotations

import pytest
import torch

from qwen_scope.engine import DecodeEngine, SamplingConfig
from qwen_scope.steering import add, clamp
from tests.factories import FAMILIES, tiny_model
from tests.qwen_scope.scope_helpers import tiny_sae

pytestmark = pytest.mark.gpu

PROMPTS = ([5, 17, 99, 3, 42, 7, 201], [11, 250, 64], [9, 9, 31, 160, 2])


def _cuda(family, dtype):
    return tiny_model(family).to("cuda", dtype)


def _prompts():
    return [torch.tensor(p, device="cuda") for p in PROMPTS]


def _saes(dtype):
    return {1: tiny_sae(seed=1).to("cuda", dtype), 2: tiny_sae(seed=2).to("cuda", dtype)}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_captured_graph_replays_the_eager_step_bit_for_bit(family):
    model, saes = _cuda(family, torch.bfloat16), _saes(torch.bfloat16)
    edits = [[add(1, 11, 6.0)], [], [clamp(2, 5, 3.0)]]
    kw = dict(max_new_tokens=12, keep_logits=True, readout=[1], stop_tokens=[])
    graph = DecodeEngine(model, saes).generate(_prompts(), edits, **kw)
    eager = DecodeEngine(model, saes, use_graph=False).generate(_prompts(), edits, **kw)
    assert graph.graph and not eager.graph and graph.steps == eager.steps
    for g, e in zip(graph.rows, eager.rows):
        assert torch.equal(g.token_ids, e.token_ids)
        assert torch.equal(g.logits, e.logits) and torch.isfinite(g.logits).all()
        assert torch.equal(g.readout[1].indices, e.readout[1].indices)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_next"])
def test_fp32_tokens_and_logits_equal_transformers_generate_on_cuda(family):
    model = _cuda(family, torch.float32)
    result = DecodeEngine(model).generate(_prompts(), max_new_tokens=8, keep_logits=True, stop_tokens=[])
    assert result.graph
    for prompt, row in zip(_prompts(), result.rows):
        with torch.no_grad():
            out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=8,
                                 do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        assert torch.equal(row.token_ids, out.sequences[0, prompt.shape[0]:].cpu())
        ref = torch.stack([lg[0] for lg in out.logits]).float().cpu()
        torch.testing.assert_close(row.logits, ref, atol=1e-4, rtol=1e-4)


def test_new_strengths_are_buffer_contents_the_same_graph_replays_them():
    model, saes = _cuda("qwen3_5", torch.float32), _saes(torch.float32)
    engine = DecodeEngine(model, saes)
    first = engine.generate(_prompts()[:1], [[add(1, 11, 40.0)]], max_new_tokens=8, keep_logits=True)
    graph = engine._session.graph
    second = engine.generate(_prompts()[:1], [[add(1, 11, -40.0)]], max_new_tokens=8, keep_logits=True)
    assert engine._session.graph is graph
    fresh = DecodeEngine(model, saes, use_graph=False).generate(_prompts()[:1], [[add(1, 11, -40.0)]],
                                                                 max_new_tokens=8, keep_logits=True)
    assert not torch.equal(first.rows[0].logits, second.rows[0].logits)
    assert torch.equal(second.rows[0].token_ids, fresh.rows[0].token_ids)
    torch.testing.assert_close(second.rows[0].logits, fresh.rows[0].logits, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_replays_the_generator_and_repeats_with_the_seed():
    model = _cuda("qwen3_5", torch.bfloat16)
    cfg = SamplingConfig(do_sample=True, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    engine = DecodeEngine(model)
    a = engine.generate(_prompts(), max_new_tokens=16, sampling=cfg, stop_tokens=[])
    b = engine.generate(_prompts(), max_new_tokens=16, sampling=cfg, stop_tokens=[])
    eager = DecodeEngine(model, use_graph=False).generate(_prompts(), max_new_tokens=16, sampling=cfg, stop_tokens=[])
    assert a.graph
    for x, y, z in zip(a.rows, b.rows, eager.rows):
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.token_ids, z.token_ids)
    assert len({tuple(r.token_ids.tolist()) for r in a.rows}) > 1


def test_a_replayed_step_makes_no_host_sync():
    model = _cuda("qwen3_5", torch.bfloat16)
    engine = DecodeEngine(model, _saes(torch.bfloat16))
    engine.generate(_prompts(), [[add(1, 11, 6.0)]] * 3, max_new_tokens=4, readout=[2])
    session = engine._session
    # Rewind to just after prefill so the replays write columns inside the 4 the session allocated.
    session.state.gen_index.fill_(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            session.graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_steered_decisions_equal_transformers_where_they_are_not_near_ties(family):
    """Two bf16 paths round differently, so their greedy sequences may part at a near-tie. With the engine's own
    tokens fed to transformers under the same steering hooks (teacher forcing), every decision whose top-2 margin
    exceeds twice the paths' largest logit distance at that step must pick the same token."""
    from qwen_scope.steering import steering

    model, saes = _cuda(family, torch.bfloat16), _saes(torch.bfloat16)
    edits = [[add(1, 11, 6.0)], [clamp(2, 5, 3.0)], [add(1, 3, -4.0), clamp(2, 7, 0.0)]]
    N = 16
    result = DecodeEngine(model, saes).generate(_prompts(), edits, max_new_tokens=N, keep_logits=True, stop_tokens=[])
    decisive_total = 0
    for prompt, row_edits, row in zip(_prompts(), edits, result.rows):
        P = prompt.shape[0]
        seq = torch.cat([prompt, row.token_ids.to("cuda")])[None, :-1]
        with torch.no_grad(), steering(model, row_edits, saes=saes, prompt_length=P):
            ref = model(seq).logits[0, P - 1:].float().cpu()
        ours = row.logits.float()
        top2 = ref.topk(2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        gaps = (ours - ref).abs().amax(dim=-1)
        decisive = margins > 2 * gaps
        differ = ours.argmax(-1) != ref.argmax(-1)
        assert not (differ & decisive).any(), (
            f"{family}: the engine picks another token where transformers is decisive at steps "
            f"{(differ & decisive).nonzero().flatten().tolist()} (margins {margins.tolist()}, gaps {gaps.tolist()})")
        assert (gaps < 0.1 * ref.abs().amax(dim=-1)).all(), f"{family}: logits far apart: {gaps.tolist()}"
        decisive_total += int(decisive.sum())
    assert decisive_total > 0, "no decisive step at all: the comparison checked nothing"
