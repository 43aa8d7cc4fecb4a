"""Batched document scores: equal to one forward per text, in the texts' order, streamed in batches, with a mean
form; from a collected store equal to the brute-force per-document maximum over its stored codes."""
from __future__ import annotations

import torch

from qwen_scope import nano_scope
from qwen_scope.applications import document_scores, iter_document_scores, store_document_scores
from tests.qwen_scope.scope_helpers import corpus_windows, doc_max_by_hand, tiny_sae_store


def test_batched_scores_equal_one_forward_per_text_in_order():
    scope = nano_scope([2])
    code, prose = corpus_windows(width=96)
    texts = [code[0], "x", prose[0][:40], code[1][:70], prose[1]]
    got = document_scores(scope, texts, [2], batch_size=2)[2]
    mean = document_scores(scope, texts, [2], batch_size=3, reduce="mean")[2]
    for i, t in enumerate(texts):
        dense = scope.features(t, [2])[2].dense()[1:]
        want = dense.clamp(min=0).amax(0) if dense.shape[0] else torch.zeros(1024)
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)
        if dense.shape[0]:
            torch.testing.assert_close(mean[i], dense.mean(0), atol=1e-4, rtol=1e-4)
    rows = [{"text": t} for t in texts]
    streamed = list(iter_document_scores(scope, iter(rows), [2], batch_size=2))
    assert [len(b) for b, _ in streamed] == [2, 2, 1] and streamed[0][0][0] is rows[0]
    torch.testing.assert_close(torch.cat([s[2] for _, s in streamed]), got)


def test_store_scores_equal_the_brute_force_maximum_per_document(tmp_path):
    store, _ = tiny_sae_store(tmp_path, token_budget=300)
    docs, want = doc_max_by_hand(store, "resid_post.1")
    ids, got = store_document_scores(store, "resid_post.1", chunk_tokens=50)
    assert ids.tolist() == docs.tolist()
    torch.testing.assert_close(got, want)
    ids, some = store_document_scores(store, "resid_post.1", features=[5, 2])
    torch.testing.assert_close(some, want[:, [5, 2]])
