"""The feature database equals a brute-force scan of the same synthetic codes, whatever the chunking."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qwen_scope.explore import Chunk, FeatureDatabase, build_feature_database, store_chunks
from qwen_scope.explore.database import HIST_EDGES

N_DOCS, DOC_LEN, D_SAE, K = 24, 20, 48, 5
N = N_DOCS * DOC_LEN


def synthetic(seed: int = 0):
    """Codes of N tokens in documents of DOC_LEN: distinct continuous values, unique indices per row, some padding."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.arange(N) // DOC_LEN
    positions = torch.arange(N) % DOC_LEN
    tokens = torch.randint(0, 256, (N,), generator=g)
    values = torch.rand(N, K, generator=g) * 4 + 0.01
    values[:, -1] = 0.0  # a padding slot: not an active feature
    indices = torch.stack([torch.randperm(D_SAE - 1, generator=g)[:K] for _ in range(N)])
    # Feature D_SAE - 1 is rare (5 firings), so its random sample holds all of its firings.
    for t in (33, 90, 150, 151, 401):
        indices[t, 0], values[t, 0] = D_SAE - 1, 1.0 + t / 100
    # A huge value at position 0 must never show up in statistics when position 0 is excluded.
    values[0, 0] = 100.0
    return tokens, docs, positions, values, indices


def chunks(data, size):
    tokens, docs, positions, values, indices = data
    for s in range(0, tokens.numel(), size):
        yield Chunk(tokens[s:s + size], docs[s:s + size], positions[s:s + size],
                    (values[s:s + size], indices[s:s + size]), s)


@pytest.fixture(scope="module")
def data():
    return synthetic()


@pytest.fixture(scope="module")
def db(data):
    return build_feature_database(chunks(data, 64), D_SAE, context=(4, 3), n_top=6, n_bins=4, per_bin=3)


def dense(data, exclude_position_0=True):
    _, _, positions, values, indices = data
    acts = torch.zeros(N, D_SAE).scatter_(1, indices, values)
    if exclude_position_0:
        acts[positions == 0] = 0
    return acts


def test_statistics_equal_a_brute_force_scan(db, data):
    acts = dense(data)
    fires = acts > 0
    assert db.n_tokens == N - N_DOCS and db.n_tokens_seen == N
    assert torch.equal(db.count, fires.sum(0))
    torch.testing.assert_close(db.density, fires.sum(0).double() / (N - N_DOCS))
    torch.testing.assert_close(db.act_max, acts.max(0).values)
    torch.testing.assert_close(db.mean_activation, acts.double().sum(0) / fires.sum(0).clamp(min=1))
    assert float(db.act_max.max()) < 100.0  # the position-0 outlier is excluded
    assert torch.equal(db.hist.sum(1), db.count)


def test_top_examples_equal_a_brute_force_scan_with_context(db, data):
    tokens, docs, _, _, _ = data
    acts = dense(data)
    full = dense(data, exclude_position_0=False)
    for f in range(D_SAE):
        col = acts[:, f]
        n = min(6, int((col > 0).sum()))
        expected = col.topk(n).indices.tolist()
        examples = db.top_examples(f)
        assert [e.token_index for e in examples] == expected
        for e in examples:
            t = e.token_index
            window = [u for u in range(t - 4, t + 4) if 0 <= u < N and docs[u] == docs[t]]
            assert e.tokens == tuple(tokens[window].tolist())
            assert e.tokens[e.mark] == int(tokens[t]) and e.value == pytest.approx(float(col[t]))
            torch.testing.assert_close(torch.tensor(e.values), full[window, f])


@pytest.mark.parametrize("size", [1, 3, 7, N])
def test_result_does_not_depend_on_chunk_size(db, data, size):
    if size == 1:
        data = tuple(x[:120] for x in data)
        ref = build_feature_database(chunks(data, 64), D_SAE, context=(4, 3), n_top=6, n_bins=4, per_bin=3)
        other = build_feature_database(chunks(data, 1), D_SAE, context=(4, 3), n_top=6, n_bins=4, per_bin=3)
    else:
        ref = db
        other = build_feature_database(chunks(data, size), D_SAE, context=(4, 3), n_top=6, n_bins=4, per_bin=3)
    for name in ("count", "act_sum", "act_max", "hist", "cooc"):
        assert torch.equal(getattr(ref, name), getattr(other, name)), name
    for buf in ("top", "samples"):
        for name in ("key", "value", "token_index", "ctx_tokens", "ctx_values"):
            assert torch.equal(getattr(getattr(ref, buf), name), getattr(getattr(other, buf), name)), (buf, name)


def test_quantile_bins_partition_the_sample(db, data):
    acts = dense(data)
    for f in range(D_SAE):
        bins = db.quantile_bins(f)
        sample = db.samples.value[f][db.samples.token_index[f] >= 0]
        assert len(bins) == min(4, sample.numel())
        assert sum(len(b.examples) for b in bins) == sample.numel()
        assert sum(b.contains for b in bins) == pytest.approx(1.0)
        for lower, upper in zip(bins, bins[1:]):
            assert lower.hi == upper.lo
        assert bins[0].lo == pytest.approx(float(sample.min())) and bins[-1].hi == pytest.approx(float(sample.max()))
        for i, b in enumerate(bins):
            for e in b.examples:
                assert b.lo <= e.value and (e.value < b.hi or (i == len(bins) - 1 and e.value <= b.hi))
                assert e.value == pytest.approx(float(acts[e.token_index, f]))
    # A feature with fewer firings than the sample size keeps every firing, in quantile order.
    rare = D_SAE - 1
    got = sorted(e.token_index for b in db.quantile_bins(rare) for e in b.examples)
    assert got == [33, 90, 150, 151, 401]


def test_samples_are_distinct_firings(db, data):
    acts = dense(data)
    for f in range(D_SAE):
        idx = db.samples.token_index[f][db.samples.token_index[f] >= 0]
        assert idx.unique().numel() == idx.numel() == min(12, int((acts[:, f] > 0).sum()))
        assert bool((acts[idx, f] > 0).all())


def test_position_0_can_be_included(data):
    db0 = build_feature_database(chunks(data, 50), D_SAE, exclude_position_0=False)
    assert db0.n_tokens == N
    assert float(db0.act_max.max()) == 100.0
    assert db0.top_examples(int(data[4][0, 0]))[0].token_index == 0


def test_cooccurrence_equals_brute_force(db, data):
    fires = (dense(data) > 0).long()
    expected = fires.T @ fires
    assert torch.equal(db.cooc, expected)
    co = db.cooccurring(3, n=5)
    union = fires[:, 3].sum() + fires.sum(0) - expected[3]
    jaccard = expected[3].double() / union
    jaccard[3] = -1
    assert [c.other for c in co] == jaccard.topk(5).indices.tolist()
    assert co[0].fraction == pytest.approx(float(expected[3, co[0].other] / expected[3, 3]))


def test_untracked_cooccurrence_is_a_clear_error(data):
    small = build_feature_database(chunks(data, 100), D_SAE, cooccurrence=[1, 2])
    assert small.cooc.shape == (2, D_SAE)
    with pytest.raises(ValueError, match="not tracked"):
        small.cooccurring(5)


def test_histogram_uses_the_log_grid(db, data):
    acts = dense(data)
    edges, counts = db.histogram(7)
    assert int(counts.sum()) == int((acts[:, 7] > 0).sum())
    values = acts[:, 7][acts[:, 7] > 0].double()
    assert float(edges[0]) <= float(values.min()) and float(values.max()) < float(edges[-1])
    assert set(edges.tolist()) <= set(HIST_EDGES.tolist())


def test_save_load_round_trip_with_labels(db, tmp_path):
    db.save(tmp_path / "db")
    db.annotate(5, label="numbers", notes="fires on digits")
    loaded = FeatureDatabase.load(tmp_path / "db")
    assert loaded.label(5) == "numbers" and loaded.notes(5) == "fires on digits"
    assert json.loads((tmp_path / "db" / "labels.json").read_text())["5"]["label"] == "numbers"
    assert loaded.config == db.config and loaded.n_tokens == db.n_tokens
    assert loaded.top_examples(9) == db.top_examples(9)
    assert loaded.quantile_bins(9) == db.quantile_bins(9)
    loaded.annotate(6, label="later")
    assert FeatureDatabase.load(tmp_path / "db").label(6) == "later"
    assert loaded.search("NUMB") == [5] and loaded.search("7")[0] == 7
    db.labels.clear()
    db.path = None


def test_save_is_atomic_and_describes_itself_in_the_tensor_file(db, tmp_path, monkeypatch):
    import qwen_scope.explore.database as database

    target = tmp_path / "db"
    db.save(target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    (target / "database.json").unlink()  # the tensor file alone is enough
    assert FeatureDatabase.load(target).n_tokens == db.n_tokens

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")  # the kill lands mid-write
        raise KeyboardInterrupt("killed mid-save")

    db.save(target)
    monkeypatch.setattr(database, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        db.save(target)
    after = {p.name: p.read_bytes() for p in target.iterdir() if not p.name.startswith(".")}
    assert after == before  # the interrupted save left the previous database whole
    assert FeatureDatabase.load(target).top_examples(9) == db.top_examples(9)
    db.path = None


def test_errors_name_the_problem(data, tmp_path):
    tokens, docs, positions, values, indices = data
    with pytest.raises(ValueError, match="d_sae=8"):
        build_feature_database(chunks(data, 100), 8)
    with pytest.raises(ValueError, match="consecutive"):
        build_feature_database([Chunk(tokens[:5], docs[:5], positions[:5], (values[:5], indices[:5]), 3)], D_SAE)
    with pytest.raises(ValueError, match="shapes disagree"):
        build_feature_database([Chunk(tokens[:5], docs[:4], positions[:5], (values[:5], indices[:5]))], D_SAE)
    with pytest.raises(FileNotFoundError, match="database.safetensors not found"):
        FeatureDatabase.load(tmp_path)


class FakeStore:
    """The ActivationStore reading contract, over in-memory tensors."""

    def __init__(self, data):
        self.data = data

    def token_ids(self):
        return self.data[0]

    def doc_index(self):
        return self.data[1]

    def positions(self):
        return self.data[2]

    def iter_chunks(self, point, kind="sae", chunk_tokens=1024):
        assert point == "resid_post.2" and kind == "sae"
        for s in range(0, N, chunk_tokens):
            yield s, (self.data[3][s:s + chunk_tokens], self.data[4][s:s + chunk_tokens])


def test_store_adapter_feeds_the_builder(db, data):
    other = build_feature_database(store_chunks(FakeStore(data), "resid_post.2", chunk_tokens=37), D_SAE,
                                   context=(4, 3), n_top=6, n_bins=4, per_bin=3)
    assert torch.equal(other.top.token_index, db.top.token_index)
    assert torch.equal(other.count, db.count)


@pytest.mark.gpu
def test_cuda_build_equals_cpu_build(db, data):
    gpu = build_feature_database(chunks(data, 64), D_SAE, context=(4, 3), n_top=6, n_bins=4, per_bin=3,
                                 device="cuda")
    for name in ("count", "act_max", "hist", "cooc"):
        assert torch.equal(getattr(db, name), getattr(gpu, name)), name
    torch.testing.assert_close(db.act_sum, gpu.act_sum)
    for name in ("value", "token_index", "ctx_tokens", "ctx_values"):
        assert torch.equal(getattr(db.top, name), getattr(gpu.top, name)), name
    assert gpu.samples.token_index.device.type == "cpu"
