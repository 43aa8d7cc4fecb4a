"""Review finding in the dashboard index: odd tokens and labels cannot end or swallow the embedded JSON."""
from __future__ import annotations

import json

from qwen_scope.explore import build_feature_database, write_dashboard
from tests.qwen_scope.test_explore_database import D_SAE, chunks, synthetic


def test_index_json_has_no_raw_angle_bracket_and_round_trips(tmp_path):
    db = build_feature_database(chunks(synthetic(), 100), D_SAE, meta={"point": "resid_post.2", "layer": 2})
    label = 'HTML comment <!-- <script> x </script> "quoted"'
    db.annotate(5, label=label)
    odd = ["<!--", "<script>"]  # both real tokens of a feature that fires on HTML

    def decode(ids):
        return [odd[i % 2] for i in range(len(ids))]

    index = write_dashboard(db, tmp_path, decode=decode, features=[5], export_json=False)
    text = index.read_text()
    raw = text.split('id="qs-data">')[1].split("</script>")[0]
    # In script data, "<!--" followed by "<script>" enters the double-escaped state; the element's own
    # "</script>" would then not close it and the page's search script would be swallowed.
    assert "<" not in raw
    data = json.loads(raw)
    assert data[0]["label"] == label
