"""``qwen-scope app``: one line naming the install when gradio is missing (before any model loads), bad settings
refused, and the session it serves (nano model, loopback, the database's layer) with the launch replaced."""
from __future__ import annotations

import sys

import pytest

from qwen_scope.cli import main


def test_help_shows_examples_and_every_option_has_help(capsys):
    from qwen_scope.cli import build_parser

    with pytest.raises(SystemExit):
        main(["app", "--help"])
    out = capsys.readouterr().out
    assert "qwen-scope app --model Qwen/Qwen3.5-2B-Base" in out and "127.0.0.1" in out
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and "app" in a.choices)
    assert all(a.help for a in sub.choices["app"]._actions)


def test_without_gradio_it_prints_the_install_command_before_loading_a_model(monkeypatch, capsys):
    import qwen_scope.scope

    monkeypatch.setitem(sys.modules, "gradio", None)
    monkeypatch.setattr(qwen_scope.scope.Scope, "from_pretrained", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["app"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("qwen-scope app: error: the app needs gradio, which is not installed; install it with: "
                   "pip install 'qwen-scope[app]' (or: pip install gradio)")


def test_bad_settings_are_one_line_errors(monkeypatch, capsys):
    import qwen_scope.app.gradio_ui

    monkeypatch.setattr(qwen_scope.app.gradio_ui, "gradio_missing", lambda: None)
    assert main(["app", "--port", "70000"]) == 2
    assert "--port must be in 1..65535, got 70000" in capsys.readouterr().err
    assert main(["app", "--layers", "9"]) == 2
    assert "layer 9 is out of range; the nano model has decoder blocks 0..5" in capsys.readouterr().err


def test_it_serves_the_nano_session_on_loopback_by_default(monkeypatch, capsys):
    import qwen_scope.app.gradio_ui as ui

    seen = {}
    monkeypatch.setattr(ui, "gradio_missing", lambda: None)
    monkeypatch.setattr(ui, "build_app", lambda session: seen.setdefault("session", session))
    monkeypatch.setattr(ui, "launch", lambda demo, **kw: seen.update(kw))
    assert main(["app", "--layers", "2-3", "--port", "7999"]) == 0
    session = seen["session"]
    assert session.scope.layers == [2, 3] and session.layer == 3 and session.db is None
    assert (seen["host"], seen["port"], seen["share"]) == ("127.0.0.1", 7999, False)
    assert "on http://127.0.0.1:7999" in capsys.readouterr().out
