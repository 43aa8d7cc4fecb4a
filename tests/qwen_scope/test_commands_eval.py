"""``qwen-scope eval``: the three evaluations from the command line on the nano model, bad input as one line."""
from __future__ import annotations

import json

from qwen_scope.cli import main


def test_eval_sae_writes_json_and_figure(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "sae", "--layers", "5", "--max-tokens", "128", "--context-len", "64", "--batch-size", "2",
                 "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 5 | 0.9" in table and "CE recovered" in table
    data = json.loads((out / "sae_eval.json").read_text())
    assert data["meta"]["layers"] == [5] and data["layers"]["5"]["n_tokens"] == 2 * 63
    assert (out / "sae_eval.html").is_file()


def test_eval_steer_prints_the_arms(capsys):
    assert main(["eval", "steer", "--layer", "5", "--feature", "992", "--strength", "4", "--prompt", "Example:\\n\\n",
                 "--max-new-tokens", "4", "--controls", "1"]) == 0
    text = capsys.readouterr().out
    assert "target" in text and "random direction 0" in text and "random feature" in text


def test_bad_input_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["eval", "sae", "--layers", "5", "--corpus", str(empty)]) == 2
    assert "is an empty file" in capsys.readouterr().err
    assert main(["eval", "sae", "--layers", "9"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["eval", "steer", "--layer", "5", "--feature", "992", "--prompt", "x", "--sweep", "1,a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
