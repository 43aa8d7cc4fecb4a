"""The browser app: Gradio tabs over an ``AppSession`` (features of a prompt, the steering bench, compare, the
evaluation table). Gradio is an optional extra (``pip install 'qwen-scope[app]'``), imported only in here.

    demo = build_app(AppSession(nano_scope()))
    launch(demo)                                   # http://127.0.0.1:7860

Every callback is a session method; this module only lays out components and turns a ``ValueError`` into the
message Gradio shows. The session is shared by the browser tabs that connect (one local user).
"""

import functools
import inspect
import ipaddress
import logging

from qwen_scope.app.render import feature_rows, steer_html, steer_rows, token_table_rows, token_view_html
from qwen_scope.app.session import AppSession
from qwen_scope.explore.html import feature_card_html

__all__ = ["build_app", "launch", "INSTALL_HINT", "gradio_missing"]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'qwen-scope[app]'  (or: pip install gradio)"


def gradio_missing() -> str | None:
    """One line saying gradio is not installed and how to install it, or None when it is importable."""
    try:
        import gradio  # noqa: F401
    except ImportError:
        return f"the app needs gradio, which is not installed; install it with: {INSTALL_HINT}"
    return None


def _shown(gr, fn):
    """``fn`` with user errors (bad ids, empty prompts) shown in the page instead of a trace."""
    def call(*args):
        try:
            return fn(*args)
        except (ValueError, KeyError) as err:
            raise gr.Error(str(err.args[0]) if isinstance(err, KeyError) else str(err)) from None

    def stream(*args):
        try:
            yield from fn(*args)
        except (ValueError, KeyError) as err:
            raise gr.Error(str(err)) from None

    return functools.wraps(fn)(stream if inspect.isgeneratorfunction(fn) else call)


def _feature_or_none(text) -> int | None:
    text = "" if text is None else str(text).strip()
    if not text:
        return None
    if not text.lstrip("-").isdigit():
        raise ValueError(f"colour by: expected a feature id like 42 (or empty for each token's top feature), "
                         f"got {text!r}")
    return int(text)


def _numbers(text: str, what: str) -> list[float]:
    try:
        return [float(s) for s in str(text).replace(" ", ",").split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers like -20,0,20, got {text!r}") from None


def build_app(session: AppSession, *, title: str | None = None):
    """The ``gradio.Blocks`` of the explorer over ``session`` (not launched).

    Args:
        session: the ``AppSession`` answering every interaction.
        title: page title (default: the model's name).
    Returns:
        a ``gradio.Blocks``.
    """
    import gradio as gr

    scope = session.scope
    title = title or f"qwen-scope · {scope.model_name or 'model'}"
    layers = [str(n) for n in scope.layers]
    feature_cols = ["feature", "value", "label"]

    def read(text, layer, colour):
        view = session.analyze(text, int(layer), _feature_or_none(colour))
        rows = token_table_rows(view, lambda f: session.label(f))
        return token_view_html(view), rows, [], ""

    def token_clicked(evt: gr.SelectData):
        rows = feature_rows(session.token_features(int(evt.index[0])))
        first = rows[0][0] if rows else None
        return rows, feature_card_html(session.card(first)) if first is not None else ""

    def feature_clicked(table, evt: gr.SelectData):
        feature = int(table.iloc[evt.index[0], 0] if hasattr(table, "iloc") else table[evt.index[0]][0])
        return feature_card_html(session.card(feature), link=lambda f: None)

    def open_card(feature):
        return feature_card_html(session.card(int(feature)))

    def search(query):
        return feature_rows(session.search(query))

    def pick(features, table, evt: gr.SelectData):
        feature = int(table.iloc[evt.index[0], 0] if hasattr(table, "iloc") else table[evt.index[0]][0])
        return ", ".join(s for s in [str(features or "").strip(), str(feature)] if s)

    def generate(prompt, features, strength, strengths, mode, positions, layer, max_new):
        values = _numbers(strengths, "strengths") if str(strengths or "").strip() else [float(strength)]
        edits = session.bench.edits(features, values, layer=int(layer), mode=mode, positions=positions or "all")
        for view in session.bench.stream(prompt, edits, max_new_tokens=int(max_new),
                                         template=session.template):
            yield steer_html(view), steer_rows(view)

    def run_sweep(prompt, features, strengths, mode, positions, layer, max_new):
        pairs = session.bench.edits(features, 0.0, layer=int(layer))
        if len(pairs) != 1:
            raise ValueError(f"a sweep varies one feature; the features box holds {len(pairs)}")
        _, fig = session.bench.sweep(prompt, pairs[0].layer, pairs[0].feature, _numbers(strengths, "sweep"),
                                     mode="clamp" if mode == "clamp" else "add", positions=positions or "all",
                                     max_new_tokens=int(max_new), template=session.template)
        return fig

    def compare(a, b, layer):
        rows, fig = session.compare(a, b, int(layer))
        return fig, [[d.feature, round(d.rate_a, 4), round(d.rate_b, 4), round(d.diff, 4), label]
                     for d, label in rows]

    with gr.Blocks(title=title) as demo:
        gr.Markdown(f"## {title}")
        with gr.Tab("Features"):
            with gr.Row():
                prompt = gr.Textbox(label="prompt", lines=3, scale=4)
                with gr.Column(scale=1):
                    layer = gr.Dropdown(layers, value=str(session.layer), label="layer")
                    colour = gr.Textbox(label="colour by feature (empty: each token's top feature)")
                    go = gr.Button("Read features", variant="primary")
            tokens = gr.HTML()
            with gr.Row():
                table = gr.Dataframe(headers=["pos", "token", "top feature", "value", "features"],
                                     label="top features per token (click a token)", interactive=False)
                token_feats = gr.Dataframe(headers=feature_cols, label="the token's features (click one)",
                                           interactive=False)
            with gr.Row():
                card_id = gr.Number(label="feature", precision=0)
                card_go = gr.Button("Open card")
            card = gr.HTML()
            go.click(_shown(gr, read), [prompt, layer, colour], [tokens, table, token_feats, card])
            table.select(_shown(gr, token_clicked), None, [token_feats, card])
            token_feats.select(_shown(gr, feature_clicked), [token_feats], [card])
            card_go.click(_shown(gr, open_card), [card_id], [card])
        with gr.Tab("Steer"):
            with gr.Row():
                s_prompt = gr.Textbox(label="prompt", lines=2, scale=3)
                with gr.Column(scale=2):
                    s_features = gr.Textbox(label="features (42 or LAYER:42, comma-separated)")
                    s_query = gr.Textbox(label="search labels / explanations / top tokens")
                    hits = gr.Dataframe(headers=feature_cols, label="matches (click to add)", interactive=False)
            with gr.Row():
                s_layer = gr.Dropdown(layers, value=str(session.layer), label="layer of bare ids")
                s_mode = gr.Radio(["add", "clamp", "ablate"], value="add", label="mode")
                s_strength = gr.Slider(-100, 100, value=20, step=0.5, label="strength")
                s_strengths = gr.Textbox(label="strength per feature (optional, comma-separated)")
                s_positions = gr.Textbox(value="all", label="positions (all, prompt, generated, 0-3)")
                s_new = gr.Slider(1, 256, value=24, step=1, label="new tokens")
            s_go = gr.Button("Generate", variant="primary")
            s_view = gr.HTML()
            s_rows = gr.Dataframe(headers=["step", "baseline", "p", "steered", "p"], interactive=False)
            with gr.Row():
                sweep_values = gr.Textbox(value="-40,-20,-5,0,5,20,40", label="sweep strengths")
                sweep_go = gr.Button("Sweep the first feature")
            sweep_plot = gr.Plot()
            s_query.submit(_shown(gr, search), [s_query], [hits])
            hits.select(_shown(gr, pick), [s_features, hits], [s_features])
            s_go.click(_shown(gr, generate), [s_prompt, s_features, s_strength, s_strengths, s_mode, s_positions,
                                              s_layer, s_new], [s_view, s_rows])
            sweep_go.click(_shown(gr, run_sweep), [s_prompt, s_features, sweep_values, s_mode, s_positions, s_layer,
                                                   s_new], [sweep_plot])
        with gr.Tab("Compare"):
            with gr.Row():
                text_a = gr.Textbox(label="text A", lines=3)
                text_b = gr.Textbox(label="text B", lines=3)
            c_layer = gr.Dropdown(layers, value=str(session.layer), label="layer")
            c_go = gr.Button("Compare", variant="primary")
            c_plot = gr.Plot()
            c_rows = gr.Dataframe(headers=["feature", "rate A", "rate B", "A - B", "label"], interactive=False)
            c_go.click(_shown(gr, compare), [text_a, text_b, c_layer], [c_plot, c_rows])
        table_md = session.evaluation_table()
        if table_md is not None:
            with gr.Tab("Evaluation"):
                gr.Markdown(table_md)
    return demo


def launch(demo, *, host: str = "127.0.0.1", port: int = 7860, **kwargs):
    """Serve ``demo`` on ``host:port`` (loopback by default; another address is served only when given)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        log.warning("serving on %s: anyone who can reach this address can run the model", host)
    return demo.launch(server_name=host, server_port=port, **kwargs)
