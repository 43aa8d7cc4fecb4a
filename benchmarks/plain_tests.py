"""Run a pytest module's test functions as plain calls, on a host where pytest may be missing (the GPU machine's
bare image): parametrize marks expanded, a minimal ``monkeypatch``, ``pytest.skip`` reported as SKIP and
``pytest.xfail`` as XFAIL, each case's printed lines kept, PASS / SKIP / XFAIL / FAIL per case written to a file.

Call ``install_pytest_stand_in()`` before importing the test module (its ``pytest.mark`` decorators run at import),
then ``run_module(module, ...)``.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import sys
import traceback
from pathlib import Path


def test_cases(module) -> list[tuple[str, object, dict]]:
    """Every (id, function, kwargs) of a pytest module's ``test_*`` functions, parametrize marks expanded."""
    cases = []
    for name, fn in vars(module).items():
        if not (name.startswith("test_") and callable(fn)):
            continue
        combos: list[dict] = [{}]
        for mark in reversed(getattr(fn, "pytestmark", [])):
            if mark.name != "parametrize":
                continue
            names = [a.strip() for a in mark.args[0].split(",")] if isinstance(mark.args[0], str) else mark.args[0]
            combos = [dict(c, **dict(zip(names, v if len(names) > 1 else (v,)))) for c in combos for v in mark.args[1]]
        cases += [(f"{name}[{','.join(map(str, c.values()))}]" if c else name, fn, c) for c in combos]
    return cases


class Mark:
    def __init__(self, name: str, args: tuple):
        self.name, self.args = name, args


class MarkFactory:
    """``pytest.mark`` for hosts without pytest: records marks the way pytest does (``fn.pytestmark``)."""

    def __getattr__(self, name: str):
        def mark(*args):
            if len(args) == 1 and callable(args[0]) and name != "parametrize":
                return mark()(args[0])

            def decorate(fn):
                fn.pytestmark = [*getattr(fn, "pytestmark", []), Mark(name, args)]
                return fn
            return decorate
        return mark


class MonkeyPatch:
    def __init__(self):
        self._undo: list = []

    def setattr(self, obj, name, value):
        # an attribute a class inherits is deleted again on undo (as pytest's does), not pinned on the class
        inherited = isinstance(obj, type) and name not in vars(obj)
        self._undo.append((obj, name, None if inherited else getattr(obj, name), inherited))
        setattr(obj, name, value)

    def undo(self):
        for obj, name, value, inherited in reversed(self._undo):
            if inherited:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        self._undo.clear()


def install_pytest_stand_in() -> None:
    """Make ``import pytest`` give a stand-in with ``pytest.mark`` where pytest is not installed (no-op where it is)."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        import types

        sys.modules["pytest"] = types.SimpleNamespace(mark=MarkFactory())


def run_module(module, out_file: Path, header: str, only: str = "", before_each=None) -> int:
    """Run every case of the imported test ``module`` (or those whose id contains one of the comma-separated ``only``
    substrings) and write PASS / SKIP / FAIL lines under ``header`` to ``out_file``; ``before_each()`` runs before
    each case (e.g. seeding). Returns the number of failures."""
    lines, failures = [header], 0
    keys = [x for x in only.split(",") if x]
    for case_id, fn, kwargs in test_cases(module):
        if keys and not any(x in case_id for x in keys):
            continue
        mp, buf = MonkeyPatch(), io.StringIO()
        if "monkeypatch" in inspect.signature(fn).parameters:
            kwargs = dict(kwargs, monkeypatch=mp)
        try:
            if before_each is not None:
                before_each()
            with contextlib.redirect_stdout(buf):
                fn(**kwargs)
            lines.append(f"PASS {case_id} {buf.getvalue().strip()}".rstrip())
        except BaseException as err:  # noqa: BLE001 - pytest.skip raises a BaseException subclass
            if type(err).__name__ == "Skipped":
                lines.append(f"SKIP {case_id} {buf.getvalue().strip()} ({err})")
            elif type(err).__name__ == "XFailed":  # pytest.xfail: an expected failure, reported with its reason
                lines.append(f"XFAIL {case_id} ({err}) {buf.getvalue().strip()}".rstrip())
            elif isinstance(err, Exception):
                failures += 1
                lines.append(f"FAIL {case_id} {buf.getvalue().strip()}\n{traceback.format_exc(limit=4)}")
            else:
                raise
        finally:
            mp.undo()
        print(lines[-1], flush=True)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("\n".join(lines) + "\n")
    return failures
