"""benchmarks/store_layout.py --smoke on the nano model: both store layouts hold the same codes, their bytes a code
add up exactly (v2: 4, v1: 6, plus 16 bytes a token and the shard headers), and the JSON and the table carry every
field. No timing is asserted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from qwen_scope.store_writer import code_bytes

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

RATES = ("read_cold_codes_per_s", "read_warm_codes_per_s", "index_codes_per_s", "lookups_per_s",
         "iterator_codes_per_s")
BYTES = ("shard_bytes", "code_tensor_bytes", "meta_tensor_bytes", "header_bytes", "n_tokens", "n_codes",
         "codes_per_token", "bytes_per_code", "bytes_per_token", "code_bytes_per_code", "meta_bytes_per_token",
         "header_bytes_per_token")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    import store_layout

    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    result = store_layout.main(["--smoke", "--out", str(out), "--work", str(work)])
    return result, out


def test_both_layouts_give_identical_codes(smoke):
    result, _ = smoke
    checks = result["checks"]
    assert checks["versions"] == [2, 1]
    assert all(checks[k] is True for k in ("same_codes", "same_feature_index", "same_shuffled_batches",
                                           "same_lookups", "lookups_match_stored_codes"))
    assert checks["index_dtypes"] == {"v2": True, "v1": True}


@pytest.mark.parametrize("layout, per_code", [("v2", 4), ("v1", 6)])
def test_bytes_a_code_are_the_code_tensors_plus_16_bytes_a_token_and_the_headers(smoke, layout, per_code):
    result, _ = smoke
    r = result["layouts"][layout]
    assert r["version"] == {"v2": 2, "v1": 1}[layout]
    assert r["code_bytes_per_code"] == per_code
    # token_ids int32 + doc_index int64 + positions int32
    assert r["meta_bytes_per_token"] == 16
    assert r["n_codes"] == r["n_tokens"] * len(result["points"]) * result["k"] == r["n_tokens"] * r["codes_per_token"]
    assert r["shard_bytes"] == per_code * r["n_codes"] + 16 * r["n_tokens"] + r["header_bytes"]
    # the headers: 8 length bytes and a JSON header of about 1.4 KB a shard (names, shapes, offsets, metadata)
    assert 8 * result["n_shards"] < r["header_bytes"] < 2048 * result["n_shards"]
    assert r["bytes_per_code"] == pytest.approx(per_code + 16 / r["codes_per_token"] + r["header_bytes"] / r["n_codes"])
    assert r["bytes_per_token"] == pytest.approx(per_code * r["codes_per_token"] + 16 + r["header_bytes_per_token"])


def test_the_json_and_the_table_carry_every_field(smoke):
    result, out = smoke
    saved = json.loads((out / "store_layout.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert set(saved["env"]) >= {"cpu", "cores", "torch", "python", "commit", "date"}
    assert saved["settings"]["smoke"] is True and saved["n_shards"] >= 2
    for layout in ("v2", "v1"):
        row = saved["layouts"][layout]
        assert set(row) == {"version", *BYTES, *RATES}
        assert all(row[k] > 0 for k in RATES)
    q = saved["v2_over_v1"]
    assert set(q) == {"bytes_per_code", "bytes_per_token", *RATES}
    v2, v1 = saved["layouts"]["v2"], saved["layouts"]["v1"]
    assert v2["code_bytes_per_code"] == code_bytes(saved["d_sae"], saved["k"])
    assert q["bytes_per_code"] == pytest.approx(v2["bytes_per_code"] / v1["bytes_per_code"])
    assert q["bytes_per_code"] < 0.7
    table = (out / "store_layout.md").read_text()
    assert "| layout | bytes/code | bytes/token | read codes/s cold | read codes/s warm |" in table
    assert all(f"| {row} |" in table or f"| {row} (" in table for row in ("v2", "v1", "v2 / v1"))
