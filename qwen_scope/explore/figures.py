"""Plotly figure builders: prompt heatmap, per-token top features, two-text comparison, layer-range view,
activation histogram, logit lens, feature-density overview. Each returns a ``plotly.graph_objects.Figure``
(shows itself in Jupyter, and in the notebook's HTML export; ``fig.write_html(path)`` for a file) and is tested
without Jupyter.

    feats = scope.features("The Eiffel Tower is in Paris", layers=[3, 4])
    prompt_heatmap(feats, 3)
    comparison_figure(scope.compare("I love it", "I hate it", layers=[3]))
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import plotly.graph_objects as go
import plotly.io as pio
import torch
from plotly.subplots import make_subplots

_COLORS = "Oranges"
# What plotly picks in a Jupyter kernel, and what this module makes of it (see _embed_in_exported_html).
_KERNEL_DEFAULT, NOTEBOOK_RENDERER = "plotly_mimetype", "plotly_mimetype+notebook_connected"


def _embed_in_exported_html() -> None:
    """In a Jupyter kernel plotly renders figures as its mimetype only, which JupyterLab draws but nbconvert's HTML
    export and nbviewer leave blank. Add ``notebook_connected``: beside it, a text/html copy that loads plotly.js from
    its CDN (one script tag, rather than 4.6 MB inlined into every notebook). Only plotly's own kernel default is
    changed: a renderer the user chose (``PLOTLY_RENDERER``, or set before this import) and every renderer outside
    Jupyter stay as they are."""
    if not os.environ.get("PLOTLY_RENDERER") and pio.renderers.default == _KERNEL_DEFAULT:
        pio.renderers.default = NOTEBOOK_RENDERER


_embed_in_exported_html()


def _layer_codes(feats, layer: int | None) -> tuple[list[str], torch.Tensor, int]:
    """(tokens, dense codes [T, d_sae], first statistics position) from a ``TextFeatures`` at ``layer``."""
    layers = getattr(feats, "layers", None)
    if not isinstance(layers, Mapping):
        raise TypeError(f"expected the TextFeatures of scope.features(...), got {type(feats).__name__}")
    if layer is None:
        if len(layers) != 1:
            raise ValueError(f"these features cover layers {sorted(layers)}; pass layer=")
        layer = next(iter(layers))
    lf = feats[layer]
    first = lf.first if feats.skip_first else 0
    return list(feats.tokens), lf.dense(), first


def _top_features(dense: torch.Tensor, first: int, n: int, by: str) -> list[int]:
    part = dense[first:] if dense.shape[0] > first else dense
    score = {"max": part.max(0).values, "mean": part.mean(0), "rate": (part > 0).float().mean(0)}
    if by not in score:
        raise ValueError(f"by must be one of {sorted(score)}, got {by!r}")
    s = score[by].masked_fill(part.max(0).values <= 0, float("-inf"))
    n = min(n, int((part.max(0).values > 0).sum()))
    return s.topk(n).indices.tolist()


def _feature_name(f: int, labels: Mapping[int, str] | None) -> str:
    label = (labels or {}).get(f, "")
    return f"#{f} {label}".strip()


def _token_axis(fig: go.Figure, tokens: list[str], **kw) -> None:
    # Numeric x with token tick labels: repeated tokens stay separate columns.
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(tokens))), ticktext=[repr(t)[1:-1] for t in tokens],
                     tickangle=-60, **kw)


def prompt_heatmap(feats, layer: int | None = None, *, n_features: int = 20, by: str = "max",
                   labels: Mapping[int, str] | None = None) -> go.Figure:
    """Tokens × top features of a text at one layer; hover shows token, feature and activation.

    Args:
        feats: ``TextFeatures`` from ``scope.features(text, layers)``.
        layer: the layer (optional when ``feats`` has one).
        n_features: features shown (rows), chosen by ``by`` over the statistics positions.
        by: ``"max"``, ``"mean"`` or ``"rate"``.
        labels: ``{feature: label}`` for the row names (e.g. ``db.labels`` flattened).
    Returns:
        a Figure with one ``Heatmap`` trace, z ``[n_features, T]``.
    """
    tokens, dense, first = _layer_codes(feats, layer)
    ids = _top_features(dense, first, n_features, by)
    z = dense[:, ids].T.tolist() if ids else [[0.0] * len(tokens)]
    names = [_feature_name(f, labels) for f in ids]
    text = [[repr(t)[1:-1] for t in tokens] for _ in (ids or [0])]
    fig = go.Figure(go.Heatmap(z=z, y=names, x=list(range(len(tokens))), text=text, colorscale=_COLORS,
                               hovertemplate="token %{x}: %{text}<br>%{y}<br>activation %{z:.3f}<extra></extra>"))
    _token_axis(fig, tokens)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_layout(title=f"Top {len(ids)} features by {by}" + (f" at layer {layer}" if layer is not None else ""),
                      height=180 + 22 * max(len(ids), 1))
    return fig


def token_features_figure(feats, layer: int | None = None, *, top: int = 5,
                          labels: Mapping[int, str] | None = None) -> go.Figure:
    """A table: one row per token with its top ``top`` features and values.

    Returns:
        a Figure with one ``Table`` trace (columns: position, token, features).
    """
    tokens, dense, _ = _layer_codes(feats, layer)
    rows = []
    for t in range(len(tokens)):
        vals, ids = dense[t].topk(min(top, dense.shape[1]))
        rows.append(", ".join(f"{_feature_name(int(f), labels)} ({float(v):.2f})"
                              for v, f in zip(vals, ids) if v > 0))
    fig = go.Figure(go.Table(columnwidth=[1, 3, 12],
                             header=dict(values=["pos", "token", f"top {top} features (activation)"]),
                             cells=dict(values=[list(range(len(tokens))), [repr(t) for t in tokens], rows],
                                        align="left")))
    fig.update_layout(title="Per-token top features", height=120 + 28 * len(tokens))
    return fig


def comparison_figure(comparison, layers: int | Iterable[int] | None = None, *, n: int = 15,
                      names: tuple[str, str] = ("text A", "text B"),
                      labels: Mapping[int, str] | None = None) -> go.Figure:
    """Features ranked by activation-rate difference between two texts (the official demo's view).

    Args:
        comparison: a ``Comparison`` from ``scope.compare(a, b, layers)`` (or one ``LayerComparison``).
        layers: which of its layers (default all), one subplot each.
        n: features per layer.
        names: legend names of the two sides.
    Returns:
        a Figure with two grouped bars (rate in A, rate in B) per layer and the difference in the hover.
    """
    per_layer = comparison.layers if hasattr(comparison, "layers") else {comparison.layer: comparison}
    chosen = sorted(per_layer) if layers is None else ([layers] if isinstance(layers, int) else list(layers))
    fig = make_subplots(rows=len(chosen), cols=1, subplot_titles=[f"layer {layer}" for layer in chosen],
                        vertical_spacing=0.25 / max(len(chosen), 1))
    for row, layer in enumerate(chosen, start=1):
        diffs = per_layer[layer].ranked(n)
        ys = [_feature_name(d.feature, labels) for d in diffs]
        hover = [f"rate diff {d.diff:+.3f}<br>mean {d.mean_a:.3f} vs {d.mean_b:.3f}" for d in diffs]
        for side, (name, color) in enumerate(zip(names, ("#d95f02", "#1b9e77"))):
            fig.add_trace(go.Bar(y=ys, x=[d.rate_a if side == 0 else d.rate_b for d in diffs], orientation="h",
                                 name=name, marker_color=color, legendgroup=name, showlegend=row == 1,
                                 customdata=hover, hovertemplate="%{y}: rate %{x:.3f}<br>%{customdata}<extra>"
                                 + name + "</extra>"), row=row, col=1)
        fig.update_yaxes(autorange="reversed", type="category", row=row, col=1)
        fig.update_xaxes(title_text="activation rate (fraction of tokens)", row=row, col=1)
    fig.update_layout(barmode="group", title="Features by activation-rate difference",
                      height=140 + 28 * n * len(chosen))
    return fig


def layer_range_figure(feats, layers: Iterable[int] | None = None, *, per_layer: int = 5, by: str = "max",
                       labels: Mapping[int, str] | None = None) -> go.Figure:
    """The top features of a text across a range of layers: rows ``L{layer} #{feature}``, columns tokens.

    Returns:
        a Figure with one ``Heatmap`` trace, z ``[len(layers) * per_layer, T]``.
    """
    chosen = sorted(feats.layers) if layers is None else list(layers)
    z, names, tokens = [], [], list(feats.tokens)
    for layer in chosen:
        _, dense, first = _layer_codes(feats, layer)
        for f in _top_features(dense, first, per_layer, by):
            z.append(dense[:, f].tolist())
            names.append(f"L{layer} {_feature_name(f, labels)}")
    text = [[repr(t)[1:-1] for t in tokens] for _ in (names or [0])]
    fig = go.Figure(go.Heatmap(z=z or [[0.0] * len(tokens)], y=names or [""], x=list(range(len(tokens))), text=text,
                               colorscale=_COLORS,
                               hovertemplate="token %{x}: %{text}<br>%{y}<br>activation %{z:.3f}<extra></extra>"))
    _token_axis(fig, tokens)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_layout(title=f"Top {per_layer} features per layer, layers {chosen[0]}–{chosen[-1]}" if chosen else "",
                      height=180 + 22 * max(len(names), 1))
    return fig


def histogram_figure(card) -> go.Figure:
    """Activation histogram of a ``FeatureCard`` (log-spaced bins, log x axis), density in the title."""
    edges, counts = list(card.hist_edges), list(card.hist_counts)
    centres = [(a * b) ** 0.5 for a, b in zip(edges, edges[1:])]
    widths = [b - a for a, b in zip(edges, edges[1:])]
    fig = go.Figure(go.Bar(x=centres, y=counts, width=widths, marker_color="#e6550d",
                           customdata=list(zip(edges, edges[1:])),
                           hovertemplate="[%{customdata[0]:.3g}, %{customdata[1]:.3g}): %{y}<extra></extra>"))
    fig.update_xaxes(type="log", title_text="activation")
    fig.update_yaxes(title_text="tokens")
    fig.update_layout(title=f"Feature #{card.feature}: density {card.density:.3%}, max {card.max:.3g}",
                      height=300, bargap=0)
    return fig


def logit_lens_figure(card) -> go.Figure:
    """Top (promoted) and bottom (suppressed) tokens of a ``FeatureCard``'s logit lens as bars."""
    pairs = list(card.logit_bottom)[::-1] + list(card.logit_top)[::-1]
    fig = go.Figure(go.Bar(x=[v for _, v in pairs], y=[f"{repr(s)} " for s, _ in pairs], orientation="h",
                           marker_color=["#3182bd" if v < 0 else "#e6550d" for _, v in pairs],
                           hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_layout(title=f"Feature #{card.feature}: logit lens (final norm + unembedding)",
                      height=120 + 20 * max(len(pairs), 1))
    fig.update_yaxes(type="category")
    return fig


def density_figure(db) -> go.Figure:
    """Histogram of log10(feature density) over the database's live features, with the dead count."""
    density = db.density
    live = density[density > 0]
    fig = go.Figure(go.Histogram(x=torch.log10(live).tolist(), nbinsx=40, marker_color="#756bb1",
                                 hovertemplate="log10 density %{x}: %{y} features<extra></extra>"))
    fig.update_xaxes(title_text="log10(fraction of tokens where the feature fires)")
    fig.update_layout(title=f"{live.numel()} live / {density.numel() - live.numel()} dead features over "
                            f"{db.n_tokens} tokens", height=300)
    return fig
