"""Document scores at corpus scale: each text's largest activation of every SAE feature, batched.

A text's *document score* for a feature is its largest activation anywhere in the text, position 0 (the attention
sink, whose residual is an outlier) left out; 0 where the feature never fires. Every application here (the
few-seed classifier, footprints, synthesis verification, benchmark subsampling) reads texts through these scores.

Texts are scored a batch at a time: tokenised, sorted by length (little padding), right-padded and run through one
forward that stops after the deepest SAE layer. Causal attention and the Gated DeltaNet recurrence never look at
later tokens, so right padding needs no mask and leaves every real token's residual as in a forward of its own;
the pad positions are dropped before the maximum. A corpus already collected into an ``ActivationStore`` is scored
from its stored codes without running the model at all (``store_document_scores``).

    scores = document_scores(scope, texts, [3, 4], batch_size=32)      # {3: [N, d_sae], 4: [N, d_sae]}
    for texts, scores in iter_document_scores(scope, load_corpus("data.jsonl", streaming=True), [4]): ...
    docs, scores = store_document_scores(ActivationStore("acts/"), "resid_post.12", features=[17, 812])
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from hooks import capture_forward

__all__ = ["document_scores", "iter_document_scores", "store_document_scores", "layer_list", "row_text"]


def layer_list(scope, layers: int | Iterable[int] | None) -> list[int]:
    """The SAE layers to read: ``layers`` (an int, several, or None for every loaded one), each checked to have an
    SAE on ``scope``."""
    out = scope.layers if layers is None else ([layers] if isinstance(layers, int) else list(layers))
    if not out:
        raise ValueError("no layers to read: attach SAEs first (Scope.load_saes) or pass layers=")
    missing = [n for n in out if n not in scope.saes]
    if missing:
        raise ValueError(f"no SAE at layer(s) {missing}; the scope has SAEs at layers {scope.layers}. Pass layers= "
                         f"from those or load them with scope.load_saes(release, {missing})")
    return out


def _token_ids(scope, text: str, template: str | None, max_tokens: int | None) -> list[int]:
    ids = scope.tokenize(text, template)[0].tolist()
    return ids[:max_tokens] if max_tokens else ids


def _score_batch(scope, ids: list[list[int]], layers: list[int], reduce: str) -> dict[int, torch.Tensor]:
    """Scores of already-tokenised texts, one right-padded forward: ``{layer: [B, d_sae]}``."""
    length = max(len(i) for i in ids)
    pad = scope.pad_id
    batch = torch.tensor([i + [pad] * (length - len(i)) for i in ids], device=scope.device)  # [B, T]
    lengths = torch.tensor([len(i) for i in ids])
    positions = torch.arange(length)
    # position 0 (the attention sink) and the right padding never count
    keep = (positions[None] >= 1) & (positions[None] < lengths[:, None])  # [B, T]
    cap = capture_forward(scope.model, [scope.hook_name(n) for n in layers], input_ids=batch)
    out = {}
    with torch.no_grad():
        for n in layers:
            sae = scope.sae(n)
            resid = cap[scope.hook_name(n)].to(sae.device)  # [B, T, d_model]
            codes = sae.encode_sparse(resid.flatten(0, 1).float())
            values = codes.values.float().cpu().clamp(min=0) * keep.flatten()[:, None]  # [B*T, k]
            rows = torch.arange(len(ids)).repeat_interleave(length)[:, None].expand_as(values)
            flat = rows.flatten() * sae.d_sae + codes.indices.cpu().flatten()
            score = torch.zeros(len(ids) * sae.d_sae).scatter_reduce_(0, flat, values.flatten(),
                                                                      "amax" if reduce == "max" else "sum")
            out[n] = score.view(len(ids), sae.d_sae)
            if reduce == "mean":
                out[n] /= keep.sum(1, keepdim=True).clamp(min=1)
    return out


def document_scores(scope, texts: Sequence[str], layers: int | Iterable[int] | None = None, *,
                    template: str | None = None, batch_size: int = 16,
                    max_tokens: int | None = None, reduce: str = "max") -> dict[int, torch.Tensor]:
    """Per layer, each text's largest activation of every feature over positions 1.. (0 where it never fires).

    Args:
        scope: a ``Scope`` with SAEs at ``layers``.
        texts: N texts.
        layers: SAE layers (default: every loaded one).
        template: chat template, see ``Scope.tokenize``.
        batch_size: texts per forward (they are sorted by length first, so a batch pads little).
        max_tokens: cut each text to its first this many tokens (default: whole texts).
        reduce: ``"max"`` (the document score) or ``"mean"`` (the mean activation over positions 1.., inactive
            positions counting 0: how much of the text carries the feature, steadier on mixed text).

    Returns:
        ``{layer: [N, d_sae] float32}`` in the order of ``texts``. A one-token text scores 0 everywhere.

    Example:
        >>> scores = document_scores(scope, ["def f(x):", "The cat sat."], [4])
        >>> scores[4].shape
        torch.Size([2, 1024])
    """
    layers = layer_list(scope, layers)
    if reduce not in ("max", "mean"):
        raise ValueError(f"reduce must be 'max' or 'mean', got {reduce!r}")
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids = [_token_ids(scope, t, template, max_tokens) for t in texts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = {n: torch.zeros(len(ids), scope.sae(n).d_sae) for n in layers}
    for a in range(0, len(order), int(batch_size)):
        rows = order[a:a + int(batch_size)]
        part = _score_batch(scope, [ids[i] for i in rows], layers, reduce)
        for n in layers:
            out[n][torch.tensor(rows)] = part[n]
    return out


def row_text(row, text_column: str = "text") -> str:
    """The text of a corpus row: the row itself when it is a str, else ``row[text_column]``."""
    if isinstance(row, str):
        return row
    if isinstance(row, Mapping):
        if text_column not in row:
            raise KeyError(f"corpus row has no {text_column!r} column (columns: {sorted(row)}); pass "
                           f"text_column= naming the text field")
        return str(row[text_column])
    raise TypeError(f"corpus rows must be str or dict-like, got {type(row).__name__}")


def iter_document_scores(scope, rows: Iterable, layers: int | Iterable[int] | None = None, *,
                         text_column: str = "text", batch_size: int = 64, template: str | None = None,
                         max_tokens: int | None = None) -> Iterator[tuple[list, dict[int, torch.Tensor]]]:
    """Score a corpus of any length (a list, a ``datasets`` stream, a generator) ``batch_size`` rows at a time.

    Args:
        rows: texts or dict rows (``datasets`` rows) holding the text under ``text_column``.
        layers, template, max_tokens: as for ``document_scores``.
        batch_size: rows read and scored together.

    Yields:
        ``(rows, {layer: [B, d_sae]})`` per batch, the rows as read (dicts stay dicts, for writing them back).
    """
    layers = layer_list(scope, layers)
    batch: list = []
    for row in rows:
        batch.append(row)
        if len(batch) == batch_size:
            yield batch, document_scores(scope, [row_text(r, text_column) for r in batch], layers,
                                         template=template, batch_size=batch_size, max_tokens=max_tokens)
            batch = []
    if batch:
        yield batch, document_scores(scope, [row_text(r, text_column) for r in batch], layers, template=template,
                                     batch_size=batch_size, max_tokens=max_tokens)


def store_document_scores(store, point: str, *, features: Iterable[int] | None = None,
                          chunk_tokens: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Document scores from a collected store's SAE codes: no forward pass.

    A stored document can span several packed rows; its score is the maximum over all its tokens except each row's
    first (``positions == 0``: the attention sink of that row).

    Args:
        store: an ``ActivationStore`` collected with SAE codes at ``point``.
        point: e.g. ``"resid_post.12"``.
        features: keep only these feature ids (columns in this order); default all (``[D, d_sae]`` in memory).
        chunk_tokens: tokens read at a time.

    Returns:
        ``(doc_ids [D] int64, scores [D, F] float32)``: the corpus index of each stored document, sorted, and its
        scores.

    Example:
        >>> docs, s = store_document_scores(store, "resid_post.12", features=clf_features)
    """
    info = store.point_info(point)
    if not info["sae"]:
        raise ValueError(f"point {point!r} of {store.root} holds no SAE codes; collect with sae_layers=[...]")
    d_sae = int(info["sae"]["d_sae"])
    cols = torch.arange(d_sae) if features is None else torch.as_tensor(list(features), dtype=torch.long)
    if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= d_sae):
        raise ValueError(f"features must be in 0..{d_sae - 1} for {point!r}, got {cols.tolist()[:8]}")
    column = torch.full((d_sae,), -1, dtype=torch.long)
    column[cols] = torch.arange(cols.numel())
    docs_all, pos_all = store.doc_index(), store.positions()
    doc_ids, row_of = torch.unique(docs_all, return_inverse=True)
    flat = torch.zeros(doc_ids.numel() * cols.numel())
    for start, codes in store.iter_chunks(point, "sae", chunk_tokens):
        n = codes.values.shape[0]
        row, keep = row_of[start:start + n], pos_all[start:start + n] > 0
        col = column[codes.indices]  # [n, k], -1 where the feature is not asked for
        take = (col >= 0) & keep[:, None]
        index = (row[:, None].expand_as(col) * cols.numel() + col)[take]
        flat.scatter_reduce_(0, index, codes.values.float()[take].clamp(min=0), "amax")
    return doc_ids, flat.view(doc_ids.numel(), cols.numel())
