"""The ``qwen-scope`` command line: `features` / `steer` run on the bundled nano model when no --model / --release is
given; library errors are one-line messages; bad option values are refused, naming the option, before a model loads."""
from __future__ import annotations

import json
import re

import pytest
import torch

from qwen_scope import nano_scope
from qwen_scope.cli import COMMANDS, main
from qwen_scope.nano import NANO_DIR


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


def test_traceback_flag_reraises():
    with pytest.raises(ValueError, match="must be finite"):
        main(["--traceback", "steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--strength", "nan"])


def _one_error_line(capsys, command: str) -> str:
    """The single stderr line of a failed command (no trace, no second line)."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("Loading weights")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"qwen-scope {command}: error: "), lines[0]
    return lines[0]


def _no_model_load(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


# (argv, expected fragment of the one error line); every row exits 2 before any model weights load.
_BAD_INPUTS = [
    (["features", "--layers", "99", "--text", "x"], r"layer 99 is out of range; the nano model has decoder blocks 0\.\.5"),
    (["features", "--layers", "0-100000000", "--text", "x"], r"layer 100000000 is out of range"),
    (["features", "--layers", "3-x", "--text", "x"], r"bad --layers '3-x'"),
    (["features", "--model", str(NANO_DIR), "--layers", "3", "--text", "x"], r"needs --release"),
    (["features", "--device", "gpu", "--layers", "3", "--text", "x"], r"device 'gpu' is not a torch device"),
    (["features", "--model", "Qwen/Qwen3.5-2B-Base", "--release", "qwen-scope-3.5-2b-base-w32k-l50", "--layers", "3",
      "--text", "x"], r"model Qwen/Qwen3\.5-2B-Base is not in .* offline mode .*`hf download Qwen/Qwen3\.5-2B-Base`"),
    (["features", "--release", "qwen-scope-3.5-2b-base-w32k-l5O", "--layers", "3", "--text", "x"],
     r"unknown Qwen-Scope release 'qwen-scope-3\.5-2b-base-w32k-l5O'\. Did you mean qwen-scope-3\.5-2b-base-w32k-l50"),
    (["collect", "nano", "corpus.jsonl", "--out", "o", "--tokens", "10"],
     r"'nano' is not a model id or directory\. The bundled nano model is the directory .*data/nano"),
    (["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--strength", "nan"], r"must be finite"),
    (["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--strength", "1e38"], r"must be finite and at most"),
    (["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--mode", "clamp", "--strength", "inf"],
     r"clamp value inf of clamp at layer 1 feature 3 must be finite"),
    (["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--sweep", "-100,nan"], r"must be finite"),
    (["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--strength", "huge"], r"bad --strength 'huge'.*'light'"),
    (["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--sweep", "1,x"], r"bad --sweep value 'x'"),
    (["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--sweep", "1,2", "--mode", "ablate"],
     r"--sweep varies.*--mode add"),
    (["steer", "--prompt", "hi"], r"nothing to steer"),
    (["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--positions", "0-x"], r"bad position '0-x'"),
    (["explore", "--store", "s", "--out", "o", "--features", "1,x"], r"--features expects comma-separated feature ids"),
    (["demo", "--corpus", "/no/such/file.txt"], r"--corpus /no/such/file\.txt: no such file"),
    # A release without layers must not be dropped silently, storing only the dense points.
    (["collect", str(NANO_DIR), "c.jsonl", "--out", "o", "--tokens", "10", "--points", "resid_post.1", "--release",
      "REL"], r"--release REL needs --sae-layers \(e\.g\. 6,12 or all\)"),
]
if not torch.cuda.is_available():
    _BAD_INPUTS.append((["features", "--device", "cuda", "--layers", "3", "--text", "x"],
                        r"device 'cuda' asked for, but (this torch build has no CUDA|no CUDA GPU).*use --device cpu"))


@pytest.mark.parametrize("argv, message", _BAD_INPUTS, ids=[" ".join(a)[:60] for a, _ in _BAD_INPUTS])
def test_every_bad_input_is_one_line_with_exit_status_2(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.chdir(tmp_path)
    _no_model_load(monkeypatch)
    assert main(argv) == 2
    assert re.search(message, _one_error_line(capsys, argv[0])), message


def test_an_unexpected_error_is_one_line_naming_its_type(capsys, monkeypatch):
    from qwen_scope.commands import releases

    def boom(args):
        raise RuntimeError("something broke\n  deep inside")

    monkeypatch.setattr(releases, "run", boom)
    assert main(["releases"]) == 2
    line = _one_error_line(capsys, "releases")
    assert line.endswith("RuntimeError: something broke (run with --traceback for the full trace)")


def test_explore_refuses_features_beyond_the_sae_before_mining(capsys, monkeypatch, tmp_path):
    import qwen_scope.store

    class Store:
        def __init__(self, root):
            self.root = root
            self.points = ["resid_post.3"]
            self.manifest = {"points": {"resid_post.3": {"sae": {"d_sae": 1024}}}, "model": "m"}

    monkeypatch.setattr(qwen_scope.store, "ActivationStore", Store)
    assert main(["explore", "--store", str(tmp_path), "--out", str(tmp_path / "o"), "--features", "5,99999",
                 "--no-model"]) == 2
    line = _one_error_line(capsys, "explore")
    assert "[99999] out of range for the SAE at resid_post.3 (d_sae 1024: ids 0..1023)" in line


def test_negative_numbers_and_lists_parse_as_option_values():
    from qwen_scope.cli import build_parser, join_negative_values

    parser = build_parser()
    argv = ["steer", "--prompt", "hi", "--layer", "1", "--feature", "3", "--sweep", "-100,-20,0,20", "--strength",
            "-5", "--edit", "1:3:add:-2"]
    args = parser.parse_args(join_negative_values(argv, parser))
    assert (args.sweep, args.strength, args.edit) == ("-100,-20,0,20", "-5", ["1:3:add:-2"])
    # A flag before a negative value is left alone (it takes no value), and so is an ordinary option value.
    assert join_negative_values(["--sample", "-3", "--prompt", "x"], parser) == ["--sample", "-3", "--prompt", "x"]


def test_a_closed_pipe_is_quiet():
    import subprocess
    import sys

    # `qwen-scope releases --json | head`, with a reader that leaves before anything is written: the write fails
    # with EPIPE every time, not only when the output outgrows the pipe's buffer.
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m qwen_scope releases --json | true; "
                                         "echo status ${PIPESTATUS[0]}"], capture_output=True, text=True, timeout=120)
    assert proc.stdout == "status 0\n" and proc.stderr == ""


def test_every_subcommand_help_shows_its_examples_and_every_option_has_help():
    import argparse

    from qwen_scope.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        text = parser.format_help()
        assert "Examples::" in text and f"qwen-scope {name}" in text, name
    # The commands whose every option this test pins (collect and eval document theirs in their own tests).
    for name in ("demo", "explore", "features", "releases", "steer"):
        missing = [a.option_strings or a.dest for a in sub.choices[name]._actions if not a.help]
        assert missing == [], f"{name}: options without help: {missing}"


def test_the_sae_loads_before_the_model_so_its_download_hint_is_reached(monkeypatch, tmp_path):
    from qwen_scope.nano import NANO_DIR
    from qwen_scope.scope import Scope

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _no_model_load(monkeypatch)
    with pytest.raises(FileNotFoundError, match=r"layer3\.sae\.pt of Qwen/SAE-Res-Qwen3\.5-Nano-Base-W1K-L0_16.*"
                                                r"hf download Qwen/SAE-Res-Qwen3\.5-Nano-Base-W1K-L0_16"):
        Scope.from_pretrained(NANO_DIR, "Qwen/SAE-Res-Qwen3.5-Nano-Base-W1K-L0_16", [3], cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        Scope.from_pretrained(tmp_path, "Qwen/SAE-Res-Qwen3.5-Nano-Base-W1K-L0_16", [3])


def test_every_command_module_is_listed():
    import pkgutil

    import qwen_scope.commands

    modules = sorted(i.name for i in pkgutil.iter_modules(qwen_scope.commands.__path__) if not i.name.startswith("_"))
    assert [m.__name__.rsplit(".", 1)[1] for m in COMMANDS] == modules
    assert [m.NAME for m in COMMANDS] == modules
