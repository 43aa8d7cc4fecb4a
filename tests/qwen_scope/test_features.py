"""Features of a text are the SAE codes of the captured residual; statistics leave position 0 out by default."""
from __future__ import annotations

import pytest
import torch

from hooks import capture
from tests.qwen_scope.scope_helpers import tiny_scope

TEXT = "Paris is in France."


def _resid(scope, layer, text=TEXT):
    with torch.no_grad(), capture(scope.model, [f"resid_post.{layer}"]) as cap:
        scope.model(input_ids=scope.tokenize(text), use_cache=False)
    return cap[f"resid_post.{layer}"][0]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_next"])
def test_codes_are_the_sae_encoding_of_the_captured_residual(family):
    scope = tiny_scope(family, layers=(1, 3))
    feats = scope.features(TEXT)
    assert feats.tokens == list(TEXT) and feats.token_ids.tolist() == list(TEXT.encode())
    for layer in (1, 3):
        codes = scope.sae(layer).encode_sparse(_resid(scope, layer))
        assert torch.equal(feats[layer].values, codes.values)
        assert torch.equal(feats[layer].indices, codes.indices)
        assert feats[layer].values.shape == (len(TEXT), 8)
        assert feats.token_top(layer, 4)[0] == (int(codes.indices[4, 0]), float(codes.values[4, 0]))


def test_fve_and_cosine_leave_position_0_out_by_default():
    scope = tiny_scope(layers=(2,))
    sae, x = scope.sae(2), _resid(scope, 2)
    recon = sae(x)

    def fve(x, r):
        return float(1 - (x - r).pow(2).sum() / (x - x.mean(0)).pow(2).sum())

    cos = torch.nn.functional.cosine_similarity(x, recon, dim=-1)
    skipped, kept = scope.features(TEXT)[2], scope.features(TEXT, skip_first=False)[2]
    assert skipped.fve == pytest.approx(fve(x[1:], recon[1:]), abs=1e-5)
    assert kept.fve == pytest.approx(fve(x, recon), abs=1e-5)
    assert skipped.cosine == pytest.approx(float(cos[1:].mean()), abs=1e-5)
    torch.testing.assert_close(skipped.cosine_per_token, cos)
    assert skipped.fve != pytest.approx(kept.fve)


def test_statistics_skip_position_0_but_its_codes_stay_available():
    scope = tiny_scope(layers=(1,))
    feats = scope.features(TEXT)
    lf = feats[1]
    only_first = set(lf.indices[0].tolist()) - set(lf.indices[1:].flatten().tolist())
    assert only_first, "the random SAE should have a feature active only at position 0"
    f = only_first.pop()
    everything = {s.feature for s in feats.top(1, n=10_000)}
    assert f not in everything
    assert f in {s.feature for s in feats.top(1, n=10_000, include_first=True)}
    assert feats.token_top(1, 0)  # position 0 itself is still reported


def test_top_features_aggregate_max_mean_and_rate_over_kept_positions():
    scope = tiny_scope(layers=(1,))
    feats = scope.features(TEXT)
    dense = feats[1].dense()[1:]
    for stat in feats.top(1, n=5, by="mean"):
        col = dense[:, stat.feature]
        assert stat.max == pytest.approx(float(col.max()))
        assert stat.mean == pytest.approx(float(col.mean()))
        assert stat.rate == pytest.approx(float((col > 0).float().mean()))
    means = [s.mean for s in feats.top(1, n=20, by="mean")]
    assert means == sorted(means, reverse=True)
    with pytest.raises(ValueError, match="by must be"):
        feats.top(1, by="median")


def test_dense_view_on_request_matches_the_sparse_codes():
    scope = tiny_scope(layers=(1,))
    dense = scope.features(TEXT, dense=True)[1]
    sparse = scope.features(TEXT)[1]
    assert dense.dense_codes is not None and sparse.dense_codes is None
    assert torch.equal(dense.dense(), sparse.dense())
    assert dense.dense().shape == (len(TEXT), 256)
    assert (dense.dense() > 0).sum(-1).le(8).all()


def test_table_lists_every_token_and_unknown_layer_is_named():
    scope = tiny_scope(layers=(1,))
    feats = scope.features(TEXT, top_k=3)
    assert feats[1].values.shape == (len(TEXT), 3)
    assert len(feats.table(1).splitlines()) == len(TEXT) + 1
    with pytest.raises(KeyError, match=r"computed layers are \[1\]"):
        feats[2]
    with pytest.raises(KeyError, match="no SAE at layer 3"):
        scope.features(TEXT, layers=[3])


def test_features_command_prints_tokens_and_writes_json(tmp_path, capsys):
    import json

    from qwen_scope.cli import main
    from tests.qwen_scope.scope_helpers import write_tiny_checkpoint

    model_dir, release_dir = write_tiny_checkpoint(tmp_path)
    out = tmp_path / "feats.json"
    assert main(["features", "--model", str(model_dir), "--release", str(release_dir), "--layers", "1-2",
                 "--text", "hello", "--top", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layer 1: FVE" in printed and "layer 2: FVE" in printed and "'h'" in printed
    data = json.loads(out.read_text())
    assert data["tokens"] == list("hello") and set(data["layers"]) == {"1", "2"}
    assert all(len(t) == 3 for t in data["layers"]["1"]["per_token"])
    assert main(["features", "--model", str(model_dir), "--release", str(release_dir), "--layers", "1",
                 "--text", "hello there", "--versus", "bye now"]) == 0
    assert "rate_a" in capsys.readouterr().out


def test_table_of_a_one_token_text_does_not_claim_position_0_was_excluded():
    scope = tiny_scope(layers=(1,))
    feats = scope.features("a", layers=1)
    assert feats[1].first == 0
    assert "excluded" not in feats.table(1).splitlines()[0]
    longer = scope.features("ab", layers=1)
    assert longer[1].first == 1 and "(position 0 excluded)" in longer.table(1).splitlines()[0]


def test_negative_top_k_is_refused_instead_of_dropping_the_last_feature():
    scope = tiny_scope(layers=(1,))
    with pytest.raises(ValueError, match="top_k must be >= 0.*got -1"):
        scope.features("abc", layers=1, top_k=-1)
    assert scope.features("abc", layers=1, top_k=3)[1].values.shape == (3, 3)


def test_top_include_first_false_leaves_position_0_out_even_when_computed_with_skip_first_false():
    scope = tiny_scope(layers=(1,))
    kept = scope.features("abcd", layers=1, skip_first=False)
    skipped = scope.features("abcd", layers=1, skip_first=True)
    assert kept.top(1, 50, include_first=False) == skipped.top(1, 50)
    assert all(s.count <= 3 for s in kept.top(1, 50, include_first=False))
    assert kept.top(1, 50) == skipped.top(1, 50, include_first=True)
    assert max(s.count for s in kept.top(1, 50)) == 4
