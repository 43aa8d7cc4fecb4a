"""The house's shape: dependencies point one way, and importing a package changes nothing global."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "saes": {"qwen_scope"},
    "hooks": {"qwen_scope"},
    "flashqla_kernels": {"qwen_scope", "saes", "hooks"},
}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_packages_never_import_upward(package):
    offenders = []
    for path in (ROOT / package).rglob("*.py"):
        bad = _imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "dependency direction broken:\n" + "\n".join(offenders)


def test_importing_flashqla_kernels_touches_neither_cuda_nor_tilelang():
    code = ("import sys, flashqla_kernels, flashqla_kernels.gated_delta_rule; "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'; "
            "import torch; assert not torch.cuda.is_initialized(), 'CUDA initialised'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_lists_its_commands():
    out = subprocess.run([sys.executable, "-m", "qwen_scope", "--help"], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    assert "qwen-scope" in out
