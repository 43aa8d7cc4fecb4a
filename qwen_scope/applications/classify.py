"""Few-seed text classification with SAE features: an OR of thresholded features, no trained head.

The Qwen-Scope report's data-classification use (reference ``qwen-scope-saes.md`` §2.3): a few seed examples of each
class pick "class-biased" features, and a simple logical rule over a handful of them is the classifier.

A text's *document score* for a feature is its largest activation anywhere in the text (position 0, the attention
sink, left out); the feature *fires on the document above t* when that score is > t. For every feature of every layer
``fit`` tries the thresholds {0} ∪ {scores of the negative seeds} and keeps the one where the positive seeds' firing
rate minus the negative seeds' firing rate is largest (the highest such threshold on ties, so fewer negatives pass);
the final threshold sits halfway between it and the next positive seed score above it (the widest margin). Features
are ranked by that rate difference with ``LayerComparison.ranked`` (the feature-comparison ranking; ties broken by the
difference of mean document scores), and the rule keeps the best ``n_features`` over all layers:

    predict(text) = OR over rule features i of  doc_score_i(text) > threshold_i

    clf = FeatureClassifier.fit(scope, code_seeds, prose_seeds, n_features=4)
    clf.predict(["def f(x):\\n    return x"])      # tensor([True])
    print(clf.explain())
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from qwen_scope.applications.scoring import document_scores, layer_list
from qwen_scope.compare import LayerComparison

__all__ = ["RuleFeature", "FeatureClassifier", "binary_metrics"]

_FORMAT = "qwen-scope/feature-classifier/1"


@dataclass(frozen=True)
class RuleFeature:
    """One term of the OR rule: ``doc_score(layer, feature) > threshold``.

    Attributes:
        layer: SAE layer. feature: feature id.
        threshold: the document score must exceed this.
        rate_pos, rate_neg: fraction of positive / negative seeds whose score exceeds ``threshold``.
        mean_pos, mean_neg: mean document score over the positive / negative seeds.
    """

    layer: int
    feature: int
    threshold: float
    rate_pos: float
    rate_neg: float
    mean_pos: float
    mean_neg: float

    @property
    def rate_diff(self) -> float:
        """rate_pos - rate_neg on the seeds."""
        return self.rate_pos - self.rate_neg


def _stumps(pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best threshold per feature from seed scores pos [P, d_sae], neg [M, d_sae].

    Returns thresholds [d_sae], rate_pos [d_sae], rate_neg [d_sae] at those thresholds.
    """
    cands = torch.cat([torch.zeros(1, pos.shape[1]), neg])  # [M + 1, d_sae]
    rate_p = (pos[None] > cands[:, None]).float().mean(1)  # [M + 1, d_sae]
    rate_n = (neg[None] > cands[:, None]).float().mean(1)
    diff = rate_p - rate_n
    best = diff.max(0).values
    # Highest candidate threshold among the best: fewer negatives pass the OR.
    t0 = torch.where(diff == best, cands, torch.full_like(cands, -1.0)).max(0).values  # [d_sae]
    above = torch.where(pos > t0, pos, torch.full_like(pos, float("inf"))).min(0).values
    threshold = torch.where(torch.isfinite(above), (t0 + above) / 2, t0)
    return threshold, (pos > threshold).float().mean(0), (neg > threshold).float().mean(0)


class FeatureClassifier:
    """An OR rule over thresholded SAE features, picked from a few seed texts (see the module docstring).

    Build it with ``FeatureClassifier.fit`` (or ``from_json``); ``rules`` lists its ``RuleFeature``s.
    """

    def __init__(self, scope, rules: Sequence[RuleFeature], *, template: str | None = None):
        if not rules:
            raise ValueError("a FeatureClassifier needs at least one rule feature")
        self.scope = scope
        self.rules = tuple(rules)
        self.template = template
        if scope is not None:
            layer_list(scope, sorted({r.layer for r in self.rules}))

    @classmethod
    def fit(cls, scope, positives: Sequence[str], negatives: Sequence[str], *,
            layers: int | Iterable[int] | None = None, n_features: int = 4, min_rate_diff: float = 0.5,
            template: str | None = None) -> FeatureClassifier:
        """Pick the rule from seed texts.

        Args:
            scope: a ``Scope`` with SAEs at ``layers``.
            positives, negatives: seed texts of the class to detect and of the rest (a few each, e.g. 8).
            layers: SAE layers to search (default: every loaded one).
            n_features: rule size: the best this many features over all searched layers.
            min_rate_diff: keep only features whose seed rate difference (rate_pos - rate_neg at their threshold)
                is at least this (0 < min_rate_diff <= 1).
            template: chat template applied to every text, see ``Scope.tokenize``.

        Returns:
            the fitted ``FeatureClassifier``.

        Example:
            >>> clf = FeatureClassifier.fit(scope, ["def f(): pass", ...], ["The cat sat.", ...], layers=[3, 4])
        """
        for what, seeds in (("positives", positives), ("negatives", negatives)):
            if not isinstance(seeds, str) and len(seeds) == 0:
                raise ValueError(f"{what} is empty: few-seed classification needs seeds of both classes (a few of "
                                 f"each, e.g. 8); pass {what} examples")
        positives, negatives = _texts(positives, "positives"), _texts(negatives, "negatives")
        layers = layer_list(scope, layers)
        pos = document_scores(scope, positives, layers, template=template)
        neg = document_scores(scope, negatives, layers, template=template)
        return cls.from_seed_scores(scope, pos, neg, n_features=n_features, min_rate_diff=min_rate_diff,
                                    template=template)

    @classmethod
    def from_seed_scores(cls, scope, positives: Mapping[int, torch.Tensor], negatives: Mapping[int, torch.Tensor], *,
                         n_features: int = 4, min_rate_diff: float = 0.5,
                         template: str | None = None) -> FeatureClassifier:
        """``fit`` from the seeds' document scores (``{layer: [P, d_sae]}`` and ``{layer: [M, d_sae]}``), e.g. read
        from an activation store with ``store_document_scores``; every layer of ``positives`` is searched."""
        if int(n_features) < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        if not 0 < min_rate_diff <= 1:
            raise ValueError(f"min_rate_diff must be in (0, 1], got {min_rate_diff}")
        layers = sorted(positives)
        if sorted(negatives) != layers:
            raise ValueError(f"positives score layers {layers} but negatives {sorted(negatives)}; score both at the "
                             "same layers")
        n_pos, n_neg = positives[layers[0]].shape[0], negatives[layers[0]].shape[0]
        for what, n in (("positive", n_pos), ("negative", n_neg)):
            if n == 0:
                raise ValueError(f"no {what} seeds: few-seed classification needs seeds of both classes (a few of "
                                 f"each, e.g. 8); add {what} examples")
        candidates: list[RuleFeature] = []
        best = 0.0
        for n in layers:
            pos, neg = positives[n].float(), negatives[n].float()
            threshold, rate_p, rate_n = _stumps(pos, neg)
            best = max(best, float((rate_p - rate_n).max()))
            lc = LayerComparison(n, n_pos, n_neg, rate_p, rate_n, pos.mean(0), neg.mean(0))
            for d in lc.ranked(n_features, side="a"):
                if d.diff >= min_rate_diff:
                    candidates.append(RuleFeature(n, d.feature, float(threshold[d.feature]), d.rate_a, d.rate_b,
                                                  d.mean_a, d.mean_b))
        if not candidates:
            raise ValueError(f"no feature at layers {layers} separates the seeds by min_rate_diff={min_rate_diff} "
                             f"(the best seed rate difference is {best:.2f}): the classes look alike to these SAEs; "
                             "lower min_rate_diff, search more layers, or use clearer seeds")
        candidates.sort(key=lambda r: (-r.rate_diff, -abs(r.mean_pos - r.mean_neg), r.layer, r.feature))
        return cls(scope, candidates[: int(n_features)], template=template)

    @property
    def layers(self) -> list[int]:
        """The SAE layers the rule reads."""
        return sorted({r.layer for r in self.rules})

    def scores(self, texts: Sequence[str], *, batch_size: int = 16) -> torch.Tensor:
        """Document scores of the rule's features.

        Args:
            texts: N texts. batch_size: texts per forward.
        Returns:
            [N, F] float32, column i is ``rules[i]``'s largest activation over positions 1.. of each text.
        """
        texts = _texts(texts, "texts")
        if self.scope is None:
            raise ValueError("this classifier has no scope; load it with FeatureClassifier.from_json(text, scope)")
        per_layer = document_scores(self.scope, texts, self.layers, template=self.template, batch_size=batch_size)
        return self.rule_scores(per_layer)

    def rule_scores(self, per_layer: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The rule's columns ``[N, F]`` of already computed document scores ``{layer: [N, d_sae]}``."""
        missing = [n for n in self.layers if n not in per_layer]
        if missing:
            raise ValueError(f"the rule reads layers {self.layers} but the scores hold {sorted(per_layer)}; score "
                             f"layers {missing} too")
        return torch.stack([per_layer[r.layer][:, r.feature].float() for r in self.rules], dim=1)

    @property
    def thresholds(self) -> torch.Tensor:
        """[F] float32 thresholds of the rule's features."""
        return torch.tensor([r.threshold for r in self.rules], dtype=torch.float32)

    def margin(self, rule_scores: torch.Tensor) -> torch.Tensor:
        """[N] the largest ``score_i / threshold_i`` over the rule's features: the rule fires where it is > 1, and
        sweeping a cut on it scales every threshold at once (the precision/recall curve of the rule)."""
        return (rule_scores / self.thresholds.clamp(min=1e-6)).max(1).values

    def votes(self, texts: Sequence[str]) -> torch.Tensor:
        """[N] int64: how many rule features fire above their threshold on each text."""
        return (self.scores(texts) > self.thresholds).sum(1)

    def predict(self, texts: str | Sequence[str]) -> torch.Tensor:
        """[N] bool: True where any rule feature's document score exceeds its threshold."""
        return self.votes([texts] if isinstance(texts, str) else texts) > 0

    def predict_scores(self, per_layer: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """``predict`` on already computed document scores ``{layer: [N, d_sae]}``: [N] bool."""
        return (self.rule_scores(per_layer) > self.thresholds).any(1)

    def evaluate(self, texts: Sequence[str], labels: Sequence[bool] | torch.Tensor) -> dict[str, float]:
        """Precision, recall, F1 and accuracy of ``predict`` against ``labels``.

        Args:
            texts: N texts. labels: N bools (True = the positive class).
        Returns:
            ``{"precision", "recall", "f1", "accuracy", "tp", "fp", "fn", "tn"}`` (0.0 where undefined).
        """
        y = torch.as_tensor(labels, dtype=torch.bool).flatten()
        if len(y) != len(texts):
            raise ValueError(f"got {len(texts)} texts but {len(y)} labels; pass one label per text")
        return binary_metrics(self.predict(texts), y)

    def explain(self) -> str:
        """The rule as text: one line per feature with its threshold and seed statistics."""
        lines = [f"positive if ANY of these {len(self.rules)} features fires above its threshold "
                 f"(document score = max activation over positions 1..):"]
        lines.append(f"  {'layer':>5} {'feature':>7} {'> thresh':>9} {'rate+':>6} {'rate-':>6} {'mean+':>7} "
                     f"{'mean-':>7}")
        for r in self.rules:
            lines.append(f"  {r.layer:>5} {r.feature:>7} {r.threshold:>9.3f} {r.rate_pos:>6.2f} {r.rate_neg:>6.2f} "
                         f"{r.mean_pos:>7.3f} {r.mean_neg:>7.3f}")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The rule as a JSON string (no model or SAE weights; reload with ``from_json(text, scope)``)."""
        return json.dumps({"format": _FORMAT, "model": getattr(self.scope, "model_name", None),
                           "template": self.template, "rules": [r.__dict__ for r in self.rules]}, indent=1)

    @classmethod
    def from_json(cls, text: str, scope) -> FeatureClassifier:
        """Rebuild a classifier saved by ``to_json`` over ``scope`` (which needs SAEs at the rule's layers)."""
        data = json.loads(text)
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a feature classifier: format {data.get('format')!r}, expected {_FORMAT!r}")
        rules = [RuleFeature(int(r["layer"]), int(r["feature"]), float(r["threshold"]), float(r["rate_pos"]),
                             float(r["rate_neg"]), float(r["mean_pos"]), float(r["mean_neg"])) for r in data["rules"]]
        return cls(scope, rules, template=data.get("template"))

    def __repr__(self) -> str:
        feats = ", ".join(f"L{r.layer}#{r.feature}>{r.threshold:.2f}" for r in self.rules)
        return f"FeatureClassifier(OR of {len(self.rules)}: {feats})"


def binary_metrics(predicted: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Precision, recall, F1 and accuracy of [N] bool predictions against [N] bool labels (0.0 where undefined)."""
    p, y = torch.as_tensor(predicted, dtype=torch.bool), torch.as_tensor(labels, dtype=torch.bool)
    tp, fp = int((p & y).sum()), int((p & ~y).sum())
    fn, tn = int((~p & y).sum()), int((~p & ~y).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "accuracy": (tp + tn) / max(1, len(y)), "tp": tp,
            "fp": fp, "fn": fn, "tn": tn}


def _texts(texts, what: str) -> list[str]:
    if isinstance(texts, str):
        raise TypeError(f"{what} must be a list of texts, got one str; wrap it: [{texts[:20]!r}...]")
    out = list(texts)
    if not out:
        raise ValueError(f"{what} is empty; pass at least one text")
    bad = [i for i, t in enumerate(out) if not isinstance(t, str) or not t]
    if bad:
        raise ValueError(f"{what}[{bad[0]}] is not a non-empty str ({out[bad[0]]!r}); drop or fix it")
    return out
