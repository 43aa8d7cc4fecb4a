"""What a steering evaluation returns: one ``ArmResult`` per arm (the edit, each control), the evaluation with its
summary and figure, the strength sweep with its suggestion rule.

    ev.target.kl_per_step, ev.random_directions[0].kl, ev.result.side_by_side()
    sweep.suggested, sweep.figure()
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ArmResult", "SteeringEvaluation", "StrengthSweep", "suggest_strength"]


@dataclass(frozen=True)
class ArmResult:
    """The metrics of one arm over the prompt set (see ``qwen_scope.evals.steer_eval``).

    Attributes:
        name: ``"target"``, ``"random direction i"`` or ``"random feature g"``. layer, feature: the arm's edit.
        kl_per_step: ``[G]`` mean over prompts of KL(steered || base) at generated step i. kl: mean over all steps.
        feature_activation / base_feature_activation: the arm's feature (the target's for a random direction) at
            the edited positions, steered / unsteered model on the same tokens.
        perplexity: the base model's perplexity of the arm's continuations.
        top_logit_deltas: ``[(token, mean logit change)]``, largest first. texts: the continuations.
    """

    name: str
    layer: int
    feature: int
    kl_per_step: tuple[float, ...]
    kl: float
    feature_activation: float
    base_feature_activation: float
    perplexity: float
    top_logit_deltas: tuple[tuple[str, float], ...]
    texts: tuple[str, ...]

    @property
    def activation_gain(self) -> float:
        return self.feature_activation - self.base_feature_activation


@dataclass(frozen=True)
class SteeringEvaluation:
    """A steering edit measured on prompts, with its controls. ``results`` are the ordinary ``SteeringResult``s
    (baseline vs steered, with probabilities), one per prompt; ``base_perplexity`` is the base model's perplexity of
    its own continuations."""

    prompts: tuple[str, ...]
    edit: object
    target: ArmResult
    base_perplexity: float
    random_directions: tuple[ArmResult, ...]
    random_features: tuple[ArmResult, ...]
    results: tuple = ()

    @property
    def result(self):
        """The ``SteeringResult`` of the first prompt (what ``Scope.steer`` returns without ``evaluate``)."""
        return self.results[0]

    @property
    def arms(self) -> tuple[ArmResult, ...]:
        return (self.target, *self.random_directions, *self.random_features)

    def summary(self) -> str:
        """Plain-text table: per arm KL, feature activation (base -> steered), perplexity, top logit deltas."""
        lines = [f"edit: layer {self.edit.layer} feature {self.edit.feature} {self.edit.mode} {self.edit.value:g} "
                 f"({self.edit.scale}) at {self.edit.positions}; {len(self.prompts)} prompt(s); base perplexity "
                 f"{self.base_perplexity:.2f}",
                 f"{'arm':<22}{'KL/step':>9}{'activation':>20}{'perplexity':>12}  top logit deltas"]
        for a in self.arms:
            deltas = " ".join(f"{t!r}:{d:+.2f}" for t, d in a.top_logit_deltas[:4])
            lines.append(f"{a.name:<22}{a.kl:>9.4f}{a.base_feature_activation:>9.3f} -> {a.feature_activation:<7.3f}"
                         f"{a.perplexity:>12.2f}  {deltas}")
        return "\n".join(lines)

    def figure(self):
        """Plotly: KL(steered || base) per generated step for the edit and each control."""
        import plotly.graph_objects as go

        fig = go.Figure()
        for a in self.arms:
            fig.add_trace(go.Scatter(y=list(a.kl_per_step), mode="lines+markers", name=a.name,
                                     line={"width": 3 if a.name == "target" else 1}))
        fig.update_layout(title=f"KL(steered || base) per step: layer {self.edit.layer} #{self.edit.feature} "
                                f"{self.edit.mode} {self.edit.value:g} vs controls",
                          xaxis_title="generated step", yaxis_title="KL (nats)", height=420)
        return fig


def suggest_strength(strengths: Sequence[float], effect: Sequence[float], perplexity: Sequence[float],
                     base_perplexity: float, *, saturation: float = 0.9, coherence: float = 2.0) -> float | None:
    """The smallest strength (by magnitude) whose ``|effect|`` reaches ``saturation`` x the largest ``|effect|``
    among the coherent strengths (perplexity <= ``coherence`` x ``base_perplexity``); None when no coherent strength
    moves the feature.

    Example:
        >>> suggest_strength([0, 2, 4, 8], [0, 1.0, 1.95, 2.0], [3, 3, 3.5, 9], 3.0)
        4.0
    """
    if not 0 < saturation <= 1 or coherence < 1:
        raise ValueError(f"saturation must lie in (0, 1] and coherence be >= 1; got {saturation}, {coherence}")
    coherent = [(abs(float(s)), float(s), abs(float(e))) for s, e, p in zip(strengths, effect, perplexity)
                if p <= coherence * base_perplexity]
    best = max((e for _, _, e in coherent), default=0.0)
    if best <= 0:
        return None
    return min((m, s) for m, s, e in coherent if e >= saturation * best)[1]


@dataclass(frozen=True)
class StrengthSweep:
    """The effect-size curve of one feature's edit over strengths (``effect[i]`` = activation gain at
    ``strengths[i]``), its KL and perplexity, and the suggested strength (``suggest_strength``)."""

    layer: int
    feature: int
    mode: str
    strengths: tuple[float, ...]
    effect: tuple[float, ...]
    kl: tuple[float, ...]
    perplexity: tuple[float, ...]
    base_perplexity: float
    suggested: float | None
    arms: tuple[ArmResult, ...] = ()

    def table(self) -> str:
        rows = [f"layer {self.layer} feature {self.feature} ({self.mode}); base perplexity "
                f"{self.base_perplexity:.2f}; suggested strength {self.suggested}",
                f"{'strength':>9}{'gain':>9}{'KL/step':>9}{'perplexity':>12}  text"]
        for s, e, k, p, a in zip(self.strengths, self.effect, self.kl, self.perplexity, self.arms):
            rows.append(f"{s:>9g}{e:>9.3f}{k:>9.4f}{p:>12.2f}  {a.texts[0][:40]!r}")
        return "\n".join(rows)

    def figure(self):
        """Plotly: activation gain and KL by strength, perplexity on a second axis, the suggestion marked."""
        import plotly.graph_objects as go

        fig = go.Figure()
        fig.add_trace(go.Scatter(x=list(self.strengths), y=list(self.effect), name="activation gain",
                                 mode="lines+markers"))
        fig.add_trace(go.Scatter(x=list(self.strengths), y=list(self.kl), name="KL per step", mode="lines+markers"))
        fig.add_trace(go.Scatter(x=list(self.strengths), y=list(self.perplexity), name="perplexity (base model)",
                                 mode="lines+markers", yaxis="y2", line={"dash": "dot"}))
        if self.suggested is not None:
            fig.add_vline(x=self.suggested, line_dash="dash", annotation_text=f"suggested {self.suggested:g}")
        fig.update_layout(title=f"Strength sweep: layer {self.layer} #{self.feature} ({self.mode})",
                          xaxis_title="strength", yaxis_title="gain / KL",
                          yaxis2={"title": "perplexity", "overlaying": "y", "side": "right"}, height=420)
        return fig
