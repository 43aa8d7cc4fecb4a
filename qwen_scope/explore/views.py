"""Per-feature views computed from the weights: logit lens of the decoder direction, nearest features by decoder
cosine, decoder norm — plus the token decoder the cards and pages use.

Logit lens (as Neuronpedia's positive/negative logits): ``logits = unembed(final_norm(W_dec[:, f]))``, i.e. the
decoder direction passed through the model's final RMSNorm and ``lm_head`` as if it were the last residual.

    views = feature_views(scope.model, scope.sae(3), [12, 40], top=10)
    views[12].logits.top_tokens(scope.decode_tokens)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from hooks import get_adapter

# Display strings of token ids: ``decode(ids) -> list[str]``.
Decoder = Callable[[Sequence[int]], list[str]]


def make_decoder(source=None) -> Decoder:
    """A token decoder from a ``Scope``, a tokenizer, a callable ``ids -> list[str]``, or None (``⟨id⟩``).

    Args:
        source: anything with ``decode_tokens`` (a Scope), anything with ``decode`` (a tokenizer), a callable,
            or None.
    Returns:
        ``decode(ids: Sequence[int]) -> list[str]``, one display string per id (cached per id).
    """
    if source is None:
        return lambda ids: [f"⟨{int(i)}⟩" for i in ids]
    if hasattr(source, "decode_tokens"):
        one = lambda i: source.decode_tokens([i])[0]  # noqa: E731
    elif hasattr(source, "decode"):
        one = lambda i: source.decode([i])  # noqa: E731
    elif callable(source):
        return source
    else:
        raise TypeError(f"make_decoder expects a Scope, a tokenizer, a callable or None, got {type(source).__name__}")
    cache: dict[int, str] = {}

    def decode(ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            i = int(i)
            if i not in cache:
                cache[i] = one(i)
            out.append(cache[i])
        return out

    return decode


@dataclass(frozen=True)
class LogitLens:
    """Top and bottom tokens of one direction through the final norm and unembedding.

    Attributes:
        top_ids, top_values: the ``n`` largest logits (descending). bottom_ids, bottom_values: the ``n`` smallest
        (ascending). hist_edges, hist_counts: histogram of all vocabulary logits (50 bins).
    """

    top_ids: tuple[int, ...]
    top_values: tuple[float, ...]
    bottom_ids: tuple[int, ...]
    bottom_values: tuple[float, ...]
    hist_edges: tuple[float, ...]
    hist_counts: tuple[int, ...]

    def top_tokens(self, decode=None) -> list[str]:
        """Display strings of ``top_ids`` (``decode``: anything ``make_decoder`` takes)."""
        return make_decoder(decode)(self.top_ids)

    def bottom_tokens(self, decode=None) -> list[str]:
        """Display strings of ``bottom_ids``."""
        return make_decoder(decode)(self.bottom_ids)


@dataclass(frozen=True)
class FeatureView:
    """Weight-only facts of one feature: decoder norm, logit lens and nearest features by decoder cosine."""

    feature: int
    decoder_norm: float
    logits: LogitLens | None
    neighbors: tuple[int, ...]
    neighbor_cosines: tuple[float, ...]


def _adapter(model):
    """The ``hooks`` adapter of a model, a ``Scope`` (its ``.adapter``) or an adapter itself."""
    if hasattr(model, "final_norm") and hasattr(model, "unembed"):
        return model
    if hasattr(model, "adapter"):
        return model.adapter
    return get_adapter(model)


def _decoder(sae) -> torch.Tensor:
    """``[d_model, d_sae]`` decoder of a TopKSAE (or the matrix itself)."""
    w = sae if isinstance(sae, torch.Tensor) else sae.W_dec
    return w.detach()


def vocab_limit(model, vocab: int | None = None) -> int | None:
    """How many unembedding rows are real tokens: ``vocab`` if given, else the size of ``model.tokenizer`` when
    ``model`` carries one (a ``Scope``), else None (all rows)."""
    if vocab is not None:
        if int(vocab) < 1:
            raise ValueError(f"vocab must be a positive number of token ids, got {vocab}")
        return int(vocab)
    tokenizer = getattr(model, "tokenizer", None)
    return len(tokenizer) if tokenizer is not None else None


@torch.no_grad()
def logit_lens(model, directions: torch.Tensor, *, top: int = 10, bins: int = 50,
               vocab: int | None = None) -> list[LogitLens]:
    """Logit lens of directions through ``model``'s final norm and unembedding.

    Args:
        model: a Qwen causal LM, a ``Scope`` or a ``hooks`` adapter.
        directions: ``[n, d_model]`` residual-stream directions (e.g. decoder columns).
        top: tokens listed at each end.
        bins: bins of the histogram over the vocabulary.
        vocab: rank only token ids below this (the tokenizer's size: Qwen's unembedding is padded past it with
            ids no text can produce). Default: ``len(model.tokenizer)`` for a ``Scope``, else every row.
    Returns:
        one :class:`LogitLens` per direction.
    Raises:
        ValueError: if the model has no unembedding or the width does not match.
    """
    adapter = _adapter(model)
    if adapter.unembed is None:
        raise ValueError(f"{type(adapter.model).__name__} has no unembedding (lm_head); load the causal-LM class "
                         f"(AutoModelForCausalLM) to get a logit lens")
    if directions.ndim != 2 or directions.shape[1] != adapter.d_model:
        raise ValueError(f"directions must be [n, d_model={adapter.d_model}], got {tuple(directions.shape)}")
    param = next(adapter.unembed.parameters())
    limit = vocab_limit(model, vocab)
    out = []
    for block in directions.split(64):
        h = adapter.final_norm(block.to(param.device, param.dtype)[:, None, :])
        logits = adapter.unembed(h)[:, 0, :limit].float().cpu()  # [n, vocab]
        n = min(top, logits.shape[1])
        hi, lo = logits.topk(n, dim=1), logits.topk(n, dim=1, largest=False)
        for i in range(logits.shape[0]):
            counts = torch.histc(logits[i], bins=bins, min=float(logits[i].min()), max=float(logits[i].max()))
            edges = torch.linspace(float(logits[i].min()), float(logits[i].max()), bins + 1)
            out.append(LogitLens(tuple(hi.indices[i].tolist()), tuple(hi.values[i].tolist()),
                                 tuple(lo.indices[i].tolist()), tuple(lo.values[i].tolist()),
                                 tuple(edges.tolist()), tuple(int(c) for c in counts.tolist())))
    return out


@torch.no_grad()
def nearest_features(sae, features: int | Iterable[int], *, n: int = 10) -> list[tuple[list[int], list[float]]]:
    """Features whose decoder directions are most cosine-similar (self excluded).

    Args:
        sae: a ``TopKSAE`` (or its ``[d_model, d_sae]`` decoder).
        features: a feature id or several.
        n: neighbours per feature.
    Returns:
        per feature, ``(ids, cosines)`` sorted by decreasing cosine.
    """
    w = _decoder(sae).float()
    w = w / w.norm(dim=0, keepdim=True).clamp(min=1e-12)
    ids = torch.tensor([features] if isinstance(features, int) else list(features), dtype=torch.int64)
    out = []
    for block in ids.split(256):
        cos = w[:, block.to(w.device)].T @ w  # [m, d_sae]
        cos[torch.arange(block.numel()), block.to(w.device)] = float("-inf")
        best = cos.topk(min(n, w.shape[1] - 1), dim=1)
        out += [(i.tolist(), v.tolist()) for i, v in zip(best.indices.cpu(), best.values.cpu())]
    return out


def decoder_norms(sae) -> torch.Tensor:
    """``[d_sae]`` L2 norm of each decoder column."""
    return _decoder(sae).float().norm(dim=0).cpu()


def feature_views(model, sae, features: Iterable[int], *, top: int = 10, n_neighbors: int = 10,
                  vocab: int | None = None) -> dict[int, FeatureView]:
    """Decoder norm, logit lens and nearest features of ``features``.

    Args:
        model: the Qwen causal LM (or ``Scope``/adapter) the SAE belongs to; None skips the logit lens.
        sae: the ``TopKSAE``.
        features: feature ids.
        top: logit-lens tokens at each end.
        n_neighbors: nearest features listed.
        vocab: token ids the logit lens ranks (see :func:`logit_lens`).
    Returns:
        ``{feature: FeatureView}``.

    Example:
        >>> views = feature_views(scope, scope.sae(3), db.top_features(50))
    """
    features = [int(f) for f in features]
    if not features:
        return {}
    w = _decoder(sae)
    norms = decoder_norms(w)
    columns = w[:, torch.tensor(features, device=w.device)].T
    lens = logit_lens(model, columns, top=top, vocab=vocab) if model is not None else [None] * len(features)
    near = nearest_features(w, features, n=n_neighbors)
    return {f: FeatureView(f, float(norms[f]), lens[i], tuple(near[i][0]), tuple(near[i][1]))
            for i, f in enumerate(features)}
