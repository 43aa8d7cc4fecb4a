"""Feature footprints of text collections: coverage, redundancy between benchmarks, and what a dataset is missing.

The Qwen-Scope report's evaluation and synthesis uses (reference ``qwen-scope-saes.md`` §2.2-2.3): the SAE features a
collection activates are a representation-level *footprint* of what it exercises. One collection *covers* another's
footprint to the extent its own footprint contains it ("63% of GSM8K's features are covered by MATH"); the features of
a target footprint that a training set never activates are its *missing long tail*, the ones data synthesis should
aim at; and a greedy set cover picks, from candidate texts, the fewest that activate as many of those as possible.

A feature is *in* a footprint when at least ``min_docs`` of the collection's documents score above ``threshold`` on
it, a document's score being the feature's largest activation over positions 1.. (``document_scores``: position 0,
the attention sink, left out).

    math, gsm8k = (FeatureFootprint.from_texts(scope, texts) for texts in (math_texts, gsm8k_texts))
    train = FeatureFootprint.from_store(ActivationStore("acts/"), "resid_post.12", min_docs=5)   # a collected corpus
    math.coverage_of(gsm8k)                      # share of GSM8K's features MATH also activates
    gaps = train.missing(target)                 # {layer: feature ids} the training set never activates
    picks = greedy_cover(document_scores(scope, candidates), target_features=gaps, budget=100)
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qwen_scope.applications.scoring import document_scores

__all__ = ["FeatureFootprint", "redundancy_matrix", "greedy_cover", "CoverPick"]

_FORMAT_KEY = "qwen_scope_feature_footprint"


@dataclass(frozen=True)
class FeatureFootprint:
    """Which features a collection activates, per SAE layer.

    Attributes:
        counts: ``{layer: [d_sae] int64}`` documents whose score exceeds ``threshold``, per feature.
        n_docs: documents in the collection.
        threshold: document-score threshold. min_docs: documents a feature needs to be in the footprint.
    """

    counts: Mapping[int, torch.Tensor]
    n_docs: int
    threshold: float = 0.0
    min_docs: int = 1

    @classmethod
    def from_scores(cls, scores: Mapping[int, torch.Tensor], *, threshold: float = 0.0,
                    min_docs: int = 1) -> FeatureFootprint:
        """From per-layer document scores ``{layer: [N, d_sae]}`` (``document_scores``' output).

        Raises:
            ValueError: empty scores, layers that disagree on N, a negative threshold or ``min_docs < 1``.
        """
        if not scores:
            raise ValueError("no layers in scores: pass {layer: [N, d_sae] tensor}, e.g. document_scores(scope, texts)")
        sizes = {n: s.shape[0] for n, s in scores.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"every layer must score the same documents; got row counts {sizes}")
        if threshold < 0 or min_docs < 1:
            raise ValueError(f"need threshold >= 0 and min_docs >= 1, got threshold={threshold}, min_docs={min_docs}")
        counts = {int(n): (s > threshold).sum(0) for n, s in scores.items()}
        return cls(counts, next(iter(sizes.values())), float(threshold), int(min_docs))

    @classmethod
    def from_texts(cls, scope, texts: Sequence[str], layers: int | Iterable[int] | None = None, *,
                   threshold: float = 0.0, min_docs: int = 1, template: str | None = None) -> FeatureFootprint:
        """Encode ``texts`` with the scope's SAEs and keep which features they activate.

        Example:
            >>> fp = FeatureFootprint.from_texts(scope, texts, layers=[12], min_docs=2)
        """
        if isinstance(texts, str) or not texts:
            raise ValueError("texts must be a non-empty list of strings")
        return cls.from_scores(document_scores(scope, list(texts), layers, template=template), threshold=threshold,
                               min_docs=min_docs)

    @classmethod
    def from_store(cls, store, point: str, *, threshold: float = 0.0, min_docs: int = 1,
                   chunk_tokens: int = 1 << 16) -> FeatureFootprint:
        """From the SAE codes of a collected ``ActivationStore`` (millions of tokens, streamed): a document is a
        corpus document (``doc_index``), its score on a feature the largest stored code over its tokens at context
        positions > 0 (top-k codes: a feature outside a token's k counts as 0 there).

        Args:
            store: an ``ActivationStore`` with SAE codes at ``point``. point: e.g. ``"resid_post.12"``.
            threshold, min_docs: as ``from_scores``. chunk_tokens: tokens read at a time.
        Returns:
            the footprint, keyed by the point's layer.

        Example:
            >>> train = FeatureFootprint.from_store(ActivationStore("acts/"), "resid_post.12", min_docs=5)
        """
        info = store.point_info(point)
        if not info["sae"]:
            raise ValueError(f"point {point!r} of {store.root} holds no SAE codes; collect with sae_layers=[...]")
        if threshold < 0 or min_docs < 1:
            raise ValueError(f"need threshold >= 0 and min_docs >= 1, got threshold={threshold}, min_docs={min_docs}")
        d_sae = int(info["sae"]["d_sae"])
        docs_all, pos_all = store.doc_index(), store.positions()
        span = int(docs_all.max()) + 1 if docs_all.numel() else 1  # (feature, document) -> feature * span + doc
        counts = torch.zeros(d_sae, dtype=torch.long)
        last_doc = torch.full((d_sae,), -1, dtype=torch.long)  # the document each feature was last counted in
        for start, codes in store.iter_chunks(point, "sae", chunk_tokens):
            n = codes.values.shape[0]
            docs, keep = docs_all[start:start + n], pos_all[start:start + n] > 0
            fire = (codes.values.float() > threshold) & keep[:, None]
            feats, doc = codes.indices[fire], docs[:, None].expand_as(codes.indices)[fire]
            if feats.numel() == 0:
                continue
            # distinct (feature, document) pairs, sorted by feature then document; a chunk lies in one shard (one
            # rank's stream, documents contiguous and increasing), so only a feature's first document here can be
            # the one it was last counted in
            pairs = torch.unique(feats * span + doc)
            f, d = pairs // span, pairs % span
            first = torch.ones_like(f, dtype=torch.bool)
            first[1:] = f[1:] != f[:-1]
            repeat = first & (last_doc[f] == d)
            counts += torch.bincount(f[~repeat], minlength=d_sae)
            last = torch.ones_like(f, dtype=torch.bool)
            last[:-1] = f[1:] != f[:-1]
            last_doc[f[last]] = d[last]
        layer = int(point.split(".")[-1])
        return cls({layer: counts}, int(torch.unique(docs_all).numel()), float(threshold), int(min_docs))

    @property
    def layers(self) -> list[int]:
        return sorted(self.counts)

    def features(self, layer: int) -> torch.Tensor:
        """Sorted ids of the features in the footprint at ``layer``."""
        return torch.nonzero(self.mask(layer)).flatten()

    def mask(self, layer: int) -> torch.Tensor:
        """``[d_sae]`` bool: which features are in the footprint at ``layer``."""
        if layer not in self.counts:
            raise KeyError(f"no layer {layer} in this footprint (layers {self.layers})")
        return self.counts[layer] >= self.min_docs

    def size(self, layer: int | None = None) -> int:
        """Features in the footprint, at ``layer`` or summed over the layers."""
        return sum(int(self.mask(n).sum()) for n in ([layer] if layer is not None else self.layers))

    def _shared_layers(self, other: FeatureFootprint) -> list[int]:
        shared = [n for n in other.layers if n in self.counts]
        if not shared:
            raise ValueError(f"the footprints share no layer (this: {self.layers}, other: {other.layers})")
        for n in shared:
            if self.counts[n].shape != other.counts[n].shape:
                raise ValueError(f"layer {n}: d_sae {self.counts[n].shape[0]} vs {other.counts[n].shape[0]}; "
                                 "footprints must come from the same SAEs")
        return shared

    def coverage_of(self, other: FeatureFootprint) -> float:
        """Share of ``other``'s features (over the layers both have) that this footprint also contains; 1.0 when
        ``other`` is empty."""
        layers = self._shared_layers(other)
        theirs = sum(int(other.mask(n).sum()) for n in layers)
        both = sum(int((self.mask(n) & other.mask(n)).sum()) for n in layers)
        return both / theirs if theirs else 1.0

    def jaccard(self, other: FeatureFootprint) -> float:
        """|A ∩ B| / |A ∪ B| over the shared layers (1.0 when both are empty)."""
        layers = self._shared_layers(other)
        union = sum(int((self.mask(n) | other.mask(n)).sum()) for n in layers)
        both = sum(int((self.mask(n) & other.mask(n)).sum()) for n in layers)
        return both / union if union else 1.0

    def missing(self, target: FeatureFootprint) -> dict[int, torch.Tensor]:
        """``{layer: feature ids}`` in ``target``'s footprint that this one lacks: the long tail to synthesise for."""
        return {n: torch.nonzero(target.mask(n) & ~self.mask(n)).flatten() for n in self._shared_layers(target)}

    def save(self, path: str | os.PathLike) -> Path:
        """Write to one safetensors file (counts per layer; n_docs, threshold and min_docs in its metadata), via a
        temporary name and a rename. Returns the path."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        meta = {_FORMAT_KEY: json.dumps({"n_docs": self.n_docs, "threshold": self.threshold,
                                         "min_docs": self.min_docs})}
        save_file({f"layer{n}": c.contiguous() for n, c in self.counts.items()}, str(tmp), metadata=meta)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> FeatureFootprint:
        """Read a footprint written by :meth:`save`.

        Raises:
            ValueError: the file is not a saved footprint.
        """
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = (f.metadata() or {}).get(_FORMAT_KEY)
            if meta is None:
                raise ValueError(f"{path} is not a feature footprint (no {_FORMAT_KEY!r} metadata); write one with "
                                 "FeatureFootprint.save()")
            counts = {int(key.removeprefix("layer")): f.get_tensor(key) for key in f.keys()}
        info = json.loads(meta)
        return cls(counts, int(info["n_docs"]), float(info["threshold"]), int(info["min_docs"]))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}: {self.size(n)}" for n in self.layers)
        return f"FeatureFootprint(n_docs={self.n_docs}, features per layer {{{sizes}}}, min_docs={self.min_docs})"


def redundancy_matrix(footprints: Mapping[str, FeatureFootprint]) -> tuple[list[str], torch.Tensor]:
    """``(names, R)`` with ``R[i, j]`` = share of footprint j's features that footprint i covers (diagonal 1).

    Example:
        >>> names, R = redundancy_matrix({"MATH": math, "GSM8K": gsm8k})
        >>> R[0, 1]          # how much of GSM8K MATH covers
    """
    names = list(footprints)
    if not names:
        raise ValueError("no footprints given")
    R = torch.ones(len(names), len(names), dtype=torch.float64)
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i != j:
                R[i, j] = footprints[a].coverage_of(footprints[b])
    return names, R


@dataclass(frozen=True)
class CoverPick:
    """One greedy pick: the candidate's index, the target features it newly covers (per layer) and the running total."""

    index: int
    new: dict[int, list[int]]
    covered: int


def greedy_cover(scores: Mapping[int, torch.Tensor], *, target_features: Mapping[int, Iterable[int]],
                 budget: int, threshold: float = 0.0) -> list[CoverPick]:
    """Pick up to ``budget`` candidates that activate the most not-yet-covered target features, greedily (the
    standard ``1 - 1/e`` set-cover approximation); ties go to the lower index. Stops early when no candidate adds one.

    Args:
        scores: candidates' document scores ``{layer: [N, d_sae]}`` (``document_scores(scope, candidates)``).
        target_features: ``{layer: feature ids}`` to cover, e.g. ``train.missing(target)``.
        budget: most candidates to pick. threshold: a candidate covers a feature when its score exceeds this.
    Returns:
        the picks in order, each with the features it added.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    unknown = [n for n in target_features if n not in scores]
    if unknown:
        raise ValueError(f"target layers {unknown} have no candidate scores (scored layers {sorted(scores)})")
    layers = [n for n in target_features]
    ids = {n: torch.as_tensor(list(target_features[n]), dtype=torch.long) for n in layers}
    # hits[n]: [N, |target_n|] which targets each candidate activates
    hits = {n: scores[n][:, ids[n]] > threshold for n in layers}
    n_cand = next(iter(scores.values())).shape[0] if scores else 0
    open_ = {n: torch.ones(len(ids[n]), dtype=torch.bool) for n in layers}
    used = torch.zeros(n_cand, dtype=torch.bool)
    picks, covered = [], 0
    for _ in range(min(budget, n_cand)):
        gain = sum((hits[n] & open_[n]).sum(1) for n in layers) if layers else torch.zeros(n_cand, dtype=torch.long)
        gain = torch.where(used, torch.full_like(gain, -1), gain)
        best = int(torch.argmax(gain))  # first maximum: the lowest index on ties
        if int(gain[best]) <= 0:
            break
        new = {n: ids[n][hits[n][best] & open_[n]].tolist() for n in layers}
        for n in layers:
            open_[n] &= ~hits[n][best]
        used[best] = True
        covered += int(gain[best])
        picks.append(CoverPick(best, {n: v for n, v in new.items() if v}, covered))
    return picks
