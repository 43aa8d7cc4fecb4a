"""A feature's data as JSON in a Neuronpedia-like shape (the field names of Neuronpedia's feature export and
SAEDashboard's Neuronpedia runner), so it can be compared with, or uploaded beside, Neuronpedia features.

Shape (one feature)::

    {"modelId", "layer", "index", "maxActApprox", "frac_nonzero", "decoder_norm",
     "pos_str", "pos_values", "neg_str", "neg_values",                # logit lens, top/bottom tokens
     "freq_hist_data_bar_heights", "freq_hist_data_bar_values",       # activation histogram, 50 linear bins
     "logits_hist_data_bar_heights", "logits_hist_data_bar_values",
     "topkCosSimIndices", "topkCosSimValues", "correlated_features_indices", "correlated_features_jaccard",
     "activations": [{"bin_min", "bin_max", "bin_contains", "tokens", "values", "maxValue",
                      "maxValueTokenIndex", "qualifying_token_index", "dataIndex"}],   # top group has bin_min -1
     "explanations": [{"description", "notes", "typeName": "user"},        # the user's label
                      {"description", "typeName": "qwen-scope-detection", "explanationModelName",
                       "scores": [{"explanationScoreTypeName": "detection-auroc", "value"}]}]}   # automatic
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from qwen_scope.explore.card import DecodedExample, FeatureCard


def public_name(value):
    """``value`` as an export may show it: a local path (absolute, ``./``, ``~`` or existing) becomes its last part
    (``/home/me/runs/tiny-qwen`` -> ``tiny-qwen``), so shared pages and JSON carry no local paths; hub ids and other
    values pass unchanged.

    Example:
        >>> public_name("/home/me/models/tiny-qwen"), public_name("Qwen/Qwen3.5-2B-Base")
        ('tiny-qwen', 'Qwen/Qwen3.5-2B-Base')
    """
    if not isinstance(value, (str, Path)):
        return value
    text = str(value)
    if os.path.isabs(text) or text.startswith(("./", "../", "~")) or (text and Path(text).exists()):
        return Path(text.rstrip("/")).name or text
    return text


def _activation(e: DecodedExample, lo: float, hi: float, contains: float) -> dict:
    values = [float(v) for v in e.example.values]
    peak = max(range(len(values)), key=values.__getitem__) if values else 0
    return {"bin_min": lo, "bin_max": hi, "bin_contains": contains, "tokens": list(e.strings), "values": values,
            "maxValue": float(e.value), "maxValueTokenIndex": peak, "qualifying_token_index": e.mark,
            "dataIndex": e.example.token_index}


def linear_histogram(edges: Iterable[float], counts: Iterable[int], bins: int = 50) -> tuple[list[float], list[int]]:
    """Re-bin a log-grid histogram into ``bins`` linear bins from 0 to the top edge.

    Each log bucket's count goes to the linear bin holding its geometric centre (exact to the grid's ~15%).

    Returns:
        ``(bin centres, counts)``.
    """
    edges, counts = list(edges), list(counts)
    if not counts:
        return [], []
    centres = torch.tensor([math.sqrt(a * b) for a, b in zip(edges, edges[1:])], dtype=torch.float64)
    top = edges[-1]
    which = (centres / top * bins).long().clamp(0, bins - 1)
    heights = torch.zeros(bins, dtype=torch.int64).index_add_(0, which, torch.tensor(counts, dtype=torch.int64))
    width = top / bins
    return [width * (i + 0.5) for i in range(bins)], heights.tolist()


def feature_json(card: FeatureCard, *, model_id: str | None = None, source: str | None = None) -> dict:
    """The Neuronpedia-like dict of one feature card (see the module docstring).

    Args:
        card: a :class:`FeatureCard`.
        model_id: ``modelId`` (default: ``card.meta["model"]``).
        source: Neuronpedia's SAE id for ``layer`` (default: ``"{layer}-qwen-scope-res"`` from the meta).
    """
    meta = card.meta
    layer = meta.get("layer")
    if source is None:
        source = f"{layer}-qwen-scope-res" if layer is not None else str(meta.get("point", ""))
    bar_values, bar_heights = linear_histogram(card.hist_edges, card.hist_counts)
    view = card.view
    lens = view.logits if view is not None else None
    out = {
        "modelId": model_id or public_name(meta.get("model")) or "", "layer": source, "index": card.feature,
        "maxActApprox": card.max, "frac_nonzero": card.density, "mean_activation": card.mean,
        "n_tokens": card.n_tokens, "decoder_norm": view.decoder_norm if view is not None else None,
        "pos_str": [s for s, _ in card.logit_top], "pos_values": [v for _, v in card.logit_top],
        "neg_str": [s for s, _ in card.logit_bottom], "neg_values": [v for _, v in card.logit_bottom],
        "freq_hist_data_bar_heights": bar_heights, "freq_hist_data_bar_values": bar_values,
        "logits_hist_data_bar_heights": list(lens.hist_counts) if lens is not None else [],
        "logits_hist_data_bar_values": ([(a + b) / 2 for a, b in zip(lens.hist_edges, lens.hist_edges[1:])]
                                        if lens is not None else []),
        "topkCosSimIndices": list(view.neighbors) if view is not None else [],
        "topkCosSimValues": list(view.neighbor_cosines) if view is not None else [],
        "correlated_features_indices": [c.other for c in card.cooccurring],
        "correlated_features_jaccard": [c.jaccard for c in card.cooccurring],
        "activations": [_activation(e, -1.0, card.max, 0.0) for e in card.top],
        "explanations": ([{"description": card.label, "notes": card.notes, "typeName": "user"}]
                         if card.label or card.notes else []),
    }
    if card.explanation is not None:
        auto = card.explanation
        out["explanations"].append({
            "description": auto["text"], "typeName": "qwen-scope-detection",
            "explanationModelName": auto["explainer"],
            "scores": ([] if auto["detection_auroc"] is None
                       else [{"explanationScoreTypeName": "detection-auroc", "value": auto["detection_auroc"]}])})
    for b, examples in card.bins:
        out["activations"] += [_activation(e, b.lo, b.hi, b.contains) for e in examples]
    return out


def write_feature_json(card: FeatureCard, path: str | Path, **kwargs) -> Path:
    """Write :func:`feature_json` of ``card`` to ``path`` (UTF-8, indented); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(feature_json(card, **kwargs), indent=1, ensure_ascii=False), encoding="utf-8")
    return path
