"""The bundled nano model: a tiny trained Qwen3.5 (hybrid Gated DeltaNet + attention, byte-level) with its own SAE set.

Everything is package data under ``qwen_scope/data/nano`` (made by ``scripts/nano/``; see ``RESULTS.md`` there), so
the toolkit can be tried offline in seconds on a CPU:

    >>> from qwen_scope.nano import nano_scope, nano_corpus
    >>> scope = nano_scope()                        # model + tokenizer + one SAE per layer (d_sae 1024, k 16)
    >>> scope.features("def read(path):\\n    return open(path).read()").top(3)
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["NANO_DIR", "NANO_RELEASE_DIR", "nano_corpus", "load_nano", "nano_scope"]

NANO_DIR = Path(__file__).resolve().parent / "data" / "nano"
NANO_RELEASE_DIR = NANO_DIR / "SAE-Res-Qwen3.5-Nano-Base-W1K-L0_16"


def _check_shipped(saes: bool = False) -> None:
    wanted = [NANO_DIR / "config.json", NANO_DIR / "model.safetensors"] + ([NANO_RELEASE_DIR] if saes else [])
    missing = [p.name for p in wanted if not p.exists()]
    if missing:
        raise FileNotFoundError(f"the nano model data is incomplete: {missing} missing under {NANO_DIR}; reinstall "
                                f"qwen-scope or rebuild it with scripts/nano/ (see scripts/nano/README.md)")


def load_nano(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The nano model (eval mode) and its byte-level tokenizer.

    Args:
        dtype: model dtype (weights ship in bf16 and load as fp32 by default).
        device: where the model goes.
    Returns:
        ``(model, tokenizer)``: a ``Qwen3_5ForCausalLM`` (d_model 128, 6 blocks) and a tokenizer whose ids are bytes.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_shipped()
    model = AutoModelForCausalLM.from_pretrained(str(NANO_DIR), dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(str(NANO_DIR))


def nano_scope(layers: int | Iterable[int] | None = None, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32):
    """A ``Scope`` over the nano model with its SAEs at ``layers`` (default: all six).

    Args:
        layers: SAE layers to attach (``None`` = all).
        device, dtype: for model and SAEs.
    Returns:
        ``qwen_scope.Scope``.
    """
    from qwen_scope.scope import Scope

    _check_shipped(saes=True)
    layers = range(6) if layers is None else layers
    return Scope.from_pretrained(NANO_DIR, NANO_RELEASE_DIR, layers=layers, device=device, dtype=dtype,
                                 sae_dtype=dtype)


def nano_corpus(max_docs: int | None = None, *, sources: Iterable[str] | None = None) -> list[str]:
    """The shipped corpus slice (held-out documents of the nano model's corpus: stdlib docs and code, PSF licence).

    Args:
        max_docs: keep the first ``max_docs`` documents.
        sources: keep only these kinds, from ``"pydoc_topic"``, ``"docstrings"``, ``"source"``.
    Returns:
        the documents' texts.
    """
    path = NANO_DIR / "corpus_sample.jsonl"
    docs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if sources is not None:
        keep = set(sources)
        docs = [d for d in docs if d["source"] in keep]
    return [d["text"] for d in docs[:max_docs]]
