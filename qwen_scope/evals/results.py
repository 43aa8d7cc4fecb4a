"""What an SAE evaluation returns: per-layer metrics, a markdown table, JSON and a plotly figure (metric by layer).

    result.layers[5].ce_recovered, result.layers[5].kl["sae"]
    print(result.table())                  # the table of the nano RESULTS.md
    result.figure().show()
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LayerEval", "SAEEvaluation"]


@dataclass(frozen=True)
class LayerEval:
    """The evaluation of one layer's SAE.

    Attributes:
        layer: decoder block the SAE reads (``resid_post.<layer>``). n_tokens: spliced tokens counted.
        n_predictions: next-token predictions the losses average over. d_sae, k: the SAE's width and top-k.
        fve: fraction of variance explained, ``1 - SSE / sum |x - mean(x)|^2``. mse: SSE per token.
        l0: mean active features per token. dead_fraction / dense_fraction: features never firing / firing on more
            than the configured fraction of tokens.
        loss_clean: the model's next-token loss (nats). loss: ``{mode: loss with that splice}``.
        kl, kl_max: ``{mode: mean / max per token of KL(clean || spliced)}``.
        ce_recovered: sae-lens's CE loss score, ``(loss_zero - loss_sae) / (loss_zero - loss_clean)``.
        ce_recovered_mean: the same against mean ablation.
    """

    layer: int
    n_tokens: int
    n_predictions: int
    d_sae: int
    k: int
    fve: float
    mse: float
    l0: float
    dead_fraction: float
    dense_fraction: float
    loss_clean: float
    loss: dict[str, float] = field(default_factory=dict)
    kl: dict[str, float] = field(default_factory=dict)
    kl_max: dict[str, float] = field(default_factory=dict)
    ce_recovered: float | None = None
    ce_recovered_mean: float | None = None

    @property
    def delta_loss(self) -> float | None:
        """What splicing the SAE in costs: ``loss["sae"] - loss_clean`` (nats per token)."""
        return self.loss["sae"] - self.loss_clean if "sae" in self.loss else None


@dataclass(frozen=True)
class SAEEvaluation:
    """Per-layer results of ``evaluate_saes`` with the run's provenance (``meta``: model, release, the
    base-vs-instruct mismatch note when there is one, settings, corpus fingerprint)."""

    meta: dict
    layers: dict[int, LayerEval]

    def to_dict(self) -> dict:
        return {"meta": self.meta, "layers": {str(n): dataclasses.asdict(e) for n, e in self.layers.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> SAEEvaluation:
        return cls(meta=data["meta"], layers={int(n): LayerEval(**e) for n, e in data["layers"].items()})

    @classmethod
    def load(cls, path: str | Path) -> SAEEvaluation:
        """Read ``sae_eval.json`` (or the directory holding it)."""
        path = Path(path)
        path = path / "sae_eval.json" if path.is_dir() else path
        return cls.from_dict(json.loads(path.read_text()))

    def table(self) -> str:
        """Markdown table: per layer FVE, L0, dead / dense, the losses, CE recovered and KL."""
        head = ("| layer | FVE | L0 | dead | dense | loss clean | loss SAE | loss SAE+error | loss zero-abl "
                "| loss mean-abl | CE recovered | KL(clean‖SAE) |")
        lines = [head, "|" + "---|" * (head.count("|") - 1)]

        def f(v, fmt=".3f"):
            return "-" if v is None else format(v, fmt)

        for n, e in sorted(self.layers.items()):
            lines.append(f"| {n} | {f(e.fve)} | {f(e.l0, '.1f')} | {f(e.dead_fraction)} | {f(e.dense_fraction)} | "
                         f"{f(e.loss_clean)} | {f(e.loss.get('sae'))} | {f(e.loss.get('sae+error'))} | "
                         f"{f(e.loss.get('zero'))} | {f(e.loss.get('mean'))} | {f(e.ce_recovered)} | "
                         f"{f(e.kl.get('sae'), '.4f')} |")
        return "\n".join(lines)

    def figure(self):
        """Plotly figure, metric by layer: FVE and CE recovered, L0, KL(clean || SAE), and the four losses."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        layers = sorted(self.layers)
        rows = [self.layers[n] for n in layers]
        fig = make_subplots(rows=2, cols=2, subplot_titles=("FVE and CE loss recovered", "L0",
                                                            "KL(clean || SAE spliced), nats/token",
                                                            "next-token loss, nats"))
        fig.add_trace(go.Scatter(x=layers, y=[e.fve for e in rows], name="FVE", mode="lines+markers"), 1, 1)
        fig.add_trace(go.Scatter(x=layers, y=[e.ce_recovered for e in rows], name="CE recovered",
                                 mode="lines+markers"), 1, 1)
        fig.add_trace(go.Bar(x=layers, y=[e.l0 for e in rows], name="L0"), 1, 2)
        fig.add_trace(go.Scatter(x=layers, y=[e.kl.get("sae") for e in rows], name="KL", mode="lines+markers"), 2, 1)
        fig.add_trace(go.Scatter(x=layers, y=[e.loss_clean for e in rows], name="clean", mode="lines"), 2, 2)
        for mode in ("sae", "sae+error", "zero", "mean"):
            if mode in rows[0].loss:
                fig.add_trace(go.Scatter(x=layers, y=[e.loss[mode] for e in rows], name=f"{mode} spliced",
                                         mode="lines+markers"), 2, 2)
        title = f"SAE evaluation: {self.meta.get('release') or 'SAEs'} on {self.meta.get('model') or 'the model'}"
        fig.update_layout(title=title, height=620)
        fig.update_xaxes(title_text="layer", dtick=1)
        return fig
