"""The README's Python blocks fenced ``python runnable`` run offline as written, so what they show stays true."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python runnable\n(.*?)^```", re.M | re.S)


def test_the_readme_marks_runnable_blocks():
    assert BLOCK.findall(README.read_text())


@pytest.mark.parametrize("index", range(len(BLOCK.findall(README.read_text()))))
def test_readme_runnable_block_executes(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = BLOCK.findall(README.read_text())[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
