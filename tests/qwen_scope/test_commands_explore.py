"""``qwen-scope explore``: a real collection store (tiny model saved to disk + an SAE release directory) in, the
dashboard and the feature database out, with the numbers of the store; a database in OUT mined from another point or
store is refused, --rebuild keeps the labels."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from qwen_scope.cli import main
from qwen_scope.collect import collect
from qwen_scope.explore import FeatureDatabase
from qwen_scope.store import ActivationStore
from tests.factories import tiny_model, write_sae_release

NANO_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LAYER = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from pathlib import Path

    import qwen_scope

    root = tmp_path_factory.mktemp("explore")
    model_dir = root / "tiny-model"
    tiny_model("qwen3_5").save_pretrained(model_dir)
    data = Path(qwen_scope.__file__).parent / "data" / "nano"
    for name in NANO_TOKENIZER:  # a byte-level tokenizer: ids < 256 fit the tiny model's vocabulary
        shutil.copy(data / name, model_dir / name)
    release = write_sae_release(root, d_sae=256)
    corpus = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(60)]
    collect(str(model_dir), corpus, sae_layers=[LAYER], release=str(release), token_budget=900, context_len=64,
            out_dir=root / "store", separator_id=None, progress=False, dtype=torch.float32)
    out = root / "dash"
    code = main(["explore", "--store", str(root / "store"), "--release", str(release), "--out", str(out),
                 "--max-features", "12", "--context", "3,2"])
    return root, out, code


def test_explore_writes_dashboard_and_database(run):
    root, out, code = run
    assert code == 0
    pages = sorted(out.glob("features/*.html"))
    assert len(pages) == 12 and (out / "index.html").exists() and (out / "plotly.min.js").exists()
    db = FeatureDatabase.load(out / "database")
    assert db.meta["point"] == f"resid_post.{LAYER}" and db.config.context == (3, 2)
    assert sorted(int(p.stem) for p in pages) == sorted(db.top_features(12))
    entries = json.loads((out / "index.html").read_text().split('id="qs-data">')[1].split("</script>")[0])
    assert all(e["logits"] for e in entries), "the model was loaded: every page has a logit lens"


def test_database_matches_the_store(run):
    root, out, _ = run
    store = ActivationStore(root / "store")
    codes = store.sae_codes(f"resid_post.{LAYER}")
    dense = codes.to_dense(256).float()
    dense[store.positions() == 0] = 0
    db = FeatureDatabase.load(out / "database")
    assert torch.equal(db.count, (dense > 0).sum(0))
    f = db.top_features(1)[0]
    best = db.top_examples(f)[0]
    assert best.token_index == int(dense[:, f].argmax()) and best.value == pytest.approx(float(dense[:, f].max()))
    assert best.tokens[best.mark] == int(store.token_ids()[best.token_index])
    card = json.loads((out / "json" / f"{f}.json").read_text())
    assert card["maxActApprox"] == pytest.approx(best.value)


def _copy(run, tmp_path):
    """A copy of the module's dashboard to change: the tests that read ``run``'s own see it as built."""
    root, out, code = run
    assert code == 0
    dest = tmp_path / "dash"
    shutil.copytree(out, dest)
    return root, dest


def test_explore_reuses_the_database_and_can_skip_the_model(run, tmp_path, capsys):
    root, out = _copy(run, tmp_path)
    release = root / "SAE-Res-Qwen3.5-Nano-Base-W0K-L0_8"
    assert main(["explore", "--store", str(root / "store"), "--release", str(release), "--out", str(out),
                 "--features", "3,4", "--no-model"]) == 0
    assert "reusing the feature database" in capsys.readouterr().out
    entries = json.loads((out / "index.html").read_text().split('id="qs-data">')[1].split("</script>")[0])
    assert [e["id"] for e in entries] == [3, 4] and entries[0]["logits"] == []


def test_explore_names_missing_layers(run, capsys):
    root, out, _ = run
    assert main(["explore", "--store", str(root / "store"), "--out", str(out), "--layer", "0"]) == 2
    assert re.search("no SAE codes at resid_post.0", capsys.readouterr().err)


def test_explore_explains_an_unloadable_model(run, tmp_path, capsys):
    root, _, _ = run
    release = root / "SAE-Res-Qwen3.5-Nano-Base-W0K-L0_8"
    assert main(["explore", "--store", str(root / "store"), "--release", str(release), "--out", str(tmp_path),
              "--model", str(tmp_path / "no-such-model"), "--features", "1"]) == 2
    assert re.search(r"model directory .*no-such-model does not exist", capsys.readouterr().err)


def test_explore_refuses_a_database_mined_at_another_point(run, tmp_path, capsys):
    root, dest = _copy(run, tmp_path)
    db = FeatureDatabase.load(dest / "database")
    db.meta["point"] = "resid_post.0"
    db.save(dest / "database")
    assert main(["explore", "--store", str(root / "store"), "--out", str(dest), "--features", "1", "--no-model"]) == 2
    assert re.search(r"mined with point='resid_post.0'.*resid_post.2.*--rebuild", capsys.readouterr().err)


def test_explore_refuses_a_database_of_another_store(run, tmp_path, capsys):
    root, dest = _copy(run, tmp_path)
    db = FeatureDatabase.load(dest / "database")
    db.meta["store_config_hash"] = "0123456789abcdef"
    db.save(dest / "database")
    assert main(["explore", "--store", str(root / "store"), "--out", str(dest), "--features", "1", "--no-model"]) == 2
    assert re.search("store_config_hash='0123456789abcdef'", capsys.readouterr().err)


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
