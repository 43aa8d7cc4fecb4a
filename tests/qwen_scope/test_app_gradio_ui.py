"""The browser app driven through its own HTTP API on loopback (the Gradio client) on the nano model: the features
of a prompt, a card, a steered generation equal to ``Scope.steer``'s, hostile token texts escaped. Skipped where
gradio (the optional ``app`` extra) is not installed."""
from __future__ import annotations

import pytest

pytest.importorskip("gradio")
pytest.importorskip("gradio_client")

from qwen_scope.app import AppSession  # noqa: E402
from qwen_scope.app.gradio_ui import build_app, gradio_missing, launch  # noqa: E402
from qwen_scope.steering import add  # noqa: E402

PROMPT = "def close(self):\n    "
HOSTILE = 'x = "<img src=x onerror=alert(1)>"'


@pytest.fixture(scope="module")
def served():
    from gradio_client import Client

    from qwen_scope import nano_scope

    scope = nano_scope([3])
    demo = build_app(AppSession(scope))
    _, url, _ = launch(demo, port=None, prevent_thread_lock=True, quiet=True)
    assert url.startswith("http://127.0.0.1:")
    yield scope, Client(url, verbose=False), demo
    demo.close()


def test_the_app_reads_features_opens_a_card_and_escapes_tokens(served):
    scope, client, _ = served
    page, table, token_feats, card = client.predict(HOSTILE, "3", "", api_name="/read")
    feats = scope.features(HOSTILE)
    rows = table["data"]
    assert [r[1] for r in rows] == [repr(t) for t in feats.tokens]
    assert [r[2] for r in rows[1:4]] == [f"#{feats.token_top(3, t)[0][0]}" for t in (1, 2, 3)]
    # The byte-level tokens split the tag; each "<" token arrives escaped.
    assert "<img" not in page and page.count(">&lt;</span>") == HOSTILE.count("<")
    f = feats.token_top(3, 5)[0][0]
    html = client.predict(f, api_name="/open_card")
    card = scope.features(HOSTILE)[3].dense()[1:, f]
    assert f"Feature #{f}" in html and "layer 3" in html and f"max {float(card.max()):.3f}" in html


def test_the_app_generates_what_scope_steer_generates(served):
    scope, client, _ = served
    _, rows = client.predict(PROMPT, "5, 7", 8.0, "", "add", "all", "3", 6, api_name="/generate")
    expected = scope.steer(PROMPT, [add(3, 5, 8.0), add(3, 7, 8.0)], max_new_tokens=6)
    data = rows["data"]
    assert [r[1] for r in data] == [repr(t) for t in expected.baseline.tokens]
    assert [r[3] for r in data] == [repr(t) for t in expected.steered.tokens]
    assert [r[4] for r in data] == pytest.approx([round(float(p), 4) for p in expected.steered.probs], abs=1e-4)


def test_a_bad_feature_is_a_message_in_the_page_not_a_trace(served):
    from gradio_client.exceptions import AppError

    _, client, _ = served
    with pytest.raises(AppError, match="not FEATURE or LAYER:FEATURE"):
        client.predict(PROMPT, "five", 8.0, "", "add", "all", "3", 4, api_name="/generate")


def test_token_and_feature_clicks_list_the_tokens_features_and_open_the_card(served):
    import gradio as gr
    import pandas as pd
    from gradio.helpers import special_args

    scope, client, demo = served
    client.predict(PROMPT, "3", "", api_name="/read")
    fns = {f.name: f.fn for f in demo.fns.values()}

    def click(name, inputs, row):
        args, *_ = special_args(fns[name], inputs, None, gr.SelectData(None, {"index": [row, 0], "value": None, "selected": True}))
        return fns[name](*args)

    rows, card = click("token_clicked", [], 4)
    top = scope.features(PROMPT).token_top(3, 4)
    assert [r[0] for r in rows] == [f for f, _ in top] and f"Feature #{top[0][0]}" in card
    table = pd.DataFrame(rows, columns=["feature", "value", "label"])
    assert f"Feature #{top[1][0]}" in click("feature_clicked", [table], 1)


def test_gradio_missing_is_none_where_gradio_imports():
    assert gradio_missing() is None
