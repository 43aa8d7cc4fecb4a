"""``FeatureCard``: everything known about one feature, assembled from the database and the weights, with its
tokens decoded — the object notebooks display (``_repr_html_``), pages render and the JSON export serialises.

    card = feature_card(db, 123, scope=scope, layer=3)
    card                      # in Jupyter: the card
    card.histogram_figure()   # plotly
    card.to_json()            # Neuronpedia-like dict
"""
from __future__ import annotations

from dataclasses import dataclass, field

from qwen_scope.explore.database import Cooccurrence, Example, FeatureDatabase, QuantileBin
from qwen_scope.explore.views import FeatureView, feature_views, make_decoder, vocab_limit


@dataclass(frozen=True)
class DecodedExample:
    """An :class:`Example` with its tokens as display strings (``strings[mark]`` is the activating token)."""

    example: Example
    strings: tuple[str, ...]

    @property
    def value(self) -> float:
        return self.example.value

    @property
    def mark(self) -> int:
        return self.example.mark


@dataclass(frozen=True, repr=False)
class FeatureCard:
    """One feature: statistics, examples, histogram, co-occurrence, weight views, label and notes.

    Attributes:
        feature: feature id. meta: the database's provenance (model, point, layer, release).
        label, notes: the user's annotations. density, count, max, mean: statistics over the database's tokens.
        top: top-activating examples. bins: ``[(QuantileBin, [DecodedExample])]`` lowest first.
        hist_edges, hist_counts: activation histogram on the log grid. cooccurring: ``[Cooccurrence]`` (maybe empty).
        view: logit lens / nearest features / decoder norm (None without weights).
        logit_top, logit_bottom: decoded ``(token, logit)`` pairs of the logit lens.
        explanation: the automatic explanation ``{"text", "detection_auroc", "explainer"}`` or None.
    """

    feature: int
    meta: dict
    label: str
    notes: str
    density: float
    count: int
    max: float
    mean: float
    n_tokens: int
    top: tuple[DecodedExample, ...]
    bins: tuple[tuple[QuantileBin, tuple[DecodedExample, ...]], ...]
    hist_edges: tuple[float, ...]
    hist_counts: tuple[int, ...]
    cooccurring: tuple[Cooccurrence, ...]
    view: FeatureView | None = None
    logit_top: tuple[tuple[str, float], ...] = field(default=())
    logit_bottom: tuple[tuple[str, float], ...] = field(default=())
    explanation: dict | None = None

    def __repr__(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        best = "".join(self.top[0].strings) if self.top else ""
        return (f"FeatureCard(#{self.feature}{label}: density {self.density:.3%}, max {self.max:.3f}, "
                f"{len(self.top)} top examples, best {best!r})")

    def _repr_html_(self) -> str:
        from qwen_scope.explore.html import feature_card_html

        return feature_card_html(self)

    def to_json(self, **kwargs) -> dict:
        """Neuronpedia-like dict; see :func:`qwen_scope.explore.export.feature_json`."""
        from qwen_scope.explore.export import feature_json

        return feature_json(self, **kwargs)

    def histogram_figure(self):
        """Plotly activation histogram (log-spaced bins)."""
        from qwen_scope.explore.figures import histogram_figure

        return histogram_figure(self)

    def logits_figure(self):
        """Plotly bar chart of the logit lens (top and bottom tokens)."""
        from qwen_scope.explore.figures import logit_lens_figure

        return logit_lens_figure(self)


def feature_card(db: FeatureDatabase, feature: int, *, scope=None, model=None, sae=None, decode=None,
                 view: FeatureView | None = None, n_cooccurring: int = 10) -> FeatureCard:
    """Assemble the card of ``feature``.

    Args:
        db: the feature database.
        feature: feature id.
        scope: a ``Scope`` (gives model, tokenizer and, with ``db.meta["layer"]``, the SAE).
        model, sae: the model and SAE, when not given through ``scope``; without them the card has no logit lens
            or nearest features.
        decode: token decoder (``make_decoder`` input); default from ``scope`` or ⟨id⟩ placeholders.
        view: a precomputed :class:`FeatureView` (saves recomputing the lens for many cards).
        n_cooccurring: co-occurring features listed (if the database tracked them).
    Returns:
        the :class:`FeatureCard`.
    """
    feature = db._check(feature)
    decode = make_decoder(decode if decode is not None else scope)
    if view is None:
        model, sae = _weights(db, scope, model, sae)
        if sae is not None:
            vocab = vocab_limit(scope) if scope is not None else None
            view = feature_views(model, sae, [feature], vocab=vocab)[feature]

    def decoded(examples) -> tuple[DecodedExample, ...]:
        return tuple(DecodedExample(e, tuple(decode(e.tokens))) for e in examples)

    tracked = bool((db.tracked == feature).any())
    edges, counts = db.histogram(feature)
    logit_top = logit_bottom = ()
    if view is not None and view.logits is not None:
        lens = view.logits
        logit_top = tuple(zip(decode(lens.top_ids), lens.top_values))
        logit_bottom = tuple(zip(decode(lens.bottom_ids), lens.bottom_values))
    return FeatureCard(
        feature=feature, meta=dict(db.meta), label=db.label(feature), notes=db.notes(feature),
        density=float(db.density[feature]), count=int(db.count[feature]), max=float(db.act_max[feature]),
        mean=float(db.mean_activation[feature]), n_tokens=db.n_tokens, top=decoded(db.top_examples(feature)),
        bins=tuple((b, decoded(b.examples)) for b in db.quantile_bins(feature)),
        hist_edges=tuple(edges.tolist()), hist_counts=tuple(counts.tolist()),
        cooccurring=tuple(db.cooccurring(feature, n_cooccurring)) if tracked else (),
        view=view, logit_top=logit_top, logit_bottom=logit_bottom, explanation=db.explanation(feature))


def _weights(db: FeatureDatabase, scope, model, sae):
    """(model, sae) from explicit arguments or from ``scope`` at the database's layer."""
    if scope is not None:
        model = model if model is not None else scope.model
        layer = db.meta.get("layer")
        if sae is None and layer is not None and int(layer) in getattr(scope, "saes", {}):
            sae = scope.sae(int(layer))
    return model, sae
