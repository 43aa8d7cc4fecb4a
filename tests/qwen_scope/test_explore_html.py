"""Dashboard pages and JSON export: files parse, open from disk and carry the database's numbers; odd tokens and
labels cannot end or swallow the index's embedded JSON."""
from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch

from qwen_scope.explore import build_feature_database, feature_card, write_dashboard
from saes import TopKSAE
from tests.factories import random_sae_state, tiny_model
from tests.qwen_scope.test_explore_database import D_SAE, chunks, synthetic


class Collector(HTMLParser):
    """Collects tags, text, links, scripts; fails on unbalanced div/table/span tags."""

    VOID = {"meta", "input", "br", "img", "link", "rect"}

    def __init__(self):
        super().__init__()
        self.stack, self.text, self.links, self.scripts, self.tags = [], [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if tag == "a":
            self.links.append(attrs.get("href"))
        if tag == "script":
            self.scripts.append(attrs)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse(text: str) -> Collector:
    c = Collector()
    c.feed(text)
    c.close()
    assert not c.stack, f"unclosed tags {c.stack}"
    return c


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    model = tiny_model("qwen3_5")
    sae = TopKSAE.from_release_state(random_sae_state(d_sae=D_SAE), k=8)
    db = build_feature_database(chunks(synthetic(), 100), D_SAE,
                                meta={"model": "tiny/qwen3_5", "point": "resid_post.2", "layer": 2})
    db.annotate(5, label="five <b>&", notes="a note")
    decode = lambda ids: [f"t{i}" for i in ids]  # noqa: E731
    out = tmp_path_factory.mktemp("dash")
    index = write_dashboard(db, out, model=model, sae=sae, decode=decode, features=[5, 6, 9])
    return db, model, sae, decode, out, index


def test_index_page_parses_and_embeds_the_search_data(built):
    db, _, _, _, out, index = built
    assert index == out / "index.html"
    page = parse(index.read_text())
    data = json.loads(index.read_text().split('id="qs-data">')[1].split("</script>")[0])
    assert [d["id"] for d in data] == [5, 6, 9]
    first = data[0]
    assert first["label"] == "five <b>&" and first["href"] == "features/5.html"
    assert first["max"] == pytest.approx(float(db.act_max[5]))
    assert first["tokens"][0] == f"t{db.top_examples(5)[0].tokens[db.top_examples(5)[0].mark]}"
    assert {"src": "plotly.min.js"} in page.scripts and (out / "plotly.min.js").stat().st_size > 1_000_000


def test_feature_pages_parse_and_contain_the_data(built):
    db, _, sae, _, out, _ = built
    text = (out / "features" / "5.html").read_text()
    page = parse(text)
    words = "".join(page.text)
    assert "Feature #5" in words and "five <b>&" in words and "a note" in words
    assert "five &lt;b&gt;&amp;" in text
    for e in db.top_examples(5):
        assert f"{e.value:.3f}" in words
    assert f"decoder norm {float(sae.W_dec.detach()[:, 5].norm()):.3f}" in words
    assert "../index.html" in page.links
    assert all(link in ("../index.html", "5.html", "6.html", "9.html") for link in page.links)
    assert not (out / "features" / "7.html").exists()


def test_exported_json_has_the_neuronpedia_shape(built):
    db, model, sae, decode, out, _ = built
    data = json.loads((out / "json" / "5.json").read_text())
    assert data["index"] == 5 and data["modelId"] == "tiny/qwen3_5" and data["layer"] == "2-qwen-scope-res"
    assert data["maxActApprox"] == pytest.approx(float(db.act_max[5]))
    assert data["frac_nonzero"] == pytest.approx(float(db.density[5]))
    assert sum(data["freq_hist_data_bar_heights"]) == int(db.count[5])
    top = [a for a in data["activations"] if a["bin_min"] == -1]
    assert [a["maxValue"] for a in top] == pytest.approx([e.value for e in db.top_examples(5)])
    ex = db.top_examples(5)[0]
    assert top[0]["tokens"] == decode(ex.tokens) and top[0]["qualifying_token_index"] == ex.mark
    binned = [a for a in data["activations"] if a["bin_min"] != -1]
    assert len(binned) == sum(len(b.examples) for b in db.quantile_bins(5))
    assert all(a["bin_min"] <= a["maxValue"] <= a["bin_max"] for a in binned)
    card = feature_card(db, 5, model=model, sae=sae, decode=decode)
    assert data["pos_str"] == [s for s, _ in card.logit_top] and len(data["neg_values"]) == 10
    assert data["topkCosSimIndices"] == list(card.view.neighbors)
    assert data["explanations"][0]["description"] == "five <b>&"
    assert data["correlated_features_indices"] == [c.other for c in db.cooccurring(5)]


def test_card_repr_html_and_database_repr_html(built):
    db, model, sae, decode, _, _ = built
    card = feature_card(db, 6, model=model, sae=sae, decode=decode)
    fragment = card._repr_html_()
    parse(fragment)
    assert "Feature #6" in fragment and f"{db.top_examples(6)[0].value:.3f}" in fragment
    summary = db._repr_html_()
    parse(summary)
    assert f"{D_SAE} features" in summary


def test_html_file_target_puts_pages_beside_it(built, tmp_path):
    db, *_ = built
    index = write_dashboard(db, tmp_path / "dashboard.html", features=[1])
    assert index == tmp_path / "dashboard.html"
    assert (tmp_path / "dashboard_files" / "features" / "1.html").exists()
    assert "dashboard_files/features/1.html" in index.read_text()
    assert "../../dashboard.html" in (tmp_path / "dashboard_files" / "features" / "1.html").read_text()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_index_renders_in_headless_chromium(built, tmp_path):
    _, _, _, _, out, index = built
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(cmd + ["--dump-dom", index.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert dom.count('href="features/') == 3 and "3 of 3 features" in dom
    shot = tmp_path / "index.png"
    subprocess.run(cmd + [f"--screenshot={shot}", "--window-size=1200,800", index.as_uri()], capture_output=True,
                   timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_feature_on_text_colours_tokens_by_the_feature():
    from qwen_scope.explore import feature_on_text
    from tests.qwen_scope.test_explore_figures import layer_features
    from qwen_scope.features import TextFeatures

    lf = layer_features(2, 0)
    feats = TextFeatures("abc", torch.arange(6), ["<s>", "a", "b", "<c>", "d", "e"], {2: lf}, skip_first=True)
    f = int(lf.indices[3, 0])
    view = feature_on_text(feats, 2, f)
    parse(view)
    assert view._repr_html_() == str(view) and "&lt;c&gt;" in view
    dense = lf.dense()[:, f]
    assert f"max {float(dense.max()):.3f}" in view
    assert view.count("rgba(230,85,13,1.00)") == int((dense == dense.max()).sum())


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


class Attributes(HTMLParser):
    """Every start tag with its attributes, to check that nothing hostile became markup."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


_HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A dashboard whose index file name, label, notes, tokens and provenance are all hostile or local paths."""
    root = tmp_path_factory.mktemp("hostile")
    model_dir, store_dir = root / "models" / "tiny-qwen", root / "runs" / "store"
    model_dir.mkdir(parents=True)
    store_dir.mkdir(parents=True)
    db = build_feature_database(chunks(synthetic(), 100), D_SAE,
                                meta={"model": str(model_dir), "store": str(store_dir), "point": "resid_post.2",
                                      "layer": 2, "release": _HOSTILE})
    db.annotate(5, label=_HOSTILE, notes=f"</p>{_HOSTILE}")
    index = write_dashboard(db, root / f'x"><img src=q onerror=alert(1)>.html', decode=lambda ids: [_HOSTILE] * len(ids),
                            features=[5, 6])
    return root, index


def _written(root):
    return [p for p in root.rglob("*") if p.is_file() and p.suffix in (".html", ".json")]


def test_hostile_names_and_texts_are_escaped_everywhere(hostile):
    import urllib.parse

    root, index = hostile
    pages = [p for p in _written(root) if p.suffix == ".html"]
    assert len(pages) == 3
    for page in pages:
        found = Attributes()
        found.feed(page.read_text())
        assert all(tag != "img" for tag, _ in found.tags), page
        assert not [a for _, attrs in found.tags for a in attrs if a.startswith("on")], page
        # Every link and script source resolves to a file that exists, from the page's own folder.
        for tag, attrs in found.tags:
            target = attrs.get("href") or attrs.get("src") if tag in ("a", "script") else None
            if target:
                assert (page.parent / urllib.parse.unquote(target)).exists(), (page, target)
    data = json.loads(index.read_text().split('id="qs-data">')[1].split("</script>")[0])
    for entry in data:
        assert (index.parent / urllib.parse.unquote(entry["href"])).exists() and '"' not in entry["href"]


def test_exports_carry_no_local_paths_and_plotly_is_written_once(hostile):
    root, index = hostile
    for file in _written(root):
        assert str(root) not in file.read_text(), file
    assert "Features of tiny-qwen at resid_post.2" in index.read_text()
    card = json.loads(next(root.rglob("5.json")).read_text())
    assert card["modelId"] == "tiny-qwen"
    (plotly,) = root.rglob("plotly.min.js")
    assert plotly.stat().st_size > 1_000_000
    assert all(p.stat().st_size < 200_000 for p in _written(root))  # no page inlines plotly.js


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_hostile_dashboard_executes_nothing_in_headless_chromium(hostile, tmp_path):
    root, index = hostile
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    for page in [index, *sorted(root.rglob("features/*.html"))]:
        dom = subprocess.run(cmd + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
        assert "<html" in dom and "pwned" not in dom.split("</title>")[0]
