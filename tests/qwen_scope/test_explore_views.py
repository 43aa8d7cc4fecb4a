"""Weight views: the logit lens equals a hand computation through the final RMSNorm and lm_head; nearest features
and decoder norms equal direct formulas; token decoders behave."""
from __future__ import annotations

import pytest
import torch

from qwen_scope.explore import decoder_norms, feature_views, logit_lens, make_decoder, nearest_features
from saes import TopKSAE
from tests.factories import random_sae_state, tiny_model

# Qwen3.5 / Qwen3-Next normalise with (1 + weight) (zero-centred weights); Qwen3 with weight.
ZERO_CENTRED = {"qwen3": False, "qwen3_5": True, "qwen3_next": True}


def manual_logits(model, family: str, d: torch.Tensor) -> torch.Tensor:
    norm = model.model.norm
    eps = model.config.rms_norm_eps
    w = norm.weight.float()
    h = d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if ZERO_CENTRED[family] else w)
    return h @ model.lm_head.weight.float().T


@pytest.mark.parametrize("family", sorted(ZERO_CENTRED))
def test_logit_lens_equals_manual_computation(family):
    model = tiny_model(family)
    d = torch.randn(3, model.config.hidden_size)
    expected = manual_logits(model, family, d)
    for lens, row in zip(logit_lens(model, d, top=7), expected):
        top = row.topk(7)
        bottom = row.topk(7, largest=False)
        assert list(lens.top_ids) == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(lens.top_values), top.values, rtol=1e-5, atol=1e-5)
        assert list(lens.bottom_ids) == bottom.indices.tolist()
        torch.testing.assert_close(torch.tensor(lens.bottom_values), bottom.values, rtol=1e-5, atol=1e-5)
        assert sum(lens.hist_counts) == row.numel() and len(lens.hist_edges) == len(lens.hist_counts) + 1


def test_logit_lens_ranks_only_real_token_ids():
    """The unembedding is padded past the tokenizer (Qwen: 151936 rows for 151669 tokens); those ids are never
    listed: ``vocab=`` limits the ranking, a Scope limits it to its tokenizer by itself."""
    from qwen_scope.explore.views import vocab_limit

    model = tiny_model("qwen3_5")
    vocab = model.config.vocab_size
    d = torch.randn(4, model.config.hidden_size)
    full = manual_logits(model, "qwen3_5", d)
    for lens, row in zip(logit_lens(model, d, top=5, vocab=vocab - 7), full):
        assert max(lens.top_ids + lens.bottom_ids) < vocab - 7
        assert list(lens.top_ids) == row[:vocab - 7].topk(5).indices.tolist()
        assert sum(lens.hist_counts) == vocab - 7

    class Tok:
        def __len__(self):
            return vocab - 3

    class FakeScope:
        tokenizer = Tok()

    assert vocab_limit(FakeScope()) == vocab - 3 and vocab_limit(model) is None and vocab_limit(model, 9) == 9
    with pytest.raises(ValueError, match="positive"):
        vocab_limit(model, 0)


def test_feature_views_use_decoder_columns():
    model = tiny_model("qwen3_5")
    sae = TopKSAE.from_release_state(random_sae_state(d_sae=128, seed=3), k=8)
    with torch.no_grad():
        sae.W_dec.mul_(torch.linspace(0.5, 2.0, 128))
    views = feature_views(model, sae, [4, 77], top=5, n_neighbors=6)
    w = sae.W_dec.detach()
    for f in (4, 77):
        v = views[f]
        assert v.decoder_norm == pytest.approx(float(w[:, f].norm()), rel=1e-6)
        expected = manual_logits(model, "qwen3_5", w[:, f][None])[0].topk(5).indices.tolist()
        assert list(v.logits.top_ids) == expected
        cos = torch.nn.functional.cosine_similarity(w[:, f:f + 1], w, dim=0)
        cos[f] = -2
        assert list(v.neighbors) == cos.topk(6).indices.tolist()
        torch.testing.assert_close(torch.tensor(v.neighbor_cosines), cos.topk(6).values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decoder_norms(sae), w.norm(dim=0))
    assert nearest_features(sae, 4, n=6)[0][0] == list(views[4].neighbors)


def test_views_without_a_model_skip_the_lens():
    sae = TopKSAE.from_release_state(random_sae_state(d_sae=64), k=4)
    v = feature_views(None, sae, [1])[1]
    assert v.logits is None and len(v.neighbors) == 10


def test_logit_lens_rejects_wrong_width():
    with pytest.raises(ValueError, match="d_model=64"):
        logit_lens(tiny_model("qwen3"), torch.randn(2, 32))


def test_make_decoder_sources():
    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    class Scope:
        def decode_tokens(self, ids):
            return [f"<{i}>" for i in ids]

    assert make_decoder(None)([3, 4]) == ["⟨3⟩", "⟨4⟩"]
    assert make_decoder(Tok())([0, 2, 0]) == ["a", "c", "a"]
    assert make_decoder(Scope())([5]) == ["<5>"]
    assert make_decoder(lambda ids: ["x"] * len(ids))([1, 2]) == ["x", "x"]
    with pytest.raises(TypeError, match="make_decoder"):
        make_decoder(3)
