"""Tiny ``Scope`` objects for the qwen_scope tests: a tiny random Qwen model, the byte tokenizer, random SAEs."""
from __future__ import annotations

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
