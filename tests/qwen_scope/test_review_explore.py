"""Review findings in ``qwen-scope explore``: a database in OUT mined elsewhere is not reused; --rebuild keeps labels."""
from __future__ import annotations

import shutil

import pytest
import torch

from qwen_scope.cli import main
from qwen_scope.explore import FeatureDatabase
from tests.qwen_scope.test_explore_cli import run  # noqa: F401  (the module fixture: store, release, dashboard)


def _copy(run, tmp_path):
    root, out, code = run
    assert code == 0
    dest = tmp_path / "dash"
    shutil.copytree(out, dest)
    return root, dest


def test_explore_refuses_a_database_mined_at_another_point(run, tmp_path):
    root, dest = _copy(run, tmp_path)
    db = FeatureDatabase.load(dest / "database")
    db.meta["point"] = "resid_post.0"
    db.save(dest / "database")
    with pytest.raises(SystemExit, match=r"mined with point='resid_post.0'.*resid_post.2.*--rebuild"):
        main(["explore", "--store", str(root / "store"), "--out", str(dest), "--features", "1", "--no-model"])


def test_explore_refuses_a_database_of_another_store(run, tmp_path):
    root, dest = _copy(run, tmp_path)
    db = FeatureDatabase.load(dest / "database")
    db.meta["store_config_hash"] = "0123456789abcdef"
    db.save(dest / "database")
    with pytest.raises(SystemExit, match="store_config_hash='0123456789abcdef'"):
        main(["explore", "--store", str(root / "store"), "--out", str(dest), "--features", "1", "--no-model"])


def test_rebuild_keeps_the_labels_of_the_same_point(run, tmp_path):
    root, dest = _copy(run, tmp_path)
    db = FeatureDatabase.load(dest / "database")
    db.annotate(5, label="digits", notes="fires on numbers")
    release = db.meta["release"]
    assert main(["explore", "--store", str(root / "store"), "--release", release, "--out", str(dest),
                 "--features", "5", "--no-model", "--rebuild"]) == 0
    again = FeatureDatabase.load(dest / "database")
    assert again.label(5) == "digits" and again.notes(5) == "fires on numbers"
    assert torch.equal(again.count, db.count)



def test_page_count_is_this_runs_selection_not_every_file_in_features(run, tmp_path, capsys):
    root, dest = _copy(run, tmp_path)
    assert len(list((dest / "features").glob("*.html"))) == 12
    assert main(["explore", "--store", str(root / "store"), "--out", str(dest), "--features", "3,4",
                 "--no-model"]) == 0
    assert "dashboard with 2 feature pages" in capsys.readouterr().out
