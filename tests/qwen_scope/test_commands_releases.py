"""``qwen-scope releases``: the table, the JSON records and the cached-layer count from a fake hub cache."""
from __future__ import annotations

import json

from qwen_scope.cli import main
from tests.factories import write_hub_cache_release


def test_table_lists_all_fourteen_sets_with_sizes(capsys, tmp_path):
    assert main(["releases", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("qwen-scope-")]
    assert len(rows) == 14
    row = next(r for r in rows if r.startswith("qwen-scope-3.5-27b-w80k-l100 "))
    assert row.split() == ["qwen-scope-3.5-27b-w80k-l100", "instruct", "64", "5120", "81920", "100", "3.36", "GB",
                           "214.8", "GB", "0/64"]


def test_json_records_count_cached_layers(capsys, tmp_path):
    write_hub_cache_release(tmp_path, repo_id="Qwen/SAE-Res-Qwen3.5-2B-Base-W32K-L0_100", layers=[3, 12])
    assert main(["releases", "--model", "qwen3.5-2b", "--json", "--cache-dir", str(tmp_path)]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["cached_layers"]) for r in records] == [
        ("qwen-scope-3.5-2b-base-w32k-l50", 0), ("qwen-scope-3.5-2b-base-w32k-l100", 2)]
    assert records[1]["file_bytes"] == 4 * (2 * 2048 * 32768 + 32768 + 2048)
    assert records[1]["total_bytes"] == 24 * records[1]["file_bytes"]


def test_no_match_says_so(capsys):
    assert main(["releases", "--model", "llama"]) == 1
    assert "no release matches" in capsys.readouterr().out
