"""Compare two texts (or two sets of texts) over a range of layers: features ranked by activation-rate difference.

This is the official Qwen-Scope demo's "Feature Comparison" view: at each layer, the rate of a feature is the
fraction of kept token positions where its SAE code is > 0, and features are ranked by |rate_a - rate_b|.
Options as in the demo: skip position 0, drop the common token prefix, drop tokens that occur in both, or use raw
pre-activations (``W_enc x + b_enc``, negatives kept) instead of TopK codes.

    cmp = scope.compare("I love this film.", "I hate this film.", layers=range(10, 14))
    print(cmp.table(n=10))
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from hooks import capture_forward
from saes import TopKSAE

__all__ = ["FeatureDiff", "LayerComparison", "Comparison", "compare"]


@dataclass(frozen=True)
class FeatureDiff:
    """One feature's activation rates (fraction of positions active) and mean activations in both texts."""

    feature: int
    rate_a: float
    rate_b: float
    mean_a: float
    mean_b: float

    @property
    def diff(self) -> float:
        """rate_a - rate_b (positive: more frequent in text a)."""
        return self.rate_a - self.rate_b


@dataclass(frozen=True)
class LayerComparison:
    """Per-feature statistics of both sides at one layer.

    Attributes:
        layer: SAE layer. n_a, n_b: positions kept on each side.
        rate_a, rate_b, mean_a, mean_b: [d_sae] float32 activation rates and mean activations.
    """

    layer: int
    n_a: int
    n_b: int
    rate_a: torch.Tensor = field(repr=False)
    rate_b: torch.Tensor = field(repr=False)
    mean_a: torch.Tensor = field(repr=False)
    mean_b: torch.Tensor = field(repr=False)

    def ranked(self, n: int = 20, side: str = "both") -> list[FeatureDiff]:
        """Top ``n`` features by |rate_a - rate_b| (ties broken by |mean_a - mean_b|).

        Args:
            n: how many.
            side: ``"both"``, ``"a"`` (more frequent in a) or ``"b"`` (more frequent in b).
        """
        diff = self.rate_a - self.rate_b
        if side == "both":
            key = diff.abs()
        elif side in ("a", "b"):
            key = diff if side == "a" else -diff
        else:
            raise ValueError(f"side must be 'both', 'a' or 'b', got {side!r}")
        tie = (self.mean_a - self.mean_b).abs()
        candidates = torch.nonzero((self.rate_a > 0) | (self.rate_b > 0)).flatten()
        # Lexicographic order by two stable sorts: the rate key first, |mean difference| among equal rates.
        order = candidates[torch.sort(-tie[candidates], stable=True).indices]
        order = order[torch.sort(-key[order], stable=True).indices][:n]
        return [FeatureDiff(int(i), float(self.rate_a[i]), float(self.rate_b[i]), float(self.mean_a[i]),
                            float(self.mean_b[i])) for i in order]


@dataclass(frozen=True)
class Comparison:
    """Result of ``compare``: ``cmp[layer]`` is a ``LayerComparison``."""

    texts_a: tuple[str, ...]
    texts_b: tuple[str, ...]
    layers: dict[int, LayerComparison]
    raw: bool

    def __getitem__(self, layer: int) -> LayerComparison:
        if layer not in self.layers:
            raise KeyError(f"no comparison at layer {layer}; compared layers are {sorted(self.layers)}")
        return self.layers[layer]

    def table(self, n: int = 10) -> str:
        """Plain-text ranking per layer."""
        lines = []
        for layer, lc in sorted(self.layers.items()):
            lines.append(f"layer {layer} ({lc.n_a} vs {lc.n_b} positions{', raw pre-activations' if self.raw else ''})")
            lines.append(f"  {'feature':>8} {'rate_a':>7} {'rate_b':>7} {'diff':>7} {'mean_a':>8} {'mean_b':>8}")
            for d in lc.ranked(n):
                lines.append(f"  {d.feature:>8} {d.rate_a:>7.3f} {d.rate_b:>7.3f} {d.diff:>+7.3f} {d.mean_a:>8.3f} "
                             f"{d.mean_b:>8.3f}")
        return "\n".join(lines)


def _side_stats(sae: TopKSAE, resid: torch.Tensor, raw: bool, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of (activation > 0) and sum of activations per feature over the rows of ``resid`` [N, d_model]."""
    active = torch.zeros(sae.d_sae, dtype=torch.float64)
    total = torch.zeros(sae.d_sae, dtype=torch.float64)
    for start in range(0, resid.shape[0], chunk):
        x = resid[start : start + chunk].to(sae.device).float()
        if raw:
            pre = sae.pre_acts(x).double().cpu()
            active += (pre > 0).sum(0)
            total += pre.sum(0)
        else:
            codes = sae.encode_sparse(x)
            values, indices = codes.values.double().cpu().flatten(), codes.indices.cpu().flatten()
            on = values > 0
            active.index_add_(0, indices[on], torch.ones(int(on.sum()), dtype=torch.float64))
            total.index_add_(0, indices[on], values[on])
    return active, total


def _common_prefix(seqs: Sequence[list[int]]) -> int:
    n = 0
    for column in zip(*seqs):
        if len(set(column)) != 1:
            break
        n += 1
    return n


def compare(scope, text_a: str | Sequence[str], text_b: str | Sequence[str],
            layers: int | Iterable[int] | None = None, *, skip_first: bool = True, remove_common_prefix: bool = False,
            remove_common_tokens: bool = False, raw: bool = False, template: str | None = None) -> Comparison:
    """Rank SAE features by how much more often they fire in ``text_a`` than in ``text_b``, layer by layer.

    Args:
        scope: a ``Scope`` with SAEs at ``layers``.
        text_a, text_b: a text each, or a list of texts each (rates are pooled over all their positions).
        layers: SAE layers, e.g. ``range(10, 14)`` (default: every loaded SAE layer).
        skip_first: leave position 0 of every text out.
        remove_common_prefix: leave out the token prefix shared by all texts (e.g. a shared instruction).
        remove_common_tokens: leave out positions whose token id occurs on the other side too.
        raw: use raw pre-activations (rate = fraction > 0) instead of TopK codes.
        template: chat template, see ``Scope.tokenize``.

    Returns:
        ``Comparison``; ``cmp[layer].ranked(n)`` lists ``FeatureDiff``s, ``cmp.table()`` renders all layers.

    Example:
        >>> cmp = compare(scope, "The weather is lovely", "Il fait beau", layers=[12])
        >>> cmp[12].ranked(5, side="b")    # features of the French text
    """
    texts_a = (text_a,) if isinstance(text_a, str) else tuple(text_a)
    texts_b = (text_b,) if isinstance(text_b, str) else tuple(text_b)
    if not texts_a or not texts_b:
        raise ValueError("compare needs at least one text on each side")
    layer_list = scope.layers if layers is None else ([layers] if isinstance(layers, int) else list(layers))
    if not layer_list:
        raise ValueError("no layers to compare: attach SAEs first (Scope.load_saes) or pass layers=")
    saes = {n: scope.sae(n) for n in layer_list}
    ids_a = [scope.tokenize(t, template)[0] for t in texts_a]
    ids_b = [scope.tokenize(t, template)[0] for t in texts_b]
    prefix = _common_prefix([i.tolist() for i in ids_a + ids_b]) if remove_common_prefix else 0
    vocab_a = set(torch.cat(ids_a).tolist())
    vocab_b = set(torch.cat(ids_b).tolist())

    def kept(ids: torch.Tensor, other_vocab: set[int]) -> torch.Tensor:
        keep = torch.ones(len(ids), dtype=torch.bool)
        keep[: max(prefix, 1 if skip_first else 0)] = False
        if remove_common_tokens:
            keep &= torch.tensor([t not in other_vocab for t in ids.tolist()], dtype=torch.bool)
        return keep

    points = [scope.hook_name(n) for n in layer_list]
    sums = {n: {"a": [0, 0.0, 0.0], "b": [0, 0.0, 0.0]} for n in layer_list}
    for side, id_list, other in (("a", ids_a, vocab_b), ("b", ids_b, vocab_a)):
        for ids in id_list:
            keep = kept(ids.cpu(), other)
            if not keep.any():
                continue
            cap = capture_forward(scope.model, points, input_ids=ids[None])
            with torch.no_grad():
                for n in layer_list:
                    active, total = _side_stats(saes[n], cap[scope.hook_name(n)][0][keep.to(ids.device)], raw)
                    acc = sums[n][side]
                    acc[0] += int(keep.sum())
                    acc[1] = acc[1] + active
                    acc[2] = acc[2] + total
    out = {}
    for n in layer_list:
        (na, act_a, tot_a), (nb, act_b, tot_b) = sums[n]["a"], sums[n]["b"]
        if na == 0 or nb == 0:
            raise ValueError(f"no positions left on side {'a' if na == 0 else 'b'} after skip_first / "
                             f"remove_common_prefix / remove_common_tokens; relax those options or use longer texts")
        out[n] = LayerComparison(n, na, nb, (act_a / na).float(), (act_b / nb).float(), (tot_a / na).float(),
                                 (tot_b / nb).float())
    return Comparison(texts_a, texts_b, out, raw)
