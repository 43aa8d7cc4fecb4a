"""`qwen-scope features` / `steer` run on the bundled nano model when no --model / --release is given."""
from __future__ import annotations

import json

import pytest

from qwen_scope import nano_scope
from qwen_scope.cli import main


def test_features_defaults_to_the_nano_model_and_matches_the_api(tmp_path):
    out = tmp_path / "f.json"
    assert main(["features", "--layers", "3", "--text", "    def close(self):", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    feats = nano_scope(layers=[3]).features("    def close(self):")
    assert data["text"] == "    def close(self):" and list(data["layers"]) == ["3"]
    assert data["layers"]["3"]["fve"] == pytest.approx(feats[3].fve, abs=1e-6)


def test_steer_defaults_to_the_nano_model(capsys):
    assert main(["steer", "--layer", "5", "--feature", "992", "--strength", "20", "--prompt", "Example:",
                 "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert "baseline" in text and "steered" in text


def test_model_without_release_is_refused_with_the_fix():
    with pytest.raises(SystemExit, match="needs --release"):
        main(["features", "--model", "Qwen/Qwen3.5-2B", "--layers", "3", "--text", "x"])


def test_library_errors_are_one_line_messages_with_exit_status_2(capsys):
    assert main(["features", "--layers", "99", "--text", "x"]) == 2
    full = capsys.readouterr().err
    err = full.strip().splitlines()[-1]
    assert err.startswith("qwen-scope features: error: ") and "0..5" in err and "got 99" in err
    assert "Traceback" not in full


def test_traceback_flag_reraises():
    with pytest.raises(ValueError, match="got 99"):
        main(["--traceback", "features", "--layers", "99", "--text", "x"])
