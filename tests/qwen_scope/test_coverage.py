"""Feature footprints: set arithmetic against hand-made sets, greedy cover against a brute-force step, and on the
nano model, code activates features prose lacks and the greedy cover of that gap picks code."""
from __future__ import annotations

import random

import pytest
import torch

from qwen_scope import nano_corpus, nano_scope
from qwen_scope.applications import FeatureFootprint, document_scores, greedy_cover, redundancy_matrix
from tests.qwen_scope.scope_helpers import doc_max_by_hand, tiny_sae_store
from tests.qwen_scope.test_classify import _chunks, _is_code, _is_prose


def _scores(rows: list[list[float]], layer: int = 3) -> dict[int, torch.Tensor]:
    return {layer: torch.tensor(rows, dtype=torch.float32)}


def test_footprint_counts_documents_per_feature_and_compares_as_sets():
    a = FeatureFootprint.from_scores(_scores([[0.5, 0, 0, 2.0, 0], [0.1, 0, 0.3, 0, 0], [0, 0, 0.2, 0, 0]]))
    b = FeatureFootprint.from_scores(_scores([[1.0, 1.0, 0, 0, 0], [0, 0, 0, 3.0, 0]]))
    assert a.counts[3].tolist() == [2, 0, 2, 1, 0] and a.n_docs == 3
    assert a.features(3).tolist() == [0, 2, 3] and b.features(3).tolist() == [0, 1, 3]
    assert a.coverage_of(b) == pytest.approx(2 / 3) and b.coverage_of(a) == pytest.approx(2 / 3)
    assert a.jaccard(b) == pytest.approx(2 / 4)
    assert a.missing(b)[3].tolist() == [1] and b.missing(a)[3].tolist() == [2]
    strict = FeatureFootprint.from_scores(_scores([[0.5, 0, 0, 2.0, 0], [0.1, 0, 0.3, 0, 0]]), threshold=0.2,
                                          min_docs=1)
    assert strict.features(3).tolist() == [0, 2, 3]
    rows = _scores([[0.5, 0, 0, 2.0, 0], [0.1, 0, 0.3, 0, 0], [0, 0, 0.2, 0, 0]])
    twice = FeatureFootprint.from_scores(rows, min_docs=2)
    assert twice.features(3).tolist() == [0, 2] and twice.size() == 2
    names, R = redundancy_matrix({"a": a, "b": b, "twice": twice})
    assert names == ["a", "b", "twice"] and R[0, 2] == 1.0 and R[2, 0] == pytest.approx(2 / 3) and R[1, 1] == 1.0
    empty = FeatureFootprint.from_scores(_scores([[0, 0, 0, 0, 0]]))
    assert a.coverage_of(empty) == 1.0 and empty.coverage_of(a) == 0.0 and empty.jaccard(empty) == 1.0


def test_footprint_errors_name_the_problem():
    with pytest.raises(ValueError, match="same documents"):
        FeatureFootprint.from_scores({1: torch.zeros(2, 4), 2: torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="min_docs >= 1"):
        FeatureFootprint.from_scores(_scores([[0.0]]), min_docs=0)
    a = FeatureFootprint.from_scores(_scores([[1.0, 0]], layer=1))
    with pytest.raises(ValueError, match="share no layer"):
        a.coverage_of(FeatureFootprint.from_scores(_scores([[1.0, 0]], layer=2)))
    with pytest.raises(ValueError, match="same SAEs"):
        a.coverage_of(FeatureFootprint.from_scores(_scores([[1.0, 0, 0]], layer=1)))
    with pytest.raises(KeyError, match="no layer 5"):
        a.mask(5)
    with pytest.raises(ValueError, match="no candidate scores"):
        greedy_cover(_scores([[1.0]], layer=1), target_features={2: [0]}, budget=1)


def test_greedy_cover_takes_the_largest_gain_each_step_and_stops_when_nothing_is_left():
    gen = torch.Generator().manual_seed(0)
    scores = {0: (torch.rand(30, 40, generator=gen) > 0.85).float(),
              1: (torch.rand(30, 20, generator=gen) > 0.9).float()}
    targets = {0: list(range(0, 40, 2)), 1: list(range(20))}
    picks = greedy_cover(scores, target_features=targets, budget=10)
    open_ = {n: set(t) for n, t in targets.items()}
    chosen = set()
    for pick in picks:
        gains = [-1 if i in chosen else sum(int(scores[n][i, f] > 0) for n in open_ for f in open_[n])
                 for i in range(30)]
        assert pick.index == gains.index(max(gains))  # the largest gain, lowest index on ties
        assert {n: set(v) for n, v in pick.new.items()} == {
            n: {f for f in open_[n] if scores[n][pick.index, f] > 0} for n in open_
            if any(scores[n][pick.index, f] > 0 for f in open_[n])}
        for n, v in pick.new.items():
            open_[n] -= set(v)
        chosen.add(pick.index)
    assert picks[-1].covered == sum(len(targets[n]) - len(open_[n]) for n in targets)
    everything = greedy_cover(scores, target_features=targets, budget=30)
    reachable = sum(int((scores[n][:, t] > 0).any(0).sum()) for n, t in targets.items())
    assert everything[-1].covered == reachable and len(everything) < 30  # stopped once nothing was left
    assert greedy_cover(scores, target_features=targets, budget=0) == []


@pytest.fixture(scope="module")
def nano():
    code = [c for t in nano_corpus(sources=["source"]) for c in _chunks(t) if _is_code(c)]
    prose = [c for t in nano_corpus(sources=["docstrings", "pydoc_topic"]) for c in _chunks(t) if _is_prose(c)]
    rng = random.Random(1)
    return nano_scope(), rng.sample(prose, 24), rng.sample(code, 24)


def test_on_nano_code_covers_what_prose_misses_and_the_cover_picks_code(nano):
    scope, prose, code = nano
    fp_prose = FeatureFootprint.from_texts(scope, prose[:16], layers=[3, 4], min_docs=2)
    fp_code = FeatureFootprint.from_texts(scope, code[:16], layers=[3, 4], min_docs=2)
    gap = fp_prose.missing(fp_code)
    assert sum(len(v) for v in gap.values()) >= 5, "code should activate features prose does not"
    assert fp_code.coverage_of(fp_prose) < 1.0 and fp_prose.coverage_of(fp_code) < 1.0
    both = FeatureFootprint.from_texts(scope, prose[:16] + code[:16], layers=[3, 4], min_docs=2)
    assert both.coverage_of(fp_prose) == 1.0 and both.coverage_of(fp_code) == 1.0
    candidates = prose[16:] + code[16:]  # 8 unseen prose chunks, then 8 unseen code chunks
    picks = greedy_cover(document_scores(scope, candidates, [3, 4]), target_features=gap, budget=4)
    assert picks and picks[0].covered >= 3 and all(p.index >= 8 for p in picks), [p.index for p in picks]


def test_from_store_counts_each_document_once_across_chunks_and_skips_row_starts(tmp_path):
    from qwen_scope.collect import collect
    from qwen_scope.store import ActivationStore
    from tests.factories import tiny_model, tiny_tokenizer

    store, corpus = tiny_sae_store(tmp_path, token_budget=400)
    _, scores = doc_max_by_hand(store, "resid_post.1")
    for threshold, min_docs in ((0.0, 1), (0.5, 2)):
        want = FeatureFootprint.from_scores({1: scores}, threshold=threshold, min_docs=min_docs)
        for chunk in (7, 50, 1 << 16):  # documents cut by chunks and by shards
            got = FeatureFootprint.from_store(store, "resid_post.1", threshold=threshold, min_docs=min_docs,
                                              chunk_tokens=chunk)
            assert torch.equal(got.counts[1], want.counts[1]) and got.n_docs == want.n_docs == 8
        assert want.size() > 0 or min_docs > 1
    collect(tiny_model("qwen3_5"), corpus, points=["resid_post.0"], token_budget=64, context_len=32,
            out_dir=tmp_path / "dense", tokenizer=tiny_tokenizer(), progress=False)
    with pytest.raises(ValueError, match="holds no SAE codes"):
        FeatureFootprint.from_store(ActivationStore(tmp_path / "dense"), "resid_post.0")


def test_footprint_save_and_load_round_trip(tmp_path):
    fp = FeatureFootprint.from_scores({1: torch.rand(5, 16), 4: torch.rand(5, 16)}, threshold=0.3, min_docs=2)
    back = FeatureFootprint.load(fp.save(tmp_path / "fp" / "train.safetensors"))
    assert back.layers == [1, 4] and (back.n_docs, back.threshold, back.min_docs) == (5, 0.3, 2)
    assert all(torch.equal(back.counts[n], fp.counts[n]) for n in fp.layers) and back.coverage_of(fp) == 1.0
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="is not a feature footprint"):
        FeatureFootprint.load(tmp_path / "other.safetensors")
