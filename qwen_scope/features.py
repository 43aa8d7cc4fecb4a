"""SAE features of one text: per token and per layer the top features (sparse), a dense view on request,
aggregated statistics that skip position 0 by default, and how well the SAE reconstructs the text (FVE, cosine).

    feats = scope.features("The Eiffel Tower is in Paris", layers=[12])
    feats.token_top(12, position=5)       # [(feature, value), ...] at token 5
    feats.top(12, n=10, by="mean")        # features of the whole text, position 0 left out
    feats[12].fve, feats[12].cosine       # reconstruction quality on this text
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hooks import capture_forward
from saes import SparseCodes, TopKSAE

__all__ = ["FeatureStat", "LayerFeatures", "TextFeatures", "text_features", "encode_layer"]


@dataclass(frozen=True)
class FeatureStat:
    """One feature aggregated over the statistics positions of a text.

    Attributes:
        feature: feature id. max / mean: largest and mean activation (mean counts inactive positions as 0).
        rate: fraction of positions where it is active (> 0). count: number of such positions.
    """

    feature: int
    max: float
    mean: float
    rate: float
    count: int


@dataclass(frozen=True)
class LayerFeatures:
    """SAE codes of every token of a text at one layer.

    Attributes:
        layer: decoder block whose output (``resid_post.<layer>``) the SAE read.
        values: [T, k] float32, top activations per token, sorted descending (0 = padding slot).
        indices: [T, k] int64 feature ids.
        cosine_per_token: [T] cosine between the residual and its reconstruction.
        fve: fraction of variance explained over the statistics positions.
        cosine: mean of ``cosine_per_token`` over the statistics positions.
        first: first statistics position (1 when position 0 is excluded, else 0).
        d_sae: SAE width.
        dense_codes: [T, d_sae] float32 when asked for (``dense=True``), else None; see ``dense()``.
    """

    layer: int
    values: torch.Tensor
    indices: torch.Tensor
    cosine_per_token: torch.Tensor
    fve: float
    cosine: float
    first: int
    d_sae: int
    dense_codes: torch.Tensor | None = field(default=None, repr=False)

    def dense(self) -> torch.Tensor:
        """[T, d_sae] float32 codes (built from the sparse ones when not stored)."""
        if self.dense_codes is not None:
            return self.dense_codes
        return SparseCodes(self.values, self.indices).to_dense(self.d_sae)

    def stats(self, include_first: bool | None = None) -> list[FeatureStat]:
        """Every feature active somewhere in the statistics positions, unsorted.

        Args:
            include_first: True counts position 0, False leaves it out (unless it is the only token), None
                (default) follows ``first``.
        """
        if include_first is None:
            start = self.first
        else:
            start = 0 if include_first or self.values.shape[0] < 2 else 1
        values, indices = self.values[start:], self.indices[start:]
        n_pos = values.shape[0]
        active = values > 0
        if n_pos == 0 or not active.any():
            return []
        ids, inverse = torch.unique(indices[active], return_inverse=True)
        vals = values[active]
        count = torch.zeros(len(ids), dtype=torch.long).index_add_(0, inverse, torch.ones_like(inverse))
        total = torch.zeros(len(ids)).index_add_(0, inverse, vals)
        peak = torch.zeros(len(ids)).scatter_reduce_(0, inverse, vals, "amax", include_self=False)
        return [FeatureStat(int(f), float(m), float(s) / n_pos, int(c) / n_pos, int(c))
                for f, m, s, c in zip(ids, peak, total, count)]


@dataclass(frozen=True)
class TextFeatures:
    """Features of one text at several layers.

    Attributes:
        text: the input text. token_ids: [T] int64. tokens: display string per token.
        layers: ``{layer: LayerFeatures}``. skip_first: whether statistics leave position 0 out.
    """

    text: str
    token_ids: torch.Tensor
    tokens: list[str]
    layers: dict[int, LayerFeatures]
    skip_first: bool

    def __getitem__(self, layer: int) -> LayerFeatures:
        if layer not in self.layers:
            raise KeyError(f"no features for layer {layer}; computed layers are {sorted(self.layers)}")
        return self.layers[layer]

    def token_top(self, layer: int, position: int, n: int | None = None) -> list[tuple[int, float]]:
        """Top ``n`` (default all k) active features at token ``position`` as ``(feature, value)``."""
        lf = self[layer]
        vals, ids = lf.values[position], lf.indices[position]
        keep = vals > 0
        pairs = list(zip(ids[keep].tolist(), vals[keep].tolist()))
        return pairs[:n] if n is not None else pairs

    def top(self, layer: int, n: int = 10, by: str = "max", include_first: bool | None = None) -> list[FeatureStat]:
        """The ``n`` strongest features of the whole text at ``layer``.

        Args:
            layer: SAE layer.
            n: how many.
            by: ``"max"``, ``"mean"``, ``"rate"`` (fraction of positions active) or ``"count"``.
            include_first: count position 0 too (default: the opposite of ``skip_first``).
        """
        if by not in ("max", "mean", "rate", "count"):
            raise ValueError(f"by must be 'max', 'mean', 'rate' or 'count', got {by!r}")
        include = (not self.skip_first) if include_first is None else include_first
        stats = self[layer].stats(include_first=include)
        return sorted(stats, key=lambda s: (-getattr(s, by), -s.max, s.feature))[:n]

    def table(self, layer: int, n: int = 5) -> str:
        """A plain-text view: one line per token with its top ``n`` features."""
        lines = [f"layer {layer}: FVE {self[layer].fve:.3f}, cosine {self[layer].cosine:.3f}"
                 + (" (position 0 excluded)" if self[layer].first else "")]
        for t, tok in enumerate(self.tokens):
            feats = "  ".join(f"#{f}={v:.2f}" for f, v in self.token_top(layer, t, n))
            lines.append(f"{t:>4} {tok!r:<14} {feats}")
        return "\n".join(lines)


def encode_layer(sae: TopKSAE, resid: torch.Tensor, layer: int, *, top_k: int | None = None, dense: bool = False,
                 skip_first: bool = True) -> LayerFeatures:
    """Encode one text's residual [T, d_model] with ``sae`` and measure the reconstruction.

    Args:
        sae: the SAE of ``layer``.
        resid: [T, d_model] residual (``resid_post.<layer>``) of one text.
        layer: its layer, for bookkeeping.
        top_k: features kept per token (default ``sae.k``: every active one).
        dense: also store the [T, d_sae] codes.
        skip_first: leave position 0 out of FVE / cosine (when the text has more than one token).

    Returns:
        ``LayerFeatures`` on the CPU in float32.
    """
    if top_k is not None and int(top_k) < 0:
        raise ValueError(f"top_k must be >= 0 features per token (or None for all {sae.k}), got {top_k}")
    x = resid.float()
    codes = sae.encode_sparse(x)
    recon = sae.decode(codes).float()
    first = 1 if skip_first and x.shape[0] > 1 else 0
    xs, rs = x[first:], recon[first:]
    err = (xs - rs).pow(2).sum()
    var = (xs - xs.mean(0, keepdim=True)).pow(2).sum()
    fve = float(1 - err / var) if var > 0 else float("nan")
    cos = torch.nn.functional.cosine_similarity(x, recon, dim=-1)
    k = sae.k if top_k is None else min(int(top_k), sae.k)
    values, indices = codes.values[..., :k].float().cpu(), codes.indices[..., :k].cpu()
    dense_codes = SparseCodes(codes.values.float(), codes.indices).to_dense(sae.d_sae).cpu() if dense else None
    return LayerFeatures(layer, values, indices, cos.cpu(), fve, float(cos[first:].mean()), first, sae.d_sae,
                         dense_codes)


def text_features(scope, text: str, layers: int | Iterable[int] | None = None, *, top_k: int | None = None,
                  dense: bool = False, skip_first: bool = True, template: str | None = None) -> TextFeatures:
    """SAE features of ``text`` at ``layers`` from one forward pass that stops after the deepest layer.

    Args:
        scope: a ``Scope`` with SAEs at ``layers``.
        text: the text.
        layers: SAE layers (default: every layer with an SAE attached).
        top_k: features kept per token (default: the SAE's k).
        dense: also keep [T, d_sae] codes.
        skip_first: exclude position 0 (Qwen's attention-sink token, whose residual is an outlier) from
            statistics; its codes are still in ``values``/``indices``.
        template: chat template, see ``Scope.tokenize``.

    Returns:
        ``TextFeatures``.

    Example:
        >>> feats = text_features(scope, "Paris is the capital of France", layers=[12])
        >>> [s.feature for s in feats.top(12, n=5)]
    """
    layer_list = scope.layers if layers is None else ([layers] if isinstance(layers, int) else list(layers))
    if not layer_list:
        raise ValueError("no layers to read: attach SAEs first (Scope.load_saes) or pass layers=")
    saes = {n: scope.sae(n) for n in layer_list}
    ids = scope.tokenize(text, template)
    cap = capture_forward(scope.model, [scope.hook_name(n) for n in layer_list], input_ids=ids)
    per_layer = {}
    with torch.no_grad():
        for n in layer_list:
            resid = cap[scope.hook_name(n)][0].to(saes[n].device)
            per_layer[n] = encode_layer(saes[n], resid, n, top_k=top_k, dense=dense, skip_first=skip_first)
    token_ids = ids[0].cpu()
    return TextFeatures(text, token_ids, scope.decode_tokens(token_ids), per_layer, skip_first)
