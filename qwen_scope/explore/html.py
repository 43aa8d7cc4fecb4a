"""Self-contained HTML: a feature card (also each card's ``_repr_html_``), and the dashboard — one page per
feature plus an index page with search by label, token or id. Opens from disk; no server, no network.

Layout written by :func:`write_dashboard` (``out`` a directory, or an ``.html`` file whose pages go beside it)::

    out/index.html            search + sortable table of features + feature-density overview
    out/features/123.html     one card per feature (pure HTML + CSS + inline SVG)
    out/json/123.json         the feature in the Neuronpedia-like shape (export.py)
    out/plotly.min.js         plotly's JS, written once from the installed plotly package
"""
from __future__ import annotations

import html
import json
import os
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path

from qwen_scope.explore.card import DecodedExample, FeatureCard, feature_card
from qwen_scope.explore.database import Example
from qwen_scope.explore.export import public_name, write_feature_json
from qwen_scope.explore.views import feature_views, make_decoder, vocab_limit

CSS = """
.qs-card{font-family:system-ui,sans-serif;font-size:14px;max-width:1100px;color:#222}
.qs-card h2{margin:4px 0}.qs-card h3{margin:14px 0 4px;font-size:15px}
.qs-label{color:#a63603;font-weight:normal}.qs-meta{color:#666;font-size:12px}
.qs-stats span{display:inline-block;margin-right:16px}.qs-row{display:flex;gap:28px;flex-wrap:wrap}
.qs-tab{border-collapse:collapse;font-size:13px}.qs-tab td,.qs-tab th{padding:1px 8px;text-align:left}
.qs-ex{font-family:ui-monospace,monospace;font-size:12.5px;white-space:pre-wrap;margin:2px 0;line-height:1.6}
.qs-ex .v{color:#666;display:inline-block;width:64px}
.qs-t{border-radius:2px}.qs-mark{outline:1.5px solid #a63603;font-weight:bold}
.qs-pos{color:#a63603}.qs-neg{color:#08519c}
"""


def _href(path: str) -> str:
    """A relative link for an attribute: percent-encoded, so a file name with quotes or angle brackets (a hostile
    dashboard name) can neither close the attribute nor break the link, then HTML-escaped."""
    return html.escape(urllib.parse.quote(path.replace(os.sep, "/")), quote=True)


def _meta_line(meta: dict) -> str:
    """The database's provenance for a page: local paths reduced to their last part (pages get shared)."""
    return ", ".join(f"{k}={public_name(v)}" for k, v in meta.items())


def _esc(s: str) -> str:
    return html.escape(s.replace("\n", "⏎").replace("\t", "⇥"))


def example_html(e: DecodedExample, scale: float) -> str:
    """One example: tokens coloured by this feature's activation (``/scale``), the activating token outlined."""
    spans = []
    for i, (s, v) in enumerate(zip(e.strings, e.example.values)):
        alpha = 0.0 if scale <= 0 else max(0.0, min(1.0, v / scale))
        cls = "qs-t qs-mark" if i == e.mark else "qs-t"
        spans.append(f'<span class="{cls}" style="background:rgba(230,85,13,{alpha:.2f})" '
                     f'title="{html.escape(repr(s))}: {v:.3f}">{_esc(s)}</span>')
    return f'<div class="qs-ex"><span class="v">{e.value:.3f}</span>{"".join(spans)}</div>'


def histogram_svg(card: FeatureCard, width: int = 360, height: int = 120) -> str:
    """The activation histogram as an inline SVG (log-spaced bins)."""
    counts = list(card.hist_counts)
    if not counts:
        return "<svg></svg>"
    top, n = max(counts), len(counts)
    w = width / n
    bar_w = max(w - 0.5, 0.5)
    bars = "".join(f'<rect x="{i * w:.1f}" y="{height - 16 - (height - 20) * c / top:.1f}" width="{bar_w:.1f}" '
                   f'height="{(height - 20) * c / top:.1f}" fill="#e6550d">'
                   f"<title>[{a:.3g}, {b:.3g}): {c}</title></rect>"
                   for i, (c, a, b) in enumerate(zip(counts, card.hist_edges, card.hist_edges[1:])))
    lo, hi = card.hist_edges[0], card.hist_edges[-1]
    axis = (f'<text x="0" y="{height - 2}" font-size="10">{lo:.3g}</text>'
            f'<text x="{width}" y="{height - 2}" font-size="10" text-anchor="end">{hi:.3g}</text>')
    return f'<svg width="{width}" height="{height}" role="img" aria-label="activation histogram">{bars}{axis}</svg>'


def _feature_links(ids: Iterable[int], values: Iterable[float], link: Callable[[int], str | None], fmt: str) -> str:
    cells = []
    for f, v in zip(ids, values):
        href = link(f)
        name = f'<a href="{href}">#{f}</a>' if href else f"#{f}"
        cells.append(f"<tr><td>{name}</td><td>{fmt.format(v)}</td></tr>")
    return '<table class="qs-tab">' + "".join(cells) + "</table>"


def feature_card_html(card: FeatureCard, *, link: Callable[[int], str | None] = lambda f: None) -> str:
    """The card as an HTML fragment with its own CSS (for Jupyter and for dashboard pages).

    Args:
        card: the :class:`FeatureCard`.
        link: href of another feature's page, or None for no link.
    """
    meta = card.meta
    where = " · ".join(f"{k} {html.escape(str(public_name(meta[k])))}" for k in ("model", "point", "layer", "release")
                       if k in meta)
    view = card.view
    stats = [f"density {card.density:.3%}", f"fires on {card.count} of {card.n_tokens} tokens",
             f"max {card.max:.3f}", f"mean {card.mean:.3f}"]
    if view is not None:
        stats.append(f"decoder norm {view.decoder_norm:.3f}")
    logits = ""
    if card.logit_top:
        rows = "".join(f'<tr><td class="qs-pos">{_esc(a)}</td><td>{va:+.3f}</td><td class="qs-neg">{_esc(b)}</td>'
                       f"<td>{vb:+.3f}</td></tr>" for (a, va), (b, vb) in zip(card.logit_top, card.logit_bottom))
        logits = ('<div><h3>Logit lens</h3><table class="qs-tab"><tr><th>promoted</th><th></th><th>suppressed</th>'
                  f"<th></th></tr>{rows}</table></div>")
    near = ""
    if view is not None and view.neighbors:
        near = ("<div><h3>Nearest by decoder cosine</h3>"
                + _feature_links(view.neighbors, view.neighbor_cosines, link, "{:.3f}") + "</div>")
    cooc = ""
    if card.cooccurring:
        cooc = ("<div><h3>Co-occurring (Jaccard)</h3>"
                + _feature_links([c.other for c in card.cooccurring], [c.jaccard for c in card.cooccurring], link,
                                 "{:.3f}") + "</div>")
    top = "".join(example_html(e, card.max) for e in card.top) or "<p>never fires</p>"
    bins = ""
    for b, examples in reversed(card.bins):
        bins += (f'<div class="qs-meta">interval [{b.lo:.3f}, {b.hi:.3f}] · ~{b.contains:.0%} of firings</div>'
                 + "".join(example_html(e, card.max) for e in examples))
    label = f' <span class="qs-label">{html.escape(card.label)}</span>' if card.label else ""
    notes = f"<p>{html.escape(card.notes)}</p>" if card.notes else ""
    if card.explanation is not None:
        auto, score = card.explanation, card.explanation["detection_auroc"]
        notes += (f'<p class="qs-meta">explanation ({html.escape(auto["explainer"])}'
                  + (f", detection AUROC {score:.2f}" if score is not None else "")
                  + f'): {html.escape(auto["text"])}</p>')
    return (f'<div class="qs-card"><style>{CSS}</style><h2>Feature #{card.feature}{label}</h2>'
            f'<div class="qs-meta">{where}</div>{notes}'
            f'<div class="qs-stats">{"".join(f"<span>{s}</span>" for s in stats)}</div>'
            f'<div class="qs-row">{logits}<div><h3>Activation histogram</h3>{histogram_svg(card)}</div>'
            f"{near}{cooc}</div><h3>Top activations</h3>{top}"
            + (f"<h3>Samples by activation quantile</h3>{bins}" if bins else "") + "</div>")


class HtmlView(str):
    """An HTML string that Jupyter displays as HTML (``_repr_html_``); ``str`` everywhere else."""

    def _repr_html_(self) -> str:
        return str(self)


def feature_on_text(feats, layer: int, feature: int, *, scale: float | None = None) -> HtmlView:
    """"Test your own text": the tokens of a text coloured by one feature's activation (Neuronpedia's test box).

    Args:
        feats: ``TextFeatures`` from ``scope.features(text, layers)``.
        layer: the SAE layer.
        feature: feature id.
        scale: activation shown at full colour (default: the feature's max on this text; pass ``db.act_max[f]``
            to compare with the corpus).
    Returns:
        an :class:`HtmlView` (displays in Jupyter; a plain HTML string otherwise).
    """
    values = feats[layer].dense()[:, int(feature)]
    top = float(values.max()) if scale is None else float(scale)
    mark = int(values.argmax()) if float(values.max()) > 0 else -1
    example = DecodedExample(Example(int(feature), float(values.max()), -1, tuple(feats.token_ids.tolist()),
                                     tuple(values.tolist()), mark), tuple(feats.tokens))
    return HtmlView(f'<div class="qs-card"><style>{CSS}</style><div class="qs-meta">feature #{int(feature)} at '
                    f"layer {layer}; max {float(values.max()):.3f} (value column), full colour at {top:.3f}</div>"
                    f"{example_html(example, top)}</div>")


def database_summary_html(db) -> str:
    """A short HTML summary of a database (its ``_repr_html_``): size, provenance, the top features by max."""
    rows = "".join(f"<tr><td>#{f}</td><td>{html.escape(db.label(f))}</td><td>{float(db.density[f]):.3%}</td>"
                   f"<td>{float(db.act_max[f]):.3f}</td></tr>" for f in db.top_features(10))
    alive = int((db.count > 0).sum())
    meta = html.escape(_meta_line(db.meta))
    return (f'<div class="qs-card"><style>{CSS}</style><b>FeatureDatabase</b> · {db.d_sae} features ({alive} live) '
            f"over {db.n_tokens} tokens · {meta}<table class='qs-tab'><tr><th>feature</th><th>label</th>"
            f"<th>density</th><th>max</th></tr>{rows}</table></div>")


_INDEX_JS = """
const data = JSON.parse(document.getElementById('qs-data').textContent);
const body = document.getElementById('qs-rows'), box = document.getElementById('qs-q');
let key = 'max', desc = true;
function esc(s){return s.replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));}
function render(){
  const q = box.value.trim().toLowerCase();
  const rows = data.filter(d => !q || String(d.id) === q || d.label.toLowerCase().includes(q)
      || d.notes.toLowerCase().includes(q) || d.explanation.toLowerCase().includes(q)
      || d.tokens.some(t => t.toLowerCase().includes(q))
      || d.logits.some(t => t.toLowerCase().includes(q)));
  rows.sort((a, b) => (a[key] < b[key] ? -1 : a[key] > b[key] ? 1 : 0) * (desc ? -1 : 1));
  body.innerHTML = rows.map(d => `<tr><td><a href="${d.href}">#${d.id}</a></td><td>${esc(d.label || d.explanation)}</td>`
    + `<td>${(100 * d.density).toFixed(3)}%</td><td>${d.max.toFixed(3)}</td>`
    + `<td class="qs-ex">${esc(d.tokens.slice(0, 5).map(t => JSON.stringify(t)).join(' '))}</td>`
    + `<td class="qs-ex">${esc(d.logits.slice(0, 5).map(t => JSON.stringify(t)).join(' '))}</td></tr>`).join('');
  document.getElementById('qs-count').textContent = rows.length + ' of ' + data.length + ' features';
}
document.querySelectorAll('th[data-k]').forEach(th => th.onclick = () => {
  desc = key === th.dataset.k ? !desc : true; key = th.dataset.k; render(); });
box.oninput = render; render();
"""


def _index_html(title: str, entries: list[dict], db, plotly_src: str) -> str:
    from qwen_scope.explore.figures import density_figure

    fig = density_figure(db).to_html(full_html=False, include_plotlyjs=False, default_height="300px")
    # Every "<" as \u003c: "</script>" would close the element and "<!--<script>" (an HTML feature's tokens or
    # a label) would put the HTML parser in the double-escaped state where the closing tag no longer counts.
    payload = json.dumps(entries, ensure_ascii=False).replace("<", "\\u003c")
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<script src="{_href(plotly_src)}"></script><style>{CSS} body{{margin:16px}} th[data-k]{{cursor:pointer}}'
            f"</style></head><body><div class='qs-card'><h2>{html.escape(title)}</h2>"
            f'<div class="qs-meta">{html.escape(_meta_line(db.meta))}</div>'
            f'<p><input id="qs-q" size="40" placeholder="search label, explanation, token or feature id"> '
            f'<span id="qs-count" class="qs-meta"></span></p>'
            f'<table class="qs-tab"><thead><tr><th data-k="id">feature</th><th data-k="label">label</th>'
            f'<th data-k="density">density</th><th data-k="max">max</th><th>top tokens</th><th>logit lens</th>'
            f'</tr></thead><tbody id="qs-rows"></tbody></table>{fig}</div>'
            f'<script type="application/json" id="qs-data">{payload}</script><script>{_INDEX_JS}</script>'
            f"</body></html>")


def write_dashboard(db, out: str | Path, *, scope=None, layer: int | None = None, model=None, sae=None,
                    decode=None, features: Iterable[int] | None = None, max_features: int = 1000,
                    title: str | None = None, export_json: bool = True) -> Path:
    """Write the HTML dashboard of a feature database.

    Args:
        db: the :class:`FeatureDatabase`.
        out: a directory (gets ``index.html``) or an ``.html`` path for the index (pages go in ``<stem>_files/``).
        scope: a ``Scope``: model, tokenizer and (at ``layer`` or ``db.meta["layer"]``) the SAE.
        layer: the SAE layer when ``scope`` holds several.
        model, sae: instead of ``scope``; without an SAE the pages have no logit lens / nearest features.
        decode: token decoder (default from ``scope``).
        features: which features get pages (default: the ``max_features`` live features with the largest max).
        max_features: cap on the default selection.
        title: page title.
        export_json: also write each feature's Neuronpedia-like JSON.
    Returns:
        the path of the index page.

    Example:
        >>> write_dashboard(db, "runs/dashboard", scope=scope)   # then open runs/dashboard/index.html
    """
    import plotly.offline

    out = Path(out)
    index, assets = ((out, out.parent / f"{out.stem}_files") if out.suffix == ".html" else (out / "index.html", out))
    (assets / "features").mkdir(parents=True, exist_ok=True)
    if layer is None:
        layer = db.meta.get("layer")
    if scope is not None:
        model = model if model is not None else scope.model
        if sae is None and layer is not None and int(layer) in scope.saes:
            sae = scope.sae(int(layer))
    decode = make_decoder(decode if decode is not None else scope)
    chosen = list(features) if features is not None else db.top_features(max_features)
    vocab = vocab_limit(scope) if scope is not None else None
    views = feature_views(model, sae, chosen, vocab=vocab) if sae is not None else {}
    plotly_js = assets / "plotly.min.js"
    if not plotly_js.exists():
        plotly_js.write_text(plotly.offline.get_plotlyjs(), encoding="utf-8")
    on_page = set(chosen)
    index_rel = os.path.relpath(index, assets / "features")
    entries = []
    for f in chosen:
        card = feature_card(db, f, decode=decode, view=views.get(f))
        page = assets / "features" / f"{f}.html"
        body = feature_card_html(card, link=lambda g: f"{g}.html" if g in on_page else None)
        page.write_text(f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>Feature #{f}</title></head>'
                        f'<body><p><a href="{_href(index_rel)}">← all features</a></p>{body}</body></html>',
                        encoding="utf-8")
        if export_json:
            write_feature_json(card, assets / "json" / f"{f}.json")
        entries.append({"id": f, "label": card.label, "notes": card.notes, "density": card.density,
                        "explanation": card.explanation["text"] if card.explanation else "",
                        "max": card.max, "href": _href(os.path.relpath(page, index.parent)),
                        "tokens": [e.strings[e.mark] for e in card.top],
                        "logits": [s for s, _ in card.logit_top]})
    title = title or (f"Features of {public_name(db.meta.get('model', 'the model'))} at "
                      f"{db.meta.get('point', f'layer {layer}')}")
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(_index_html(title, entries, db, os.path.relpath(plotly_js, index.parent)), encoding="utf-8")
    return index
