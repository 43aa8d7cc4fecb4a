"""The ``qwen-scope`` command line: `features` / `steer` run on the bundled nano model when no --model / --release is
given; library errors are one-line messages; bad option values are refused, naming the option, before a model loads."""
from __future__ import annotations

import json

import pytest

from qwen_scope import nano_scope
from qwen_scope.cli import COMMANDS, main
from qwen_scope.commands import steer as steer_cmd


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


@pytest.mark.parametrize("argv, message", [
    (["--layer", "1", "--feature", "3", "--strength", "huge"], r"bad --strength 'huge'.*'light'"),
    (["--layer", "1", "--feature", "3", "--sweep", "1,x"], r"bad --sweep value 'x'"),
    (["--layer", "1", "--feature", "3", "--sweep", "1,2", "--mode", "ablate"], r"--sweep varies.*--mode add"),
])
def test_steer_refuses_bad_numbers_with_the_option_named(argv, message, monkeypatch):
    # The checks must fire before the (slow) model load.
    monkeypatch.setattr(steer_cmd, "build_scope", lambda *a: pytest.fail("loaded a model before checking"))
    with pytest.raises(SystemExit, match=message):
        main(["steer", "--prompt", "hi", *argv])


def test_collect_refuses_a_release_without_sae_layers_instead_of_ignoring_it(tmp_path):
    # A release without layers must not be dropped silently, storing only the dense points.
    with pytest.raises(SystemExit, match=r"--release REL needs --sae-layers \(e\.g\. 6,12 or all\)"):
        main(["collect", "model", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o"), "--tokens", "10",
              "--points", "resid_post.1", "--release", "REL"])


def test_every_command_module_is_listed():
    import pkgutil

    import qwen_scope.commands

    modules = sorted(i.name for i in pkgutil.iter_modules(qwen_scope.commands.__path__) if not i.name.startswith("_"))
    assert [m.__name__.rsplit(".", 1)[1] for m in COMMANDS] == modules
    assert [m.NAME for m in COMMANDS] == modules
