"""benchmarks/collect_scaling.py's dry run on CPU: world sizes 1 and 2 of a tiny model under torchrun (gloo), each
store complete and equal to the world-size-1 store as a set of token rows and codes, the results written."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.slow
def test_dry_run_collects_at_two_world_sizes_and_the_stores_hold_the_same_tokens_and_codes(tmp_path):
    import collect_scaling

    collect_scaling.main(["--tiny", "--out", str(tmp_path / "results"), "--work", str(tmp_path / "work")])
    result = json.loads((tmp_path / "results" / "collect_scaling.json").read_text())
    one, two = result["runs"]
    assert (one["world"], two["world"]) == (1, 2) and one["efficiency"] == 1.0
    assert one["n_tokens"] == two["n_tokens"] == 1024 and one["complete"] and two["complete"]
    assert one["layers"] == [3] and two["shards"] == 2  # the tiny model's last layer; one shard a rank
    cmp = two["compare"]
    assert cmp["token_rows_equal"] and cmp["complete"]
    # on CPU every row's codes are the same whichever rank and batch computed them
    assert cmp["points"] == {"resid_post.3": {"shared_indices": 1.0, "max_rel_value_diff": 0.0}}
    text = (tmp_path / "results" / "collect_scaling.md").read_text()
    assert "| 2 |" in text and "True" in text


def test_world_sizes_must_start_at_one(tmp_path):
    import collect_scaling

    with pytest.raises(SystemExit, match="must start at 1"):
        collect_scaling.main(["--tiny", "--world-sizes", "2,4", "--out", str(tmp_path)])
