"""The corpus side of ``qwen_scope.collect``: loading a corpus, this rank's documents, packing them into rows.

Documents are tokenized in batches, document ``i`` going to rank ``i % world_size``, and packed into rows of
``context_len`` tokens (the packing policies are described in ``qwen_scope.collect``). The row stream is a pure
function of (corpus, rank, world size, packing), and each row carries the cursor after it, which is what makes a
resumed or repaired store equal an uninterrupted one.
"""
from __future__ import annotations

import glob
import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text",
                   ".csv": "csv"}


def load_corpus(source: str | os.PathLike, *, split: str = "train", name: str | None = None,
                streaming: bool = False, **kwargs):
    """A ``datasets`` corpus from a hub id or local json/jsonl/parquet/csv/text files (a file, a directory or a glob).

    Args:
        source: e.g. ``"HuggingFaceFW/fineweb-edu"`` or ``"data/*.jsonl"``. name: hub config. split: split to read.
        streaming: return an ``IterableDataset`` (no full download). kwargs: passed to ``datasets.load_dataset``.
    Returns:
        ``datasets.Dataset`` or ``datasets.IterableDataset``.
    """
    import datasets

    path = Path(source)
    # glob.glob, not Path().glob: the latter refuses absolute patterns ("/data/*.jsonl").
    files = sorted(path.iterdir()) if path.is_dir() else sorted(map(Path, glob.glob(str(source)))) \
        if "*" in str(source) else [path] if path.exists() else []
    if not files and "*" in str(source):
        raise FileNotFoundError(f"{source}: the pattern matches no file; check the path (relative to "
                                f"{Path.cwd()}) or pass a hub dataset id")
    if files:
        exts = {f.suffix for f in files if f.suffix in _LOCAL_BUILDERS}
        if len(exts) != 1:
            raise ValueError(f"{source}: expected files of one kind among {sorted(_LOCAL_BUILDERS)}, found "
                             f"suffixes {sorted({f.suffix for f in files})}")
        builder = _LOCAL_BUILDERS[exts.pop()]
        data = [str(f) for f in files if f.suffix in _LOCAL_BUILDERS]
        return datasets.load_dataset(builder, data_files=data, split=split, streaming=streaming, **kwargs)
    return datasets.load_dataset(str(source), name, split=split, streaming=streaming, **kwargs)


def _corpus_id(corpus) -> str:
    fingerprint = getattr(corpus, "_fingerprint", None)
    if fingerprint:
        return f"{type(corpus).__name__}:{fingerprint}"
    info = getattr(corpus, "info", None)
    if info is not None and (info.dataset_name or info.config_name):
        return f"{type(corpus).__name__}:{info.dataset_name}/{info.config_name}/{getattr(corpus, 'split', None)}"
    if isinstance(corpus, Sequence):
        return "list:" + hashlib.sha256(repr(list(corpus)).encode()).hexdigest()[:16]
    return type(corpus).__name__


def _rank_documents(corpus, rank: int, world: int, start: int, text_column: str, tokenizer,
                    read_batch: int = 256) -> Iterator[tuple[int, int, list[int]]]:
    """Yield ``(ordinal, doc_index, token_ids)`` for this rank's documents from ordinal ``start`` on."""
    if hasattr(corpus, "select") and hasattr(corpus, "__len__") and not isinstance(corpus, Sequence):
        records = iter(corpus.select(range(rank + start * world, len(corpus), world)))
    else:
        records = itertools.islice(iter(corpus), rank + start * world, None, world)
    for ordinal in itertools.count(start, read_batch):
        chunk = list(itertools.islice(records, read_batch))
        if not chunk:
            return
        for j, ids in enumerate(_tokenize(chunk, text_column, tokenizer)):
            yield ordinal + j, (ordinal + j) * world + rank, ids


def _tokenize(records: list, text_column: str, tokenizer) -> list[list[int]]:
    first = records[0]
    if isinstance(first, str):
        texts = records
    elif text_column in first:
        texts = [r[text_column] for r in records]
    elif "input_ids" in first:
        return [list(r["input_ids"]) for r in records]
    else:
        raise ValueError(f"corpus records have no {text_column!r} column (columns: {sorted(first)}); pass "
                         f"text_column=... (--text-column) or a pre-tokenized 'input_ids' column")
    if tokenizer is None:
        raise ValueError("the corpus holds text but no tokenizer was given; pass tokenizer=... (or a model id)")
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class Row:
    """One packed row: ``tokens``/``doc_index`` (real tokens only) and the cursor ``(ordinal, offset)`` after it."""

    tokens: list[int]
    doc_index: list[int]
    cursor: tuple[int, int]


def pack_rows(docs: Iterable[tuple[int, int, list[int]]], context_len: int, *, packing: str = "concat",
              separator_id: int | None = None, prepend_bos_id: int | None = None,
              start: tuple[int, int] = (0, 0)) -> Iterator[Row]:
    """Pack ``(ordinal, doc_index, tokens)`` documents into rows of at most ``context_len`` tokens.

    Args:
        docs: documents in order, starting at ordinal ``start[0]``.
        context_len: tokens per row (the BOS, when prepended, included).
        packing: ``"concat"`` or ``"document"`` (see the module doc). separator_id: appended to every document.
        prepend_bos_id: put at position 0 of every row. start: resume cursor ``(ordinal, offset)``.
    Returns:
        An iterator of ``Row``; a row's ``cursor`` is where the next row begins.
    """
    if packing not in ("concat", "document"):
        raise ValueError(f"packing must be 'concat' or 'document', got {packing!r}")
    prefix = [] if prepend_bos_id is None else [prepend_bos_id]
    room = context_len - len(prefix)
    if room < 1:
        raise ValueError(f"context_len={context_len} leaves no room for tokens after the BOS")
    buf: list[int] = []
    owner: list[int] = []
    for ordinal, doc, tokens in docs:
        tokens = list(tokens) + ([] if separator_id is None else [separator_id])
        offset = start[1] if ordinal == start[0] else 0
        if packing == "document":
            if tokens:
                yield Row(prefix + tokens[:room], [doc] * (len(prefix) + min(room, len(tokens))), (ordinal + 1, 0))
            continue
        while offset < len(tokens):
            take = min(room - len(buf), len(tokens) - offset)
            buf += tokens[offset:offset + take]
            owner += [doc] * take
            offset += take
            if len(buf) == room:
                cursor = (ordinal, offset) if offset < len(tokens) else (ordinal + 1, 0)
                yield Row(prefix + buf, owner[:1] * len(prefix) + owner, cursor)
                buf, owner = [], []
    if buf:
        yield Row(prefix + buf, owner[:1] * len(prefix) + owner, (-1, 0))


def check_yields_tokens(corpus, rank: int, world: int, text_column: str, tokenizer, name: str) -> None:
    """Raise ``ValueError`` when this rank's share of ``corpus`` holds no document with a token (read until the
    first one that has one: for a usable corpus, the first batch of documents)."""
    n_docs = 0
    for n_docs, (_, _, ids) in enumerate(_rank_documents(corpus, rank, world, 0, text_column, tokenizer), 1):
        if ids:
            return
    share = "" if world == 1 else f" for rank {rank} of {world} (document i goes to rank i % {world})"
    raise ValueError(f"the corpus {name} yields no tokens{share}: {n_docs} document(s), every one empty after "
                     f"tokenization; check the corpus path and --text-column ({text_column!r})")
