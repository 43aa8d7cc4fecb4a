"""benchmarks/train_step.py on CPU: a tiny dry run of the arms that exist here writes the JSON and the table, and the
one missing here (FlashQLA's op) is a row naming why (the H200 run is a device phase; no timing is asserted)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_tiny_dry_run_trains_through_finetune_on_every_arm_it_can(tmp_path):
    import train_step

    train_step.main(["--tiny", "--out", str(tmp_path), "--steps", "2"])
    result = json.loads((tmp_path / "train_step.json").read_text())
    arms = {r["arm"]: r for r in result["arms"]}
    assert set(arms) == {"transformers", "flashqla", "ours"}
    for name in ("transformers", "ours"):
        assert "error" not in arms[name] and arms[name]["tokens_per_s"] > 0, arms[name]
    assert "flash_qla" in arms["flashqla"]["error"]
    assert (result["batch"], result["micro"], result["seq_len"]) == (2, 1, 64)
    assert "| ours |" in (tmp_path / "train_step.md").read_text()
