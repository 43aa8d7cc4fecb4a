"""The house's shape: dependencies point one way, every import is one a reader can follow, and importing a package
changes nothing global."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flashqla_kernels", "hooks", "qwen_scope", "saes")
# what each room may not import (module-level and function-level imports alike): qwen_scope composes the other three;
# saes may use the kernel room's dispatcher and TileLang toolkit; flashqla_kernels stands alone
FORBIDDEN = {
    "saes": {"qwen_scope", "hooks"},
    "hooks": {"qwen_scope", "saes", "flashqla_kernels"},
    "flashqla_kernels": {"qwen_scope", "saes", "hooks"},
}


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def _imported_top_levels(tree: ast.AST) -> set[str]:
    """Top-level package of every import statement anywhere in the module (ast.walk reaches function bodies)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _string_imports(tree: ast.AST) -> list[str]:
    """Calls of importlib.import_module / __import__ whose argument names (or builds) one of our modules."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in ("import_module", "__import__"):
            continue
        text = ast.unparse(node.args[0])
        if any(p in text for p in PACKAGES) or not isinstance(node.args[0], ast.Constant):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _sources(*roots: str):
    for root in roots:
        yield from sorted((ROOT / root).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_packages_never_import_upward(package):
    offenders = []
    for path in _sources(package):
        bad = _imported_top_levels(_tree(path)) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "dependency direction broken:\n" + "\n".join(offenders)


def test_no_string_imports_of_our_modules():
    offenders = [f"{path.relative_to(ROOT)} {hit}" for path in _sources(*PACKAGES, "tests", "benchmarks")
                 for hit in _string_imports(_tree(path)) if "transformers.models" not in hit]
    assert not offenders, "string imports (use a plain import, function-level if it must be lazy):\n" + "\n".join(
        offenders)


def test_string_import_detector_sees_both_spellings():
    tree = ast.parse("import importlib\ndef f():\n    importlib.import_module('saes.topk')\n    __import__(name)\n")
    assert len(_string_imports(tree)) == 2
    assert _imported_top_levels(ast.parse("def f():\n    from hooks import capture\n")) == {"hooks"}


def test_importing_flashqla_kernels_touches_neither_cuda_nor_tilelang():
    code = ("import sys, flashqla_kernels, flashqla_kernels.gated_delta_rule, flashqla_kernels.dispatch, "
            "flashqla_kernels.toolkit; "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'; "
            "import torch; assert not torch.cuda.is_initialized(), 'CUDA initialised'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_lists_its_commands():
    out = subprocess.run([sys.executable, "-m", "qwen_scope", "--help"], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    assert "qwen-scope" in out
