"""The explorer inside Jupyter without a server: ``scope.explore(text)``.

With ipywidgets installed it is a live widget: one button per token (click: its features), one button per feature
(click: its card), steering sliders with a Generate button (the bench's side-by-side view). Without ipywidgets it
is the static view: the tokens coloured by their top feature, the per-token table and the card of the prompt's
strongest feature, as one ``HtmlView``.

    scope.explore("def close(self):")               # in a notebook cell
"""
from __future__ import annotations

import html

from qwen_scope.app.render import APP_CSS, steer_html, token_table_rows, token_view_html
from qwen_scope.app.session import AppSession
from qwen_scope.explore.html import HtmlView, feature_card_html

__all__ = ["explore", "static_view", "widget_view"]


def explore(scope, text: str, *, db=None, layer: int | None = None, widget: bool | None = None):
    """The explorer's views of ``text`` for a notebook.

    Args:
        scope: a ``Scope`` with SAEs attached.
        text: the prompt.
        db: a ``FeatureDatabase`` (or its directory) for cards and labels; default: cards from this prompt.
        layer: the SAE layer shown (default: the database's, else the middle loaded one).
        widget: True for the ipywidgets view (ImportError naming the install when missing), False for the static
            HTML, None (default) for the widget where ipywidgets imports.
    Returns:
        an ``ipywidgets.VBox`` or an ``HtmlView`` (HTML that Jupyter displays).
    """
    session = AppSession(scope, db, layer=layer)
    if widget is None:
        try:
            import ipywidgets  # noqa: F401
            widget = True
        except ImportError:
            widget = False
    return widget_view(session, text) if widget else static_view(session, text)


def static_view(session: AppSession, text: str) -> HtmlView:
    """Tokens coloured by their top feature, the per-token table and the card of the prompt's strongest feature."""
    view = session.analyze(text)
    rows = token_table_rows(view, session.label)
    body = "".join(f"<tr><td>{p}</td><td>{html.escape(tok)}</td><td>{html.escape(top)}</td><td>{v:.3f}</td>"
                   f"<td>{html.escape(rest)}</td></tr>" for p, tok, top, v, rest in rows)
    table = (f'<table class="qs-tab"><tr><th>pos</th><th>token</th><th>top feature</th><th>value</th>'
             f"<th>features</th></tr>{body}</table>")
    ranked = [(v, f) for f, v in zip(view.features[1:], view.values[1:]) if f >= 0]
    card = feature_card_html(session.card(max(ranked)[1])) if ranked else "<p>no feature is active</p>"
    return HtmlView(f'<div class="qs-card"><style>{APP_CSS}</style>{token_view_html(view)}{table}{card}</div>')


def widget_view(session: AppSession, text: str):
    """The live widget: token buttons → their features → the card; steering sliders → the bench."""
    try:
        import ipywidgets as w
    except ImportError:
        raise ImportError("the explore widget needs ipywidgets: pip install 'qwen-scope[app]' (or ipywidgets), "
                          "or pass widget=False for the static HTML view") from None

    view = session.analyze(text)
    d_sae = session.scope.sae(session.layer).d_sae
    tokens_html = w.HTML(token_view_html(view))
    features_box, card = w.HBox(layout=w.Layout(flex_flow="row wrap")), w.HTML()
    feature = w.BoundedIntText(value=max(view.features[0], 0), min=0, max=d_sae - 1, description="feature")
    strength = w.FloatSlider(value=20.0, min=-100.0, max=100.0, step=0.5, description="strength")
    positions = w.Text(value="all", description="positions")
    new_tokens = w.IntSlider(value=24, min=1, max=256, description="new tokens")
    generate, output = w.Button(description="Generate", button_style="primary"), w.HTML()

    def show_card(f: int) -> None:
        feature.value = f
        card.value = feature_card_html(session.card(f))

    def show_token(t: int) -> None:
        buttons = []
        for row in session.token_features(t):
            # Button descriptions are plain text: a hostile label or token cannot inject markup.
            b = w.Button(description=f"#{row.feature} {row.value:.2f} {row.label}"[:40], tooltip=row.label)
            b.on_click(lambda _, f=row.feature: show_card(f))
            buttons.append(b)
        features_box.children = buttons
        if buttons:
            show_card(session.token_features(t)[0].feature)

    def steer(_) -> None:
        edits = session.bench.edits([feature.value], strength.value, layer=session.layer,
                                    positions=positions.value or "all")
        for step in session.bench.stream(text, edits, max_new_tokens=new_tokens.value, template=session.template):
            output.value = steer_html(step)

    token_buttons = []
    for t, token in enumerate(view.tokens):
        b = w.Button(description=repr(token)[1:-1][:12] or "␣", tooltip=f"token {t}",
                     layout=w.Layout(width="auto"))
        b.on_click(lambda _, t=t: show_token(t))
        token_buttons.append(b)
    generate.on_click(steer)
    show_token(1 if len(view.tokens) > 1 else 0)
    return w.VBox([tokens_html, w.HBox(token_buttons, layout=w.Layout(flex_flow="row wrap")), features_box,
                   card, w.HBox([feature, strength]), w.HBox([positions, new_tokens, generate]), output])
