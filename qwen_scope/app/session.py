"""``AppSession``: the explorer's state (a ``Scope``, an optional feature database and evaluation) and its answers
to every interaction, as plain data — the browser app and the Jupyter widget only display what these return.

    session = AppSession(nano_scope([3]))
    view = session.analyze("def close(self):")       # tokens, the top feature per token, the per-token table
    session.token_features(4)                          # the features of token 4
    session.card(view.features[4])                     # its card: from the database when given, else this prompt
    session.compare("def f(x):", "The cat sat.")       # activation-rate difference, figure

The steering bench (``AppSession.stream_steer``, ``sweep``) lives in ``qwen_scope/app/bench.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qwen_scope.app.bench import SteeringBench
from qwen_scope.explore.builder import Chunk, build_feature_database
from qwen_scope.explore.card import FeatureCard, feature_card
from qwen_scope.explore.database import FeatureDatabase

__all__ = ["AppSession", "FeatureRow", "PromptView"]

# Context kept around each activating token of the live (one-prompt) database behind a card.
_LIVE_CONTEXT = (8, 4)


@dataclass(frozen=True)
class FeatureRow:
    """One feature in a list: its id, the value that ranks it here, its label (database label or explanation)."""

    feature: int
    value: float
    label: str = ""


@dataclass(frozen=True)
class PromptView:
    """A prompt's tokens coloured by one feature, or each by its own top feature.

    Attributes:
        text: the prompt. layer: the SAE layer read. coloured_by: the feature colouring every token, or None
            (each token coloured by its own top feature).
        tokens: display string per token [T]. features: the colouring feature per token [T] (-1: none active).
        values: its activation per token [T]. scale: the activation drawn at full colour.
        table: per token the top features ``[(feature, value), ...]`` (at most ``n`` each).
    """

    text: str
    layer: int
    coloured_by: int | None
    tokens: tuple[str, ...]
    features: tuple[int, ...]
    values: tuple[float, ...]
    scale: float
    table: tuple[tuple[tuple[int, float], ...], ...]


class AppSession:
    """What the explorer knows and computes; one per app or widget.

    Args:
        scope: a ``Scope`` with SAEs attached.
        db: a ``FeatureDatabase`` (its ``meta["layer"]`` names the layer it describes) or its directory.
        evaluation: an ``SAEEvaluation``, its ``sae_eval.json`` or the directory holding it (the evaluation tab).
        layer: the layer shown first (default: the database's layer, else the middle loaded layer).
        template: chat template every prompt is wrapped in (see ``Scope.tokenize``; default raw text).

    Raises:
        ValueError: the scope has no SAE, or the database's width differs from the SAE at its layer.
    """

    def __init__(self, scope, db: FeatureDatabase | str | Path | None = None, *, evaluation=None,
                 layer: int | None = None, template: str | None = None):
        if not scope.layers:
            raise ValueError("the scope has no SAE attached; load one with scope.load_saes(release, layers) "
                             "before starting the explorer")
        self.scope = scope
        self.db = FeatureDatabase.load(db) if isinstance(db, (str, Path)) else db
        self.db_layer = None
        if self.db is not None:
            self.db_layer = int(self.db.meta.get("layer", scope.layers[0] if len(scope.layers) == 1 else -1))
            if self.db_layer not in scope.saes:
                raise ValueError(f"the feature database describes layer {self.db.meta.get('layer')!r} but SAEs are "
                                 f"loaded at layers {scope.layers}; load that layer's SAE (--layers) too")
            if self.db.d_sae != scope.sae(self.db_layer).d_sae:
                raise ValueError(f"the feature database has d_sae {self.db.d_sae} but the layer-{self.db_layer} "
                                 f"SAE has {scope.sae(self.db_layer).d_sae}; pass the database of this SAE")
        self.evaluation = _load_evaluation(evaluation)
        self.template = template
        self.layer = self._layer(layer if layer is not None else
                                 self.db_layer if self.db_layer is not None else scope.layers[len(scope.layers) // 2])
        self.bench = SteeringBench(scope, self.label)
        self._feats = None
        self._live: dict[int, FeatureDatabase] = {}

    # ------------------------------------------------------------------ the prompt view
    def analyze(self, text: str, layer: int | None = None, feature: int | None = None, *, n: int = 5) -> PromptView:
        """Read the SAE features of ``text`` (every loaded layer, one forward) and colour the tokens at ``layer``.

        Args:
            text: the prompt.
            layer: the SAE layer shown (default: the current one; it becomes the current one).
            feature: colour every token by this feature (default: each token by its top feature).
            n: top features per token in the table.
        Returns:
            the :class:`PromptView`.
        """
        if not text:
            raise ValueError("the prompt is empty; type a text to read its features")
        self.layer = self._layer(layer if layer is not None else self.layer)
        if self._feats is None or self._feats.text != text:
            self._feats = self.scope.features(text, template=self.template)
            self._live = {}
        return self.view(feature, n=n)

    def view(self, feature: int | None = None, *, n: int = 5) -> PromptView:
        """The last analysed prompt at the current layer, coloured by ``feature`` or by each token's top feature."""
        feats = self._require_prompt()
        lf = feats[self.layer]
        table = tuple(tuple(feats.token_top(self.layer, t, n)) for t in range(len(feats.tokens)))
        if feature is None:
            top = [row[0] if row else (-1, 0.0) for row in table]
            ids, values = tuple(f for f, _ in top), tuple(v for _, v in top)
        else:
            feature = self._feature(feature, self.layer)
            values = tuple(lf.dense()[:, feature].tolist())
            ids = tuple(feature if v > 0 else -1 for v in values)
        stats = values[lf.first:] or values
        scale = max(max(stats), 0.0)
        return PromptView(feats.text, self.layer, feature, tuple(feats.tokens), ids, values, scale, table)

    def token_features(self, position: int) -> list[FeatureRow]:
        """Every active feature of the token at ``position`` of the last prompt, strongest first, labelled."""
        feats = self._require_prompt()
        T = len(feats.tokens)
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < T:
            raise ValueError(f"token position must be an int in 0..{T - 1} (the prompt has {T} tokens), "
                             f"got {position!r}")
        return [FeatureRow(f, v, self.label(f, self.layer)) for f, v in feats.token_top(self.layer, position)]

    # ------------------------------------------------------------------ cards and search
    def card(self, feature: int, layer: int | None = None) -> FeatureCard:
        """The card of ``feature``: from the feature database when it describes ``layer``, else computed live from
        the last prompt (its activations there, the logit lens and nearest features from the weights)."""
        layer = self._layer(layer if layer is not None else self.layer)
        feature = self._feature(feature, layer)
        if self.db is not None and layer == self.db_layer:
            return feature_card(self.db, feature, scope=self.scope)
        return feature_card(self._live_database(layer), feature, scope=self.scope)

    def label(self, feature: int, layer: int | None = None) -> str:
        """The database's label of ``feature`` (else its automatic explanation), or "" without one."""
        if self.db is None or (layer if layer is not None else self.layer) != self.db_layer:
            return ""
        explanation = self.db.explanation(feature)
        return self.db.label(feature) or (explanation["text"] if explanation else "")

    def search(self, query: str, n: int = 20) -> list[FeatureRow]:
        """Features whose id, label, notes, explanation or top token match ``query`` (the database's layer); without
        a database only a feature id matches. Values are the features' max activations in the database (or 0)."""
        query = query.strip()
        if self.db is None:
            d_sae = self.scope.sae(self.layer).d_sae
            return [FeatureRow(int(query), 0.0)] if query.isdigit() and int(query) < d_sae else []
        decode = lambda i: self.scope.decode_tokens([i])[0]  # noqa: E731
        return [FeatureRow(f, float(self.db.act_max[f]), self.label(f, self.db_layer))
                for f in self.db.search(query, decode)[:n]]

    # ------------------------------------------------------------------ compare and evaluation
    def compare(self, text_a: str, text_b: str, layer: int | None = None, *, n: int = 15):
        """Features ranked by activation-rate difference between two texts at ``layer``.

        Returns:
            ``(rows, figure)``: ``[(FeatureDiff, label)]`` and the plotly comparison figure.
        """
        from qwen_scope.explore.figures import comparison_figure

        if not text_a or not text_b:
            raise ValueError("compare needs two non-empty texts (text A and text B)")
        layer = self._layer(layer if layer is not None else self.layer)
        cmp = self.scope.compare(text_a, text_b, [layer], template=self.template)
        diffs = cmp[layer].ranked(n)
        labels = {d.feature: self.label(d.feature, layer) for d in diffs}
        fig = comparison_figure(cmp, layer, n=n, labels={f: s for f, s in labels.items() if s})
        return [(d, labels[d.feature]) for d in diffs], fig

    def evaluation_table(self) -> str | None:
        """The release's SAE evaluation as a markdown table, or None when the session has none."""
        return None if self.evaluation is None else self.evaluation.table()

    # ------------------------------------------------------------------ checks and the live database
    def _layer(self, layer: int) -> int:
        if layer not in self.scope.saes:
            raise ValueError(f"layer {layer!r} has no SAE; SAEs are loaded at layers {self.scope.layers}")
        return int(layer)

    def _feature(self, feature: int, layer: int) -> int:
        d_sae = self.scope.sae(layer).d_sae
        if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < d_sae:
            raise ValueError(f"feature must be an int in 0..{d_sae - 1} (the layer-{layer} SAE's width), "
                             f"got {feature!r}")
        return feature

    def _require_prompt(self):
        if self._feats is None:
            raise ValueError("no prompt analysed yet; call analyze(text) first")
        return self._feats

    def _live_database(self, layer: int) -> FeatureDatabase:
        """A feature database of the last prompt alone at ``layer`` (cached until the prompt changes)."""
        if layer not in self._live:
            feats = self._require_prompt()
            lf = feats[layer]
            T = len(feats.tokens)
            chunk = Chunk(feats.token_ids, torch.zeros(T, dtype=torch.long), torch.arange(T),
                          (lf.values, lf.indices), 0)
            meta = {"model": self.scope.model_name or "", "point": self.scope.hook_name(layer), "layer": layer,
                    "source": "this prompt"}
            self._live[layer] = build_feature_database([chunk], lf.d_sae, meta=meta, n_top=5, n_bins=2, per_bin=2,
                                                       context=_LIVE_CONTEXT, cooccurrence="none",
                                                       exclude_position_0=feats.skip_first and T > 1)
        return self._live[layer]


def _load_evaluation(evaluation):
    from qwen_scope.evals import SAEEvaluation

    if evaluation is None or isinstance(evaluation, SAEEvaluation):
        return evaluation
    path = Path(evaluation)
    target = path / "sae_eval.json" if path.is_dir() else path
    if not target.is_file():
        raise FileNotFoundError(f"no SAE evaluation at {target}; write one with `qwen-scope eval sae --out DIR` "
                                "and pass DIR or its sae_eval.json")
    return SAEEvaluation.load(target)
