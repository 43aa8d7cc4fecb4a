"""``scope.explore(text)`` on the nano model: the static HTML without widgets (escaped, the strongest feature's
card), and the ipywidgets view's Python side where ipywidgets imports."""
from __future__ import annotations

import functools
import html

import pytest

TEXT = 'x = "<b>bold</b>"\n'


@functools.lru_cache(maxsize=None)
def _scope():
    from qwen_scope import nano_scope

    return nano_scope([3])


def test_static_view_colours_tokens_lists_the_table_and_shows_the_strongest_card():
    scope = _scope()
    page = scope.explore(TEXT, widget=False)
    feats = scope.features(TEXT)
    assert page._repr_html_() == str(page)
    assert "<b>bold" not in page and "&lt;" in page
    strongest = max((v, f) for t in range(1, len(feats.tokens)) for f, v in feats.token_top(3, t)[:1])[1]
    assert f"Feature #{strongest}" in page
    assert page.count("<tr><td>") >= len(feats.tokens)
    for t in (1, 2):
        assert f"<td>#{feats.token_top(3, t)[0][0]}</td>" in page
    assert html.escape(repr(feats.tokens[1])) in page


def test_explore_without_ipywidgets_falls_back_to_the_static_view(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_widgets(name, *args, **kwargs):
        if name == "ipywidgets":
            raise ImportError("No module named 'ipywidgets'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_widgets)
    assert _scope().explore(TEXT) == _scope().explore(TEXT, widget=False)
    with pytest.raises(ImportError, match=r"needs ipywidgets: pip install 'qwen-scope\[app\]'.*widget=False"):
        _scope().explore(TEXT, widget=True)


def test_widget_clicks_show_features_and_cards_and_generate_equals_scope_steer():
    pytest.importorskip("ipywidgets")
    from qwen_scope.app.bench import SteeringBench
    from qwen_scope.app.render import steer_html
    from qwen_scope.steering import add

    scope = _scope()
    box = scope.explore(TEXT, widget=True)
    tokens_html, token_buttons, features_box, card, (feature, strength), (positions, new_tokens, generate), out = (
        box.children[0], box.children[1], box.children[2], box.children[3], box.children[4].children,
        box.children[5].children, box.children[6])
    feats = scope.features(TEXT)
    assert len(token_buttons.children) == len(feats.tokens)
    token_buttons.children[2].click()
    top = feats.token_top(3, 2)
    assert [b.description.split()[0] for b in features_box.children] == [f"#{f}" for f, _ in top]
    assert f"Feature #{top[0][0]}" in card.value and feature.value == top[0][0]
    features_box.children[-1].click()
    assert f"Feature #{top[-1][0]}" in card.value
    strength.value, new_tokens.value = 8.0, 5
    generate.click()
    # The bench's finished view, whose generations equal Scope.steer's (test_app_bench).
    expected = SteeringBench(scope).run(TEXT, [add(3, top[-1][0], 8.0)], max_new_tokens=5)
    assert out.value == steer_html(expected) and "done" in out.value
