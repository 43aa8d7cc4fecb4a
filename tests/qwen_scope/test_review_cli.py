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
