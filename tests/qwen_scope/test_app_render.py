"""The explorer's HTML and rows: values placed where they belong, hostile token texts escaped."""
from __future__ import annotations

import re

from qwen_scope.app.bench import SideView, SteerView
from qwen_scope.app.render import feature_rows, steer_html, steer_rows, token_table_rows, token_view_html
from qwen_scope.app.session import FeatureRow, PromptView
from qwen_scope.steering import add

HOSTILE = '<img src=x onerror="alert(1)">'


def _view(coloured_by=None) -> PromptView:
    return PromptView("a", 3, coloured_by, ("<s>", HOSTILE, "b\n"), (-1, 7, 9), (0.0, 2.0, 1.0), 2.0,
                      ((), ((7, 2.0), (1, 0.5)), ((9, 1.0),)))


def test_token_view_escapes_tokens_and_scales_colour_by_activation():
    page = token_view_html(_view())
    assert "<img" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    alphas = [float(a) for a in re.findall(r"hsla\(\d+,85%,55%,([0-9.]+)\)", page)]
    assert alphas == [0.0, 1.0, 0.5]
    assert [int(p) for p in re.findall(r'data-position="(\d+)"', page)] == [0, 1, 2]
    assert "b⏎" in page and "each token&#x27;s top feature" in page
    assert "coloured by feature #7" in token_view_html(_view(coloured_by=7))


def test_token_table_rows_name_the_top_feature_with_its_label():
    rows = token_table_rows(_view(), labels=lambda f: "seven" if f == 7 else "")
    assert rows[0] == [0, "'<s>'", "", 0.0, ""]
    assert rows[1] == [1, repr(HOSTILE), "#7 seven", 2.0, "#7 2.00, #1 0.50"]
    assert rows[2][2] == "#9"
    assert feature_rows([FeatureRow(7, 2.123456, "x")]) == [[7, 2.1235, "x"]]


def test_steer_rows_and_html_mark_the_steered_tokens_that_differ():
    view = SteerView("p", (add(3, 5, 8.0),), SideView(("a", "b"), (0.5, 0.25)), SideView(("a", HOSTILE), (0.5, 0.125)),
                     True, None, "engine")
    assert steer_rows(view) == [[0, "'a'", 0.5, "'a'", 0.5], [1, "'b'", 0.25, repr(HOSTILE), 0.125]]
    page = steer_html(view)
    assert "<img" not in page and page.count('class="qs-diff"') == 1
    assert "L3 #5 add 8 at all · engine · done" in page
    partial = SteerView("p", view.edits, SideView(("a",)), SideView(("a",)), False, None, "engine")
    assert steer_rows(partial) == [[0, "'a'", None, "'a'", None]] and "generating…" in steer_html(partial)
