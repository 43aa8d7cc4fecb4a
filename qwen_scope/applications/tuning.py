"""Few-seed classification, held out: the rule's size and thresholds picked on a tuning split, a diff-of-means
linear probe on the same features as the baseline, and precision/recall curves for both.

The seeds pick candidate features (``FeatureClassifier.fit`` with a generous ``n_features``); raw seed thresholds
over-fire on mixed text, where one stray code line in a paragraph of prose lifts a code feature's document maximum.
``tune_rule`` rebuilds the OR on a labelled tuning split: greedily, it adds the (candidate feature, threshold) pair
that raises the OR's F1 on that split the most, trying as thresholds every candidate's own score on a negative text
(the rule fires strictly above it), and stops when no pair raises F1 or at ``max_features``. The threshold kept sits
halfway to the next score above it on the split.

The baseline, ``MeanDiffProbe``, reads the same document scores (every feature of the searched layers): its weight
is the difference of the class means over the seeds, ``w = mean(pos) - mean(neg)``, its score ``x . w`` and its cut
the tuning split's best-F1 threshold (the midpoint of the projected class means until tuned).

    pool = FeatureClassifier.fit(scope, pos_seeds, neg_seeds, n_features=16, min_rate_diff=0.5)
    tuned = tune_rule(pool, document_scores(scope, tune_texts, pool.layers), tune_labels)
    probe = MeanDiffProbe.fit(pos_scores, neg_scores).tuned(tune_scores, tune_labels)
    pr_figure({"rule": (tuned.classifier.margin(rule_scores), y), "probe": (probe.decision(scores), y)})
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from qwen_scope.applications.classify import FeatureClassifier, RuleFeature, binary_metrics

__all__ = ["RuleTuning", "tune_rule", "MeanDiffProbe", "pr_curve", "pr_figure", "best_threshold"]


def _labels(labels, n: int, what: str) -> torch.Tensor:
    y = torch.as_tensor(labels, dtype=torch.bool).flatten()
    if len(y) != n:
        raise ValueError(f"{what}: got {n} scored texts but {len(y)} labels; pass one label per text")
    if bool(y.all()) or not bool(y.any()):
        raise ValueError(f"{what}: every label is {bool(y[0]) if len(y) else None}; the split needs texts of both "
                         "classes to measure precision and recall")
    return y


def _f1(fired: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """F1 of each row of fired [R, N] against y [N]: [R] float64."""
    tp = (fired & y).sum(-1).double()
    fp = (fired & ~y).sum(-1).double()
    fn = (~fired & y).sum(-1).double()
    return torch.where(tp > 0, 2 * tp / (2 * tp + fp + fn), torch.zeros_like(tp))


@dataclass(frozen=True)
class RuleTuning:
    """A rule rebuilt on a tuning split.

    Attributes:
        classifier: the tuned ``FeatureClassifier`` (its rules' rates and means are on the tuning split).
        f1_by_size: the tuning split's F1 after each greedy addition (``f1_by_size[i]`` with ``i + 1`` features).
        pool: the candidate rule it chose from.
    """

    classifier: FeatureClassifier
    f1_by_size: tuple[float, ...]
    pool: FeatureClassifier


def tune_rule(pool: FeatureClassifier, scores: Mapping[int, torch.Tensor], labels, *,
              max_features: int = 8) -> RuleTuning:
    """Pick the rule's features and thresholds from ``pool``'s candidates on a labelled tuning split.

    Args:
        pool: a classifier whose rules are the candidates (``fit`` with a large ``n_features``).
        scores: the tuning texts' document scores ``{layer: [N, d_sae]}`` at ``pool.layers``.
        labels: N bools (True = the positive class), both classes present.
        max_features: the largest rule.

    Returns:
        ``RuleTuning`` (the classifier, the F1 path, the pool).
    """
    cols = pool.rule_scores(scores)  # [N, K]
    y = _labels(labels, cols.shape[0], "tune_rule")
    if int(max_features) < 1:
        raise ValueError(f"max_features must be >= 1, got {max_features}")
    fired = torch.zeros(cols.shape[0], dtype=torch.bool)
    chosen: list[tuple[int, float]] = []
    path: list[float] = []
    best_f1 = 0.0
    for _ in range(min(int(max_features), cols.shape[1])):
        step = None
        for j in range(cols.shape[1]):
            if any(j == c for c, _ in chosen):
                continue
            cands = torch.unique(torch.cat([torch.zeros(1), cols[~y, j]]))  # [T]
            f1 = _f1(fired[None] | (cols[:, j][None] > cands[:, None]), y)
            # the highest threshold among the best: fewer stray negatives on unseen text
            top = float(f1.max())
            t = float(cands[f1 == f1.max()].max())
            if step is None or top > step[0] + 1e-12:
                step = (top, j, t)
        if step is None or step[0] <= best_f1 + 1e-12:
            break
        best_f1, j, t = step
        above = cols[:, j][cols[:, j] > t]
        chosen.append((j, (t + float(above.min())) / 2 if above.numel() else t))
        fired |= cols[:, j] > chosen[-1][1]
        path.append(best_f1)
    if not chosen:
        raise ValueError("no candidate feature fires on any positive tuning text: the pool's features do not carry "
                         "the class on this split; fit the pool with more seeds, more layers or a larger n_features")
    rules = []
    for j, t in chosen:
        r = pool.rules[j]
        col = cols[:, j]
        rules.append(RuleFeature(r.layer, r.feature, t, float((col[y] > t).float().mean()),
                                 float((col[~y] > t).float().mean()), float(col[y].mean()), float(col[~y].mean())))
    return RuleTuning(FeatureClassifier(pool.scope, rules, template=pool.template), tuple(path), pool)


def _flat(scores: Mapping[int, torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    missing = [n for n in layers if n not in scores]
    if missing:
        raise ValueError(f"the probe reads layers {list(layers)} but the scores hold {sorted(scores)}")
    return torch.cat([scores[n].float() for n in layers], dim=1)


def best_threshold(decision: torch.Tensor, labels) -> tuple[float, float]:
    """``(threshold, f1)``: the cut on ``decision`` [N] (positive where ``decision > threshold``) with the best F1
    on ``labels``, halfway to the next decision value above it."""
    y = _labels(labels, decision.shape[0], "best_threshold")
    cands = torch.unique(decision)
    cands = torch.cat([cands[:1] - 1, cands])
    f1 = _f1(decision[None] > cands[:, None], y)
    i = int(torch.nonzero(f1 == f1.max()).max())
    t = float(cands[i])
    return (t + float(cands[i + 1])) / 2 if i + 1 < len(cands) else t, float(f1[i])


@dataclass(frozen=True)
class MeanDiffProbe:
    """A linear probe ``x . w > bias`` on document scores, ``w`` the difference of the seed classes' means.

    Attributes:
        layers: the layers whose features (concatenated in this order) form ``x``.
        weight: ``[sum d_sae]`` mean(pos) - mean(neg). bias: the cut.
    """

    layers: tuple[int, ...]
    weight: torch.Tensor
    bias: float

    @classmethod
    def fit(cls, positives: Mapping[int, torch.Tensor], negatives: Mapping[int, torch.Tensor]) -> MeanDiffProbe:
        """From the seeds' document scores (the same ``{layer: [P, d_sae]}`` / ``{layer: [M, d_sae]}`` the rule
        reads); the cut starts at the midpoint of the projected class means."""
        layers = tuple(sorted(positives))
        pos, neg = _flat(positives, layers), _flat(negatives, layers)
        if pos.shape[0] == 0 or neg.shape[0] == 0:
            raise ValueError(f"the probe needs seeds of both classes, got {pos.shape[0]} positive and {neg.shape[0]} "
                             "negative")
        mu_p, mu_n = pos.mean(0), neg.mean(0)
        w = mu_p - mu_n
        if float(w.abs().max()) == 0:
            raise ValueError("the class means are identical on every feature: no direction separates the seeds")
        return cls(layers, w, float((mu_p + mu_n) @ w / 2))

    def decision(self, scores: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """[N] ``x . w - bias``: positive where the probe says positive."""
        return _flat(scores, self.layers) @ self.weight - self.bias

    def predict(self, scores: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """[N] bool."""
        return self.decision(scores) > 0

    def tuned(self, scores: Mapping[int, torch.Tensor], labels) -> MeanDiffProbe:
        """The same direction with the cut at the best-F1 threshold on a labelled tuning split."""
        t, _ = best_threshold(self.decision(scores), labels)
        return MeanDiffProbe(self.layers, self.weight, self.bias + t)

    def evaluate(self, scores: Mapping[int, torch.Tensor], labels) -> dict[str, float]:
        """``binary_metrics`` of ``predict`` against ``labels``."""
        d = self.decision(scores)
        return binary_metrics(d > 0, _labels(labels, d.shape[0], "MeanDiffProbe.evaluate"))


def pr_curve(decision: torch.Tensor, labels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(precision, recall, thresholds)`` of ``decision > threshold`` for every distinct cut, from the highest
    threshold (fewest positives) down; each ``[C]`` float64."""
    y = _labels(labels, decision.shape[0], "pr_curve")
    cuts = torch.unique(decision.double()).flip(0)
    fired = decision.double()[None] >= cuts[:, None]  # [C, N]
    tp = (fired & y).sum(1).double()
    precision = tp / fired.sum(1).double()
    recall = tp / y.sum().double()
    return precision, recall, cuts


def pr_figure(curves: Mapping[str, tuple[torch.Tensor, object]], *,
              points: Mapping[str, tuple[float, float]] | None = None,
              title: str = "precision / recall") -> go.Figure:
    """Precision/recall curves, one line per ``{name: (decision [N], labels [N])}``; ``points`` marks operating
    points ``{name: (recall, precision)}`` (e.g. each classifier's chosen cut)."""
    fig = go.Figure()
    for name, (decision, labels) in curves.items():
        p, r, cuts = pr_curve(decision, labels)
        fig.add_trace(go.Scatter(x=r.tolist(), y=p.tolist(), mode="lines+markers", name=name, line_shape="hv",
                                 text=[f"cut {c:.3g}" for c in cuts.tolist()],
                                 hovertemplate="recall %{x:.2f}<br>precision %{y:.2f}<br>%{text}"))
    for name, (r, p) in (points or {}).items():
        fig.add_trace(go.Scatter(x=[r], y=[p], mode="markers", name=name, marker=dict(size=12, symbol="star")))
    fig.update_layout(title=title, xaxis_title="recall", yaxis_title="precision", xaxis_range=[0, 1.02],
                      yaxis_range=[0, 1.02], template="plotly_white", height=420)
    return fig
