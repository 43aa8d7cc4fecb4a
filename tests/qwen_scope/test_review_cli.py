"""Review findings in the steer command: bad numbers are refused with the option named, before any model loads."""
from __future__ import annotations

import pytest

from qwen_scope.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--layer", "1", "--feature", "3", "--strength", "huge"], r"bad --strength 'huge'.*'light'"),
    (["--layer", "1", "--feature", "3", "--sweep", "1,x"], r"bad --sweep value 'x'"),
    (["--layer", "1", "--feature", "3", "--sweep", "1,2", "--mode", "ablate"], r"--sweep varies.*--mode add"),
])
def test_steer_refuses_bad_numbers_with_the_option_named(argv, message, monkeypatch):
    import qwen_scope.commands.steer as steer_cmd

    # The checks must fire before the (slow) model load.
    monkeypatch.setattr(steer_cmd, "build_scope", lambda *a: pytest.fail("loaded a model before checking"))
    with pytest.raises(SystemExit, match=message):
        main(["steer", "--prompt", "hi", *argv])


def test_collect_refuses_a_release_without_sae_layers_instead_of_ignoring_it(tmp_path):
    # Before: the release was dropped silently and only the dense points were stored.
    with pytest.raises(SystemExit, match=r"--release REL needs --sae-layers \(e\.g\. 6,12 or all\)"):
        main(["collect", "model", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o"), "--tokens", "10",
              "--points", "resid_post.1", "--release", "REL"])
