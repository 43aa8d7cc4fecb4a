"""Benchmark redundancy on the nano model: a benchmark footprint from local files or lists, the overlap figure, a
coverage-preserving subsample that keeps the ranking of nano variants, Spearman by hand, a missing id offline."""
from __future__ import annotations

import json

import pytest
import torch

from qwen_scope import nano_scope
from qwen_scope.applications import (Benchmark, coverage_subsample, overlap_figure, ranking_check, redundancy_matrix,
                                     spearman)
from tests.qwen_scope.scope_helpers import corpus_windows

LAYER, WIDTH = 3, 64


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    scope = nano_scope([LAYER])
    code, prose = corpus_windows(width=WIDTH)
    path = tmp_path_factory.mktemp("bench") / "mixed.jsonl"
    path.write_text("".join(json.dumps({"question": t}) + "\n" for t in prose[:24] + code[:24]))
    mixed = Benchmark.load(scope, str(path), split="train", text_column="question", threshold=1.0, label="mixed")
    return scope, mixed, Benchmark.load(scope, prose[24:48], threshold=1.0, label="prose")


def test_footprints_from_a_local_file_and_a_list_and_their_overlap(bench):
    _, mixed, prose = bench
    assert len(mixed) == 48 and mixed.name == "mixed" and mixed.texts[0].startswith(mixed.texts[0][:5])
    names, R = redundancy_matrix({"mixed": mixed.footprint(), "prose": prose.footprint()})
    assert R[0, 1] == pytest.approx(mixed.footprint().coverage_of(prose.footprint()))
    print(f"mixed covers {R[0, 1]:.0%} of prose's features, prose covers {R[1, 0]:.0%} of mixed's")
    assert R[0, 1] > R[1, 0]  # the mixed benchmark holds prose's features and code's
    fig = overlap_figure(names, R)
    assert fig.data[0].z[0][1] == pytest.approx(float(R[0, 1]))


def _variants(scope):
    """The nano model with one block's MLP output zeroed (blocks 0..5) and intact: 7 models of different skill."""
    handles = []
    for n in [None, 0, 1, 2, 3, 4, 5]:
        if n is not None:
            handles.append(scope.adapter.mlp(n).register_forward_hook(lambda m, a, out: out * 0))
        yield n
        for h in handles:
            h.remove()
        handles.clear()


def test_coverage_subsample_keeps_the_footprint_and_the_ranking(bench):
    scope, mixed, _ = bench
    keep = coverage_subsample(mixed.scores, 12, threshold=1.0)
    assert len(set(keep.tolist())) == 12
    assert mixed.footprint(keep).coverage_of(mixed.footprint()) >= 0.9
    ids = [scope.tokenizer(t, add_special_tokens=False)["input_ids"][:WIDTH] for t in mixed.texts]
    batch = torch.tensor(ids)
    scores = []
    for _ in _variants(scope):
        with torch.no_grad():
            logits = scope.model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, batch[:, 1:, None])[..., 0]
        scores.append(logp.mean(1))  # per sample: mean log-likelihood per byte
    check = ranking_check(torch.stack(scores), keep, trials=20)
    print(check)
    assert check.rho >= 0.9 and check.rho >= check.random_rho, check


def test_spearman_by_hand_and_bad_input():
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([4.0, 3, 2, 1])) == pytest.approx(-1.0)
    # ties share their mean rank: ranks [1.5, 1.5, 3] vs [1, 2, 3]
    assert spearman(torch.tensor([1.0, 1, 2]), torch.tensor([1.0, 2, 3])) == pytest.approx(0.8660254)
    with pytest.raises(ValueError, match="M >= 3 models"):
        ranking_check(torch.zeros(2, 5), [0, 1])
    with pytest.raises(ValueError, match="n must be in 1..3"):
        coverage_subsample({0: torch.rand(3, 4)}, 4)


def test_a_benchmark_id_that_is_not_there_offline_says_so(bench, monkeypatch):
    scope = bench[0]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"benchmark 'no-such-org/no-such-bench' \(split 'test'\) could not be "
                                         r"loaded: it is not a local path and the hub did not provide it"):
        Benchmark.load(scope, "no-such-org/no-such-bench")
