"""Tiny ``Scope`` objects for the qwen_scope tests: a tiny random Qwen model, the byte tokenizer, random SAEs."""
from __future__ import annotations

import functools

import torch

from qwen_scope.scope import Scope
from saes import TopKSAE
from tests.factories import D_MODEL, random_sae_state, tiny_model, tiny_tokenizer


def tiny_sae(d_sae: int = 256, k: int = 8, seed: int = 0) -> TopKSAE:
    return TopKSAE.from_release_state(random_sae_state(D_MODEL, d_sae, seed), k=k).requires_grad_(False)


def orthonormal_sae(d_sae: int = 32, seed: int = 0) -> TopKSAE:
    """An SAE that encodes exactly: orthonormal decoder columns, W_enc = W_dec^T, no biases, k = d_sae.

    Its pre-activation of feature i on ``h`` is ``<W_dec[:, i], h>``, so a clamp is read back exactly.
    """
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(D_MODEL, d_sae, generator=g))
    return TopKSAE(q.T.contiguous(), q.contiguous(), torch.zeros(d_sae), torch.zeros(D_MODEL), k=d_sae).requires_grad_(False)


def tiny_scope(family: str = "qwen3_5", layers=(1, 2), k: int = 8, model_name: str | None = None) -> Scope:
    saes = {n: tiny_sae(k=k, seed=n) for n in layers}
    return Scope(tiny_model(family), tiny_tokenizer(), saes, model_name=model_name)


def write_tiny_checkpoint(root, family: str = "qwen3_5"):
    """Save a tiny model + byte tokenizer (a local "checkpoint" directory) and an SAE release; return both paths."""
    from tests.factories import write_sae_release

    model_dir = root / "tiny-qwen"
    tiny_model(family).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    return model_dir, write_sae_release(root)


def corpus_windows(width: int = 200, seed: int = 0) -> tuple[list[str], list[str]]:
    """Non-overlapping raw ``width``-character windows of the nano corpus slice: (source code, docs), shuffled.
    Source files carry docstrings and comments, docs carry code examples: the classes mix."""
    import json
    import random

    from qwen_scope.nano import NANO_DIR

    docs = [json.loads(line) for line in (NANO_DIR / "corpus_sample.jsonl").read_text().splitlines() if line]
    cut = [(d["source"], d["text"][i:i + width]) for d in docs for i in range(0, len(d["text"]) - width + 1, width)]
    rng = random.Random(seed)
    code, prose = [t for s, t in cut if s == "source"], [t for s, t in cut if s != "source"]
    rng.shuffle(code)
    rng.shuffle(prose)
    return code, prose


@functools.lru_cache(maxsize=None)
def window_scores(n_code: int = 62, n_prose: int = 64) -> tuple[dict, dict]:
    """Document scores at layers 2 and 3 of the nano model of the first ``n_code`` source and ``n_prose``
    documentation windows of ``corpus_windows()``: ``({layer: [n_code, d_sae]}, {layer: [n_prose, d_sae]})``,
    computed once for every test module that slices them (nothing may write to them)."""
    from qwen_scope import nano_scope
    from qwen_scope.applications import document_scores

    code, prose = corpus_windows()
    scores = document_scores(nano_scope([2, 3]), code[:n_code] + prose[:n_prose], [2, 3], batch_size=32)
    return ({n: s[:n_code] for n, s in scores.items()}, {n: s[n_code:] for n, s in scores.items()})


def tiny_sae_store(root, *, token_budget: int):
    """A store collected from the tiny model's layer-1 SAE codes over the test corpus (rows of 32 tokens, shards of
    128): ``(store, corpus)``."""
    from qwen_scope.collect import collect, load_corpus
    from qwen_scope.store import ActivationStore
    from tests.factories import write_sae_release
    from tests.qwen_scope.test_collect import write_corpus

    corpus = load_corpus(write_corpus(root / "corpus.jsonl"))
    collect(tiny_model("qwen3_5"), corpus, sae_layers=[1], release=str(write_sae_release(root / "rel")),
            token_budget=token_budget, context_len=32, out_dir=root / "store", tokenizer=tiny_tokenizer(),
            shard_tokens=128, progress=False)
    return ActivationStore(root / "store"), corpus


def doc_max_by_hand(store, point: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force over a store's codes: ``(document ids [D], [D, d_sae])``, each document's largest activation per
    feature over its tokens at positions > 0 (zeros for a document with none)."""
    acts = store.feature_acts(point).float()
    docs, pos = store.doc_index(), store.positions()
    ids = docs.unique()
    rows = [acts[(docs == d) & (pos > 0)].clamp(min=0).amax(0) if ((docs == d) & (pos > 0)).any()
            else torch.zeros(acts.shape[1]) for d in ids]
    return ids, torch.stack(rows)
