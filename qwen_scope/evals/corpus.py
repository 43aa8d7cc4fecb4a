"""The token rows an evaluation reads: texts, a ``datasets`` corpus, pre-tokenized documents or an activation store,
cut into rows of at most ``context_len`` tokens and grouped into equal-length batches.

Texts and datasets are packed like ``collect`` packs them (``pack_rows``, documents joined by the EOS token), so an
evaluation sees the contexts a collection saw; a store gives back the very rows the model read when it was collected
(a row starts where ``positions`` is 0).

    for ids in token_batches(corpus_rows(scope.tokenizer, nano_corpus(8), context_len=256), batch_size=4):
        ...                                               # ids: LongTensor [B, T]
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from qwen_scope.collect import pack_rows
from qwen_scope.store import ActivationStore

__all__ = ["corpus_rows", "token_batches", "rows_fingerprint"]

_READ_BATCH = 64


def _documents(corpus, tokenizer, text_column: str) -> Iterator[list[int]]:
    """Token ids of each document of ``corpus`` (texts, records with ``text_column`` / ``input_ids``, id lists)."""
    if isinstance(corpus, str):
        corpus = [corpus]
    records = iter(corpus)
    while True:
        chunk = list(itertools.islice(records, _READ_BATCH))
        if not chunk:
            return
        first = chunk[0]
        if isinstance(first, str):
            yield from tokenizer(chunk, add_special_tokens=False)["input_ids"]
        elif isinstance(first, dict) and text_column in first:
            yield from tokenizer([r[text_column] for r in chunk], add_special_tokens=False)["input_ids"]
        elif isinstance(first, dict) and "input_ids" in first:
            yield from (list(r["input_ids"]) for r in chunk)
        elif isinstance(first, (list, tuple, torch.Tensor)):
            yield from (list(map(int, r)) for r in chunk)
        else:
            what = sorted(first) if isinstance(first, dict) else type(first).__name__
            raise ValueError(f"corpus records must be texts, token-id lists or records with a {text_column!r} or "
                             f"'input_ids' column; got {what}. Pass text_column=... (--text-column) to name it")


def _store_rows(store: ActivationStore, context_len: int) -> Iterator[list[int]]:
    ids, positions = store.token_ids(), store.positions()
    starts = torch.nonzero(positions == 0).flatten().tolist() + [ids.numel()]
    for a, b in zip(starts, starts[1:]):
        for s in range(a, b, context_len):
            yield ids[s:min(b, s + context_len)].tolist()


def corpus_rows(tokenizer, corpus, *, context_len: int, text_column: str = "text",
                max_tokens: int | None = None) -> Iterator[list[int]]:
    """Rows of token ids, at most ``context_len`` each, in corpus order, until ``max_tokens`` tokens are given.

    Args:
        tokenizer: the model's tokenizer (its EOS id separates packed documents).
        corpus: a text, texts, records (``datasets`` rows), token-id lists, an ``ActivationStore`` or its directory.
        context_len: tokens per row (T).
        text_column: the text field of records.
        max_tokens: stop after this many tokens (the last row is cut to fit); None = the whole corpus.
    Returns:
        an iterator of ``list[int]`` rows.
    """
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 2:
        raise ValueError(f"context_len must be an int >= 2 (a row needs a token and its successor), got "
                         f"{context_len!r}")
    if isinstance(corpus, (str, Path)) and Path(corpus).is_dir():
        corpus = ActivationStore(corpus)
    if isinstance(corpus, ActivationStore):
        rows = _store_rows(corpus, context_len)
    else:
        eos = getattr(tokenizer, "eos_token_id", None)
        docs = ((i, i, ids) for i, ids in enumerate(_documents(corpus, tokenizer, text_column)))
        rows = (r.tokens for r in pack_rows(docs, context_len, separator_id=eos))
    left = max_tokens
    for row in rows:
        if left is not None:
            row = row[:left]
            left -= len(row)
        if len(row) >= 2:
            yield row
        if left is not None and left <= 0:
            return


def token_batches(rows: Iterable[list[int]], batch_size: int) -> Iterator[torch.Tensor]:
    """Group consecutive rows of equal length into ``[B, T]`` LongTensors of at most ``batch_size`` rows (a row of
    another length, such as the packed corpus's last one, starts a new batch: no padding, no attention mask)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    group: list[list[int]] = []
    for row in rows:
        if group and (len(row) != len(group[0]) or len(group) == batch_size):
            yield torch.tensor(group, dtype=torch.long)
            group = []
        group.append(row)
    if group:
        yield torch.tensor(group, dtype=torch.long)


def rows_fingerprint(ids: torch.Tensor) -> str:
    """A short hash of a batch of token ids (the first batch identifies a corpus when a run resumes)."""
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
