"""Plotly figure builders carry the right numbers (no Jupyter needed)."""
from __future__ import annotations

import plotly.graph_objects as go
import pytest
import torch

from qwen_scope.compare import LayerComparison
from qwen_scope.explore import (comparison_figure, density_figure, histogram_figure, layer_range_figure,
                                logit_lens_figure, prompt_heatmap, token_features_figure)
from qwen_scope.features import LayerFeatures, TextFeatures

D_SAE, T = 32, 6


def layer_features(layer: int, seed: int) -> LayerFeatures:
    g = torch.Generator().manual_seed(seed)
    dense = torch.zeros(T, D_SAE)
    for t in range(T):
        ids = torch.randperm(D_SAE, generator=g)[:3]
        dense[t, ids] = torch.rand(3, generator=g) + 0.1
    dense[0, 31] = 50.0  # position 0 outlier, must not pick the features when skip_first
    values, indices = dense.topk(4, dim=1)
    return LayerFeatures(layer, values, indices, torch.ones(T), 0.9, 0.9, 1, D_SAE)


@pytest.fixture()
def feats():
    tokens = ["<s>", "The", " cat", " sat", " cat", "."]
    return TextFeatures("The cat sat cat.", torch.arange(T), tokens,
                        {2: layer_features(2, 0), 3: layer_features(3, 1)}, skip_first=True)


def test_prompt_heatmap_shows_top_features_by_max(feats):
    fig = prompt_heatmap(feats, 2, n_features=4, labels={int(feats[2].dense()[1:].max(0).values.argmax()): "cats"})
    assert isinstance(fig, go.Figure)
    heat = fig.data[0]
    dense = feats[2].dense()
    expected = dense[1:].max(0).values.topk(4).indices.tolist()
    assert [int(y.split()[0][1:]) for y in heat.y] == expected
    assert "cats" in heat.y[0]
    torch.testing.assert_close(torch.tensor(heat.z), dense[:, expected].T)
    assert list(fig.layout.xaxis.ticktext) == ["<s>", "The", " cat", " sat", " cat", "."]
    assert 31 not in expected or float(dense[1:, 31].max()) > 0
    assert "activation" in heat.hovertemplate


def test_prompt_heatmap_needs_a_layer_when_several(feats):
    with pytest.raises(ValueError, match="pass layer="):
        prompt_heatmap(feats)
    with pytest.raises(TypeError, match="TextFeatures"):
        prompt_heatmap(torch.zeros(3, 3))


def test_token_table_lists_each_tokens_top_features(feats):
    fig = token_features_figure(feats, 3, top=2)
    cells = fig.data[0].cells.values
    dense = feats[3].dense()
    for t in range(T):
        vals, ids = dense[t].topk(2)
        assert cells[2][t].startswith(f"#{int(ids[0])} ({float(vals[0]):.2f})")


def test_comparison_figure_bars_are_the_rates():
    rate_a = torch.zeros(D_SAE)
    rate_b = torch.zeros(D_SAE)
    rate_a[[1, 2]] = torch.tensor([0.9, 0.5])
    rate_b[[2, 7]] = torch.tensor([0.1, 0.6])
    lc = LayerComparison(4, 10, 10, rate_a, rate_b, rate_a.clone(), rate_b.clone())
    fig = comparison_figure(lc, n=3, names=("pos", "neg"))
    a, b = fig.data
    assert list(a.y) == ["#1", "#7", "#2"]
    assert list(a.x) == pytest.approx([0.9, 0.0, 0.5]) and list(b.x) == pytest.approx([0.0, 0.6, 0.1])
    assert a.name == "pos" and "rate diff +0.900" in a.customdata[0]


def test_layer_range_rows_are_per_layer_top_features(feats):
    fig = layer_range_figure(feats, [2, 3], per_layer=2)
    heat = fig.data[0]
    assert len(heat.y) == 4 and heat.y[0].startswith("L2 ") and heat.y[2].startswith("L3 ")
    f = int(heat.y[2].split("#")[1])
    torch.testing.assert_close(torch.tensor(heat.z[2]), feats[3].dense()[:, f])


class Card:
    feature = 7
    density = 0.01
    max = 3.0
    hist_edges = (0.1, 0.2, 0.4)
    hist_counts = (5, 2)
    logit_top = (("a", 1.5), ("b", 1.0))
    logit_bottom = (("z", -2.0), ("y", -1.0))


def test_histogram_and_logit_figures():
    h = histogram_figure(Card())
    assert list(h.data[0].y) == [5, 2] and h.layout.xaxis.type == "log"
    assert h.data[0].x[0] == pytest.approx((0.1 * 0.2) ** 0.5)
    lens = logit_lens_figure(Card())
    assert list(lens.data[0].x) == [-1.0, -2.0, 1.0, 1.5]


def test_density_figure_counts_live_features():
    class DB:
        density = torch.tensor([0.0, 0.1, 0.01, 0.0])
        n_tokens = 100

    fig = density_figure(DB())
    assert list(fig.data[0].x) == pytest.approx([-1.0, -2.0])
    assert fig.layout.title.text.startswith("2 live / 2 dead")
