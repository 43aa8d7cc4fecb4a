"""The decode engine generates what transformers' generate does: same greedy tokens and logits, per row of a batch."""
from __future__ import annotations

import pytest
import torch

from qwen_scope.engine import DecodeEngine
from tests.factories import FAMILIES, tiny_model
from tests.qwen_scope.scope_helpers import tiny_scope


def _hf(model, ids, n):
    with torch.no_grad():
        out = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=n, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[0, ids.shape[0]:], torch.stack([lg[0] for lg in out.logits]).float()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logits_equal_transformers_generate_for_every_row(family):
    model = tiny_model(family)
    prompts = [torch.tensor([5, 17, 99, 3, 42, 7, 201]), torch.tensor([11, 250, 64])]
    result = DecodeEngine(model).generate(prompts, max_new_tokens=7, keep_logits=True)
    assert not result.graph and result.steps == 6
    for prompt, row in zip(prompts, result.rows):
        tokens, logits = _hf(model, prompt, 7)
        assert torch.equal(row.token_ids, tokens)
        torch.testing.assert_close(row.logits, logits, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(row.probs, logits.softmax(-1).gather(1, tokens[:, None])[:, 0], atol=1e-6,
                                   rtol=1e-5)


def test_stop_tokens_end_a_row_which_then_stops_changing_while_others_go_on():
    model = tiny_model("qwen3_5")
    prompts = [torch.tensor([5, 17, 99]), torch.tensor([8, 1, 77, 90])]
    free = DecodeEngine(model).generate(prompts, max_new_tokens=8)
    stop = int(free.rows[0].token_ids[2])
    assert stop not in free.rows[1].token_ids[:5].tolist()
    result = DecodeEngine(model).generate(prompts, max_new_tokens=8, stop_tokens=[stop], max_new_per_row=[8, 5])
    first = free.rows[0].token_ids.tolist().index(stop)
    assert result.rows[0].token_ids.tolist() == free.rows[0].token_ids[: first + 1].tolist()
    assert torch.equal(result.rows[1].token_ids, free.rows[1].token_ids[:5])


def test_streamed_tokens_are_the_final_rows_and_a_callback_sees_each_step():
    model = tiny_model("qwen3")
    prompts = [torch.tensor([5, 17, 99]), torch.tensor([8, 1])]
    engine = DecodeEngine(model)
    it = engine.stream(prompts, max_new_tokens=5)
    steps = list(it)
    assert len(steps) == 5 and all(s.shape == (2,) for s in steps)
    assert torch.equal(torch.stack(steps, 1)[0], engine.last_result.rows[0].token_ids)
    seen = []
    result = engine.generate(prompts, max_new_tokens=5, on_token=seen.append)
    assert torch.equal(torch.stack(seen, 1)[1], result.rows[1].token_ids)


def test_a_second_request_of_the_same_shape_reuses_the_buffers_and_matches_a_fresh_engine():
    from qwen_scope.steering import add

    scope = tiny_scope("qwen3_5", layers=(1,))
    prompts = [torch.tensor([5, 17, 99, 4])]
    engine = DecodeEngine(scope.model, scope.saes)
    engine.generate(prompts, [[add(1, 11, 40.0)]], max_new_tokens=6)
    state = engine._session.state
    again = engine.generate(prompts, [[add(1, 11, -25.0)]], max_new_tokens=6)
    assert engine._session.state is state
    fresh = DecodeEngine(scope.model, scope.saes).generate(prompts, [[add(1, 11, -25.0)]], max_new_tokens=6)
    assert torch.equal(again.rows[0].token_ids, fresh.rows[0].token_ids)
    assert torch.equal(again.rows[0].probs, fresh.rows[0].probs)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_feature_readout_equals_scope_features_on_the_generated_text(family, monkeypatch):
    scope = tiny_scope(family, layers=(1, 2))
    ids = scope.tokenize("The cat sat")[0]
    result = DecodeEngine(scope.model, scope.saes).generate([ids], max_new_tokens=6, readout={1: None, 2: 4})
    row = result.rows[0]
    full = torch.cat([ids, row.token_ids])
    # The byte tokenizer's random continuations are rarely valid UTF-8, so the text would not tokenize back to the
    # same ids: Scope.features reads the generated sequence's ids themselves.
    monkeypatch.setattr(scope, "tokenize", lambda text, template=None: full[None])
    feats = scope.features("<the generated text>", layers=[1, 2])
    assert torch.equal(feats.token_ids, full)
    P = ids.shape[0]
    for layer, k in ((1, scope.sae(1).k), (2, 4)):
        codes = row.readout[layer]
        assert codes.values.shape == (6, k)
        assert torch.equal(codes.indices, feats[layer].indices[P:, :k])
        torch.testing.assert_close(codes.values, feats[layer].values[P:, :k], atol=1e-5, rtol=1e-5)


def test_models_and_requests_the_engine_cannot_take_are_refused_with_the_reason():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="no lm_head"):
        DecodeEngine(model.model)
    with pytest.raises(ValueError, match="use_graph=True needs a CUDA model"):
        DecodeEngine(model, use_graph=True)
    engine = DecodeEngine(model)
    with pytest.raises(ValueError, match="edits has 2 rows but there are 1 prompts"):
        engine.generate([torch.tensor([1, 2])], [[], []])
    with pytest.raises(KeyError, match=r"readout layers \[1\] have no SAE"):
        engine.generate([torch.tensor([1, 2])], readout=[1])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.generate([torch.tensor([1, 2])], max_new_tokens=0)


def test_the_engine_speaks_the_older_transformers_forms_of_the_rotary_and_the_cache_keyword(monkeypatch):
    """transformers before 5.24 takes Qwen3.5's multimodal position ids only as [3, B, T] and names the forward's
    cache ``past_key_values``; the engine must give both forms, or it decodes from an empty cache."""
    model = tiny_model("qwen3_5")
    prompts = [torch.tensor([5, 17, 99, 3]), torch.tensor([8, 1])]
    expected = DecodeEngine(model).generate(prompts, max_new_tokens=5, keep_logits=True)
    rotary = model.model.rotary_emb
    original_rotary = rotary.forward

    def rotary_3d_only(x, position_ids):
        if position_ids.dim() != 3:
            raise IndexError("too many indices for tensor of dimension 2")
        return original_rotary(x, position_ids)

    original_forward = type(model).forward

    def forward_past_key_values(self, input_ids=None, attention_mask=None, position_ids=None,
                                past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
        assert "cache" not in kwargs, "the engine passed cache= to a forward that names it past_key_values"
        return original_forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                cache=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)

    monkeypatch.setattr(rotary, "forward", rotary_3d_only)
    monkeypatch.setattr(type(model), "forward", forward_past_key_values)
    result = DecodeEngine(model).generate(prompts, max_new_tokens=5, keep_logits=True)
    for old, new in zip(expected.rows, result.rows):
        assert torch.equal(old.token_ids, new.token_ids)
        torch.testing.assert_close(old.logits, new.logits, atol=1e-6, rtol=1e-6)
