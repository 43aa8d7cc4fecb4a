"""The spliced SAE evaluation on the nano model: faithful splice, ablations cost more, numbers equal a brute-force
computation, resumable, and bad input refused before anything is written."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from qwen_scope.evals import EvalConfig, SAEEvaluation, corpus_rows, evaluate_saes, token_batches
from qwen_scope.evals import spliced
from qwen_scope.nano import nano_corpus, nano_scope

CONFIG = EvalConfig(context_len=64, batch_size=2, max_tokens=256)
LAYERS = (3, 5)


@pytest.fixture(scope="module")
def scope():
    torch.set_num_threads(1)
    return nano_scope(LAYERS)


@pytest.fixture(scope="module")
def corpus():
    return nano_corpus(3)


@pytest.fixture(scope="module")
def result(scope, corpus):
    return evaluate_saes(scope, corpus, config=CONFIG, progress=False)


def test_reconstruction_plus_error_gives_the_clean_loss(result):
    for e in result.layers.values():
        assert abs(e.loss["sae+error"] - e.loss_clean) < 1e-5 * e.loss_clean
        assert abs(e.kl["sae+error"]) < 1e-6 and e.kl_max["sae+error"] < 1e-5


def test_ablations_cost_more_than_the_sae(result):
    for e in result.layers.values():
        assert e.loss_clean < e.loss["sae"] < e.loss["mean"] and e.loss["sae"] < e.loss["zero"]
        assert 0.9 < e.ce_recovered <= 1.0 and e.kl["zero"] > e.kl["sae"] > 0
        assert e.fve > 0.85 and e.l0 == pytest.approx(16.0) and e.n_tokens == 4 * 63


def _brute_force(scope, corpus, layer: int) -> dict:
    """Everything recomputed with a plain forward hook on the decoder block, one row at a time."""
    model, sae = scope.model, scope.sae(layer)
    rows = list(corpus_rows(scope.tokenizer, corpus, context_len=64, max_tokens=256))
    xs, nll, kl, clean_nll = [], [], [], []
    block = model.model.layers[layer]
    for row in rows:
        ids = torch.tensor([row])
        with torch.no_grad():
            seen = []
            handle = block.register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple)
                                                                               else out))
            clean = model(input_ids=ids).logits[0, 1:-1]
            handle.remove()

            def splice(m, a, out):
                h = out[0] if isinstance(out, tuple) else out
                h = torch.cat([h[:, :1], sae(h[:, 1:])], 1)
                return (h, *out[1:]) if isinstance(out, tuple) else h
            handle = block.register_forward_hook(splice)
            spliced_logits = model(input_ids=ids).logits[0, 1:-1]
            handle.remove()
        xs.append(seen[0][0, 1:])
        clean_nll.append(F.cross_entropy(clean, ids[0, 2:], reduction="none"))
        nll.append(F.cross_entropy(spliced_logits, ids[0, 2:], reduction="none"))
        kl.append(F.kl_div(spliced_logits.log_softmax(-1), clean.log_softmax(-1), log_target=True,
                           reduction="none").sum(-1))
    x = torch.cat(xs).double()
    recon = sae(x.float()).double()
    codes = sae.encode(x.float())
    return {"fve": float(1 - (recon - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()),
            "l0": float((codes > 0).sum(-1).double().mean()),
            "dead": float(((codes > 0).sum(0) == 0).double().mean()),
            "clean": float(torch.cat(clean_nll).mean()), "sae": float(torch.cat(nll).mean()),
            "kl": float(torch.cat(kl).mean()), "n": x.shape[0]}


def test_metrics_equal_a_brute_force_computation(scope, corpus, result):
    want = _brute_force(scope, corpus, 5)
    got = result.layers[5]
    assert got.n_tokens == want["n"]
    assert got.fve == pytest.approx(want["fve"], rel=1e-5)
    assert got.l0 == pytest.approx(want["l0"]) and got.dead_fraction == pytest.approx(want["dead"])
    assert got.loss_clean == pytest.approx(want["clean"], rel=1e-5)
    assert got.loss["sae"] == pytest.approx(want["sae"], rel=1e-5)
    assert got.kl["sae"] == pytest.approx(want["kl"], rel=1e-4, abs=1e-7)


def test_rows_batch_without_padding(scope, corpus):
    rows = list(corpus_rows(scope.tokenizer, corpus, context_len=64, max_tokens=150))
    assert [len(r) for r in rows] == [64, 64, 22]
    assert [tuple(b.shape) for b in token_batches(rows, 2)] == [(2, 64), (1, 22)]


def test_an_interrupted_run_resumes_to_the_same_result(scope, corpus, result, tmp_path, monkeypatch):
    real, calls = spliced._batch, []

    def crash_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(spliced, "_batch", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        evaluate_saes(scope, corpus, [5], config=CONFIG, out=tmp_path, progress=False)
    assert (tmp_path / spliced.STATE_FILE).is_file() and not (tmp_path / spliced.RESULT_FILE).exists()
    calls.clear()
    monkeypatch.setattr(spliced, "_batch", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = evaluate_saes(scope, corpus, [5], config=CONFIG, out=tmp_path, progress=False)
    assert len(calls) == 1  # only the batch that had not finished
    assert resumed.layers[5] == result.layers[5]
    saved = SAEEvaluation.load(tmp_path)
    assert saved.layers[5] == resumed.layers[5] and (tmp_path / spliced.FIGURE_FILE).is_file()
    assert json.loads((tmp_path / spliced.RESULT_FILE).read_text())["meta"]["layers"] == [5]
    with pytest.raises(ValueError, match="other settings.*overwrite"):
        evaluate_saes(scope, corpus, [5], config=EvalConfig(context_len=32, max_tokens=64), out=tmp_path,
                      progress=False)


def test_bad_input_is_one_clear_error_and_writes_nothing(scope, corpus, tmp_path):
    from tests.qwen_scope.scope_helpers import tiny_sae

    out = tmp_path / "never"
    with pytest.raises(ValueError, match="d_model 64.*hidden size 128"):
        evaluate_saes(scope, corpus, saes={5: tiny_sae()}, out=out, progress=False)
    with pytest.raises(ValueError, match="trained on layer 5"):
        evaluate_saes(scope, corpus, saes={4: scope.sae(5)}, out=out, progress=False)
    with pytest.raises(ValueError, match="outside .* decoder blocks 0..5"):
        evaluate_saes(scope, corpus, [7], out=out, progress=False)
    with pytest.raises(ValueError, match="corpus yielded no row"):
        evaluate_saes(scope, [], config=CONFIG, out=out, progress=False)
    with pytest.raises(ValueError, match="modes must be"):
        evaluate_saes(scope, corpus, modes=["recon"], out=out, progress=False)
    assert not out.exists()


def test_table_and_figure(result):
    table = result.table().splitlines()
    assert len(table) == 2 + len(LAYERS) and table[2].startswith("| 3 | 0.9")
    fig = result.figure()
    assert {t.name for t in fig.data} >= {"FVE", "CE recovered", "L0", "KL", "sae spliced", "zero spliced"}
