"""HTML and table rows of the explorer's views, shared by the browser app and the Jupyter widget.

Every text shown (tokens, labels, generations) is data: it passes through ``html.escape`` here, so a token such as
``<img src=x onerror=alert(1)>`` renders as those characters and runs nothing.

    token_view_html(session.analyze("def close(self):"))
    steer_html(session.bench.run("def ", edits))
"""
from __future__ import annotations

import html

from qwen_scope.app.bench import SteerView
from qwen_scope.app.session import FeatureRow, PromptView
from qwen_scope.explore.html import CSS

__all__ = ["token_view_html", "token_table_rows", "feature_rows", "steer_html", "steer_rows", "APP_CSS"]

APP_CSS = CSS + """
.qs-tok{font-family:ui-monospace,monospace;font-size:14px;line-height:1.9;white-space:pre-wrap}
.qs-tok span{border-radius:3px;padding:1px 0;cursor:pointer}
.qs-side{display:flex;gap:24px}.qs-side>div{flex:1}
.qs-diff{outline:1.5px solid #756bb1}
"""


def _show(token: str) -> str:
    """A token as visible text: newlines and tabs as symbols, then escaped."""
    return html.escape(token.replace("\n", "⏎").replace("\t", "⇥"))


def _hue(feature: int) -> int:
    # A fixed, well-spread hue per feature id (golden-angle steps), so one feature keeps its colour across prompts.
    return int(feature * 137.508) % 360


def token_view_html(view: PromptView) -> str:
    """The prompt's tokens as coloured spans: intensity = activation / ``view.scale``; hue = the feature (one hue
    when coloured by one feature). Each span carries ``data-position`` and a title naming feature and value."""
    spans = []
    for t, (token, f, v) in enumerate(zip(view.tokens, view.features, view.values)):
        alpha = 0.0 if f < 0 or view.scale <= 0 else max(0.0, min(1.0, v / view.scale))
        hue = 24 if view.coloured_by is not None else _hue(f)
        title = f"{t}: {token!r}" + (f" · #{f} = {v:.3f}" if f >= 0 else " · no feature active")
        spans.append(f'<span data-position="{t}" style="background:hsla({hue},85%,55%,{alpha:.2f})" '
                     f'title="{html.escape(title, quote=True)}">{_show(token)}</span>')
    what = (f"feature #{view.coloured_by}" if view.coloured_by is not None else "each token's top feature")
    head = (f'<div class="qs-meta">layer {view.layer} · coloured by {html.escape(what)} · full colour at '
            f"{view.scale:.3f}</div>")
    return f'<div class="qs-card"><style>{APP_CSS}</style>{head}<div class="qs-tok">{"".join(spans)}</div></div>'


def token_table_rows(view: PromptView, labels=None) -> list[list]:
    """Rows ``[position, token, top feature, value, features]`` of the per-token table (``labels``:
    ``label(feature) -> str`` for the top feature's name)."""
    rows = []
    for t, (token, pairs) in enumerate(zip(view.tokens, view.table)):
        f, v = pairs[0] if pairs else (-1, 0.0)
        name = f"#{f}" + (f" {labels(f)}" if labels and f >= 0 and labels(f) else "") if f >= 0 else ""
        rest = ", ".join(f"#{g} {w:.2f}" for g, w in pairs)
        rows.append([t, repr(token), name, round(v, 4), rest])
    return rows


def feature_rows(rows: list[FeatureRow]) -> list[list]:
    """Rows ``[feature, value, label]`` of a feature list (a token's features, search hits)."""
    return [[r.feature, round(r.value, 4), r.label] for r in rows]


def steer_rows(view: SteerView) -> list[list]:
    """Rows ``[step, baseline token, p, steered token, p]`` (probabilities once the generation is done)."""
    base, steered = view.baseline, view.steered
    rows = []
    for i in range(max(len(base.tokens), len(steered.tokens))):
        def cell(side, i=i):
            token = repr(side.tokens[i]) if i < len(side.tokens) else ""
            p = round(side.probs[i], 4) if side.probs is not None and i < len(side.probs) else None
            return [token, p]

        rows.append([i, *cell(base), *cell(steered)])
    return rows


def steer_html(view: SteerView) -> str:
    """Baseline and steered continuations side by side; steered tokens that differ from the baseline outlined."""
    def side(name: str, tokens, other) -> str:
        spans = "".join(f'<span class="{"qs-diff" if i >= len(other) or other[i] != tok else ""}">{_show(tok)}'
                        "</span>" if name == "steered" else f"<span>{_show(tok)}</span>"
                        for i, tok in enumerate(tokens))
        return f'<div><h3>{name}</h3><div class="qs-tok">{spans}</div></div>'

    edits = "; ".join(f"L{e.layer} #{e.feature} {e.mode} {e.value:g} at {e.positions}" for e in view.edits)
    state = "done" if view.done else "generating…"
    return (f'<div class="qs-card"><style>{APP_CSS}</style><div class="qs-meta">{html.escape(edits)} · '
            f"{html.escape(view.generated_by)} · {state}</div><div class=\"qs-side\">"
            f"{side('baseline', view.baseline.tokens, view.steered.tokens)}"
            f"{side('steered', view.steered.tokens, view.baseline.tokens)}</div></div>")
