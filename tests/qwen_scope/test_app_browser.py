"""The browser app in headless Chromium on the nano model, as a person uses it: type a prompt, read its features,
click a token in the table and a feature in the token's list, each step screenshotted; a hostile prompt renders as
text and runs nothing. Skipped where gradio, playwright or a Chromium binary is missing (playwright's own, from
``python -m playwright install chromium``, else a system one such as Debian's ``chromium-headless-shell``)."""
from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

pytest.importorskip("gradio")
sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect

from qwen_scope.app import AppSession  # noqa: E402
from qwen_scope.app.gradio_ui import build_app, launch  # noqa: E402

LAYER = 3
PROMPT = "def close(self):\n    return"
# Were any of it parsed as markup, the image's error handler or the script would set the flag.
HOSTILE = '<img src=x onerror="window.__qsHostile=1"><script>window.__qsHostile=2</script>'
SYSTEM_CHROMIUM = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def _chromium(playwright) -> str | None:
    bundled = playwright.chromium.executable_path
    if Path(bundled).is_file():
        return bundled
    return next((path for path in map(shutil.which, SYSTEM_CHROMIUM) if path), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        path = _chromium(playwright)
        if path is None:
            pytest.skip("no Chromium binary: `python -m playwright install chromium`, or a system chromium")
        browser = playwright.chromium.launch(executable_path=path)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def served():
    from qwen_scope import nano_scope

    scope = nano_scope([LAYER])
    demo = build_app(AppSession(scope))
    _, url, _ = launch(demo, port=_free_port(), prevent_thread_lock=True, quiet=True)
    assert url.startswith("http://127.0.0.1:")
    yield scope, url
    demo.close()


@pytest.fixture
def page(browser, served):
    _, url = served
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    # The page talks to the app's server only; anything else (fonts, analytics) is refused, never fetched.
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url) else route.abort())
    page.goto(url, wait_until="domcontentloaded")
    yield page
    page.close()


def _read(page, text: str, n_tokens: int) -> None:
    page.get_by_label("prompt", exact=True).fill(text)
    page.get_by_role("button", name="Read features").click()
    expect(page.locator(".qs-tok [data-position]")).to_have_count(n_tokens)


def _cell(page, table: str, row: int, col: int):
    return page.get_by_role("grid", name=table).locator(f'[data-testid="cell-{row}-{col}"]')


def test_typing_a_prompt_clicking_a_token_and_a_feature_shows_its_features_and_cards(page, served, tmp_path):
    scope, _ = served
    feats = scope.features(PROMPT, layers=LAYER)
    _read(page, PROMPT, len(feats.tokens))
    assert page.locator(".qs-tok").inner_text() == PROMPT.replace("\n", "⏎")
    token_table = "top features per token (click a token)"
    T = feats.tokens.index("(")
    expect(_cell(page, token_table, T, 1)).to_have_text(repr(feats.tokens[T]))
    expect(_cell(page, token_table, T, 2)).to_have_text(f"#{feats.token_top(LAYER, T)[0][0]}")
    page.screenshot(path=tmp_path / "1_read.png", full_page=True)

    _cell(page, token_table, T, 1).click()
    top = feats.token_top(LAYER, T)
    features_table = "the token's features (click one)"
    expect(_cell(page, features_table, 0, 0)).to_have_text(str(top[0][0]))
    expect(_cell(page, features_table, 1, 0)).to_have_text(str(top[1][0]))
    expect(page.locator(".qs-card h2")).to_have_text(f"Feature #{top[0][0]}")
    page.screenshot(path=tmp_path / "2_token.png", full_page=True)

    _cell(page, features_table, 1, 0).click()
    expect(page.locator(".qs-card h2")).to_have_text(f"Feature #{top[1][0]}")
    expect(page.locator(".qs-card", has_text="Top activations")).to_contain_text(f"layer {LAYER}")
    page.screenshot(path=tmp_path / "3_feature.png", full_page=True)
    assert all((tmp_path / name).stat().st_size > 10_000 for name in ("1_read.png", "2_token.png", "3_feature.png"))


def test_a_hostile_prompt_renders_as_text_and_runs_nothing(page, served, tmp_path):
    scope, _ = served
    feats = scope.features(HOSTILE, layers=LAYER)
    _read(page, HOSTILE, len(feats.tokens))
    assert page.locator(".qs-tok").inner_text() == HOSTILE
    # Its card shows the prompt's text around the feature's activations: escaped there too.
    _cell(page, "top features per token (click a token)", 4, 1).click()
    expect(page.locator(".qs-card h2")).to_have_text(f"Feature #{feats.token_top(LAYER, 4)[0][0]}")
    page.screenshot(path=tmp_path / "hostile.png", full_page=True)
    assert page.locator(".qs-card img, .qs-card script").count() == 0
    page.wait_for_timeout(300)
    assert page.evaluate("window.__qsHostile") is None
    # The probe itself works: the same text parsed as markup sets the flag.
    page.evaluate("text => { const d = document.createElement('div'); document.body.append(d); d.innerHTML = text }",
                  HOSTILE)
    page.wait_for_function("window.__qsHostile === 1")
