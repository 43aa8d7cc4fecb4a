"""The notebooks in ``notebooks/`` run top to bottom on CPU (bundled defaults) without an error.

Each runs in a fresh kernel inside a temporary directory (what they write stays there). Committed notebooks carry no
outputs, and import only the public API. The ones that drive the ipywidgets explorer run with ipywidgets (the dev extra
installs it), the others as a user without it. Their real-model cells (which run only when the weights are in the hub
cache) run too, offline, against a fake hub cache holding a tiny model and SAE file under the real repo ids.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.fake_hub import write_fake_release

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
PUBLIC = re.compile(r"^\s*(?:from|import)\s+(qwen_scope|saes|hooks)(\.[\w.]+)?", re.M)
# Modules a notebook may import from besides the package roots: documented entry points.
ALLOWED_SUBMODULES = {"qwen_scope.nano", "qwen_scope.collect", "qwen_scope.explore", "qwen_scope.applications",
                      "qwen_scope.evals"}
# Notebooks that drive the ipywidgets explorer (``scope.explore``) from their cells and check what it shows.
WIDGET_NOTEBOOKS = {"06_explore_app"}
# The release and layer the notebooks' real-model cells ask the hub cache for.
REAL_RELEASE, REAL_LAYER = "qwen-scope-3.5-2b-base-w32k-l50", 12


def _has_real_cells(path: Path) -> bool:
    return "Scope.from_pretrained(" in "".join(
        "".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")


@pytest.fixture(scope="session")
def fake_hub_home(tmp_path_factory) -> Path:
    """An ``HF_HOME`` whose hub cache holds the real-model cells' model and SAE file (tiny, random)."""
    home = tmp_path_factory.mktemp("hf_home")
    write_fake_release(home / "hub", REAL_RELEASE, (REAL_LAYER,))
    return home


def test_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_features_of_a_text.ipynb", "02_steering.ipynb",
                                          "03_collect_and_explore.ipynb", "04_applications.ipynb",
                                          "05_evaluation.ipynb", "06_explore_app.ipynb"]


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
def test_notebook_executes(path, tmp_path, request, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    real = _has_real_cells(path)
    if real:
        # The kernel inherits this environment: its hub cache is the fake one, and nothing is downloaded.
        home = request.getfixturevalue("fake_hub_home")
        monkeypatch.setenv("HF_HOME", str(home))
        monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(path, as_version=4)
    if path.stem in WIDGET_NOTEBOOKS:
        pytest.importorskip("ipywidgets")
    else:
        # Run as a user without ipywidgets: tqdm's text bars, and no warning telling them to install it.
        nb.cells.insert(0, nbformat.v4.new_code_cell("import sys\nsys.modules['ipywidgets'] = None"))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr and "ipywidgets" not in stderr, stderr
    # nbconvert's HTML export shows text/html, never plotly's own mimetype: each figure must carry both.
    figures = [o["data"] for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figures or not path.stem.startswith("01"), "notebook 01 shows figures"
    assert all("Plotly.newPlot" in f.get("text/html", "") for f in figures), f"{path.name}: a figure without HTML"
    if real:
        printed = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
        assert "real weights present: True" in printed, f"{path.name}'s real-model cell did not run"
