"""The notebooks in ``notebooks/`` run top to bottom on CPU (bundled defaults) without an error.

Each runs in a fresh kernel inside a temporary directory (what they write stays there). Committed notebooks carry no
outputs, and import only the public API.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
PUBLIC = re.compile(r"^\s*(?:from|import)\s+(qwen_scope|saes|hooks)(\.[\w.]+)?", re.M)
# Modules a notebook may import from besides the package roots: documented entry points.
ALLOWED_SUBMODULES = {"qwen_scope.nano", "qwen_scope.collect", "qwen_scope.explore", "qwen_scope.applications",
                      "qwen_scope.evals"}


def test_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_features_of_a_text.ipynb", "02_steering.ipynb",
                                          "03_collect_and_explore.ipynb", "04_applications.ipynb",
                                          "05_evaluation.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean_and_uses_the_public_api(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name}: strip outputs"
        for root, sub in PUBLIC.findall("".join(cell["source"])):
            assert not sub or f"{root}{sub}" in ALLOWED_SUBMODULES, f"{path.name} imports private {root}{sub}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
