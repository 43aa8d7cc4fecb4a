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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from qwen_scope.compare import LayerComparison

__all__ = ["RuleFeature", "FeatureClassifier", "document_scores"]

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


def _layer_list(scope, layers: int | Iterable[int] | None) -> list[int]:
    layer_list = scope.layers if layers is None else ([layers] if isinstance(layers, int) else list(layers))
    if not layer_list:
        raise ValueError("no layers to read: attach SAEs first (Scope.load_saes) or pass layers=")
    missing = [n for n in layer_list if n not in scope.saes]
    if missing:
        raise ValueError(f"no SAE at layer(s) {missing}; the scope has SAEs at layers {scope.layers}. Pass layers= "
                         f"from those or load them with scope.load_saes(release, {missing})")
    return layer_list


def document_scores(scope, texts: Sequence[str], layers: int | Iterable[int] | None = None, *,
                    template: str | None = None) -> dict[int, torch.Tensor]:
    """Per layer, each text's largest activation of every feature over positions 1.. (0 where it never fires).

    Args:
        scope: a ``Scope`` with SAEs at ``layers``.
        texts: N texts.
        layers: SAE layers (default: every loaded one).
        template: chat template, see ``Scope.tokenize``.

    Returns:
        ``{layer: [N, d_sae] float32}``. A one-token text has no positions left and scores 0 everywhere.
    """
    layer_list = _layer_list(scope, layers)
    rows: dict[int, list[torch.Tensor]] = {n: [] for n in layer_list}
    for text in texts:
        feats = scope.features(text, layer_list, skip_first=True, template=template)
        for n in layer_list:
            lf = feats[n]
            # `first` is 0 for a one-token text; position 0 stays out regardless.
            values, indices = lf.values[1:].clamp(min=0), lf.indices[1:]
            score = torch.zeros(lf.d_sae)
            score.scatter_reduce_(0, indices.flatten(), values.flatten(), "amax")
            rows[n].append(score)
    return {n: torch.stack(r) for n, r in rows.items()}


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
            _layer_list(scope, sorted({r.layer for r in self.rules}))

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
        positives, negatives = _texts(positives, "positives"), _texts(negatives, "negatives")
        if int(n_features) < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        if not 0 < min_rate_diff <= 1:
            raise ValueError(f"min_rate_diff must be in (0, 1], got {min_rate_diff}")
        layer_list = _layer_list(scope, layers)
        pos = document_scores(scope, positives, layer_list, template=template)
        neg = document_scores(scope, negatives, layer_list, template=template)
        candidates: list[RuleFeature] = []
        for n in layer_list:
            threshold, rate_p, rate_n = _stumps(pos[n], neg[n])
            lc = LayerComparison(n, len(positives), len(negatives), rate_p, rate_n, pos[n].mean(0), neg[n].mean(0))
            for d in lc.ranked(n_features, side="a"):
                if d.diff >= min_rate_diff:
                    candidates.append(RuleFeature(n, d.feature, float(threshold[d.feature]), d.rate_a, d.rate_b,
                                                  d.mean_a, d.mean_b))
        if not candidates:
            raise ValueError(f"no feature at layers {layer_list} separates the seeds by min_rate_diff="
                             f"{min_rate_diff}; lower min_rate_diff, search more layers, or use clearer seeds")
        candidates.sort(key=lambda r: (-r.rate_diff, -abs(r.mean_pos - r.mean_neg), r.layer, r.feature))
        return cls(scope, candidates[: int(n_features)], template=template)

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """Document scores of the rule's features.

        Args:
            texts: N texts.
        Returns:
            [N, F] float32, column i is ``rules[i]``'s largest activation over positions 1.. of each text.
        """
        texts = _texts(texts, "texts")
        if self.scope is None:
            raise ValueError("this classifier has no scope; load it with FeatureClassifier.from_json(text, scope)")
        layers = sorted({r.layer for r in self.rules})
        per_layer = document_scores(self.scope, texts, layers, template=self.template)
        return torch.stack([per_layer[r.layer][:, r.feature] for r in self.rules], dim=1)

    @property
    def thresholds(self) -> torch.Tensor:
        """[F] float32 thresholds of the rule's features."""
        return torch.tensor([r.threshold for r in self.rules], dtype=torch.float32)

    def votes(self, texts: Sequence[str]) -> torch.Tensor:
        """[N] int64: how many rule features fire above their threshold on each text."""
        return (self.scores(texts) > self.thresholds).sum(1)

    def predict(self, texts: str | Sequence[str]) -> torch.Tensor:
        """[N] bool: True where any rule feature's document score exceeds its threshold."""
        return self.votes([texts] if isinstance(texts, str) else texts) > 0

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
        p = self.predict(texts)
        tp, fp = int((p & y).sum()), int((p & ~y).sum())
        fn, tn = int((~p & y).sum()), int((~p & ~y).sum())
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return {"precision": precision, "recall": recall, "f1": f1, "accuracy": (tp + tn) / len(y), "tp": tp,
                "fp": fp, "fn": fn, "tn": tn}

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
