"""benchmarks/steer_generate.py on CPU: a tiny dry run of every arm writes the JSON and the table (the H200 run is a
device phase; no timing is asserted here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_tiny_dry_run_times_every_arm_and_the_arms_agree(tmp_path):
    import steer_generate

    steer_generate.main(["--tiny", "--out", str(tmp_path), "--batches", "2", "--new", "3"])
    result = json.loads((tmp_path / "steer_generate.json").read_text())
    arms = {(r["arm"], r["steering"]): r for r in result["arms"]}
    assert set(arms) == {(a, s) for a in ("engine", "hf", "hf+patches") for s in ("none", "add", "clamp")}
    for row in arms.values():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["agree"] == "6/6"
    assert result["floor_ms"] > 0
    assert "| engine | 2 | add |" in (tmp_path / "steer_generate.md").read_text()
