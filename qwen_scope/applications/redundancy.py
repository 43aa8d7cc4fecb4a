"""Benchmark redundancy: a benchmark's feature footprint in one call, the overlap between benchmarks as a figure,
a subsample that keeps the footprint, and whether it keeps the ranking of models.

The Qwen-Scope report's evaluation use (reference ``qwen-scope-saes.md`` §2.2: "63% of GSM8K's features are covered
by MATH"; subsampling that preserves the model ranking): a benchmark's samples are encoded once; its footprint is
the features they activate; ``redundancy_matrix`` says how much of one benchmark another covers. A subsample that
keeps the footprint is chosen by rounds of greedy set cover over the samples' document scores: each round covers
every footprint feature once more with the fewest samples, so features are represented as often as rounds allow
rather than at random. ``ranking_check`` compares the models' mean scores on the subsample with those on the full
set by Spearman's rank correlation, beside random subsamples of the same size.

    bench = Benchmark.load(scope, "openai/gsm8k", split="test", text_column="question", name="main")
    names, R = redundancy_matrix({"gsm8k": bench.footprint(), "math": other.footprint()})
    overlap_figure(names, R)
    keep = coverage_subsample(bench.scores, n=200)
    ranking_check(per_model_scores, keep)          # [M, N] per-model per-sample scores
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from qwen_scope.applications.coverage import FeatureFootprint, greedy_cover
from qwen_scope.applications.scoring import document_scores, row_text

__all__ = ["Benchmark", "load_benchmark_texts", "overlap_figure", "coverage_subsample", "spearman",
           "RankingCheck", "ranking_check"]


def load_benchmark_texts(source, *, split: str = "test", text_column: str = "text", name: str | None = None,
                         max_samples: int | None = None) -> list[str]:
    """A benchmark's texts from a ``datasets`` hub id, a local file or directory (json/jsonl/parquet/csv/text), a
    ``datasets.Dataset``, or a list of texts or dict rows.

    Raises:
        ValueError: the id is neither a local path nor reachable on the hub (offline, or no such dataset).
    """
    if isinstance(source, str):
        from qwen_scope.collect import load_corpus

        try:
            source = load_corpus(source, split=split, name=name)
        except (ConnectionError, FileNotFoundError, OSError, ValueError) as err:
            if "matches no file" in str(err) or "expected files of one kind" in str(err):
                raise
            raise ValueError(f"benchmark {source!r} (split {split!r}) could not be loaded: it is not a local path and "
                             f"the hub did not provide it ({type(err).__name__}: {str(err)[:160]}). Check the id, "
                             "download it while online, or pass a local file, a datasets.Dataset or a list of texts"
                             ) from None
    rows = list(source) if max_samples is None else [r for _, r in zip(range(max_samples), source)]
    texts = [row_text(r, text_column) for r in rows]
    if not texts:
        raise ValueError("the benchmark has no samples")
    return texts


@dataclass(frozen=True)
class Benchmark:
    """A benchmark's samples and their document scores.

    Attributes:
        name: for figures. texts: the N samples. scores: ``{layer: [N, d_sae]}`` document scores.
        threshold, min_docs: the footprint's rule (a feature is in when >= ``min_docs`` samples score above
            ``threshold``).
    """

    name: str
    texts: tuple[str, ...]
    scores: Mapping[int, torch.Tensor]
    threshold: float = 0.0
    min_docs: int = 1

    @classmethod
    def load(cls, scope, source, *, layers: int | Iterable[int] | None = None, split: str = "test",
             text_column: str = "text", name: str | None = None, max_samples: int | None = None,
             threshold: float = 0.0, min_docs: int = 1, label: str | None = None,
             batch_size: int = 16) -> Benchmark:
        """Load (``load_benchmark_texts``) and score a benchmark in one call.

        Args:
            scope: a ``Scope`` with SAEs at ``layers``. source: hub id, local path, Dataset or list.
            split, text_column, name, max_samples: what to read. threshold, min_docs: the footprint's rule.
            label: the benchmark's display name (default: ``source`` when it is a str).
        """
        texts = load_benchmark_texts(source, split=split, text_column=text_column, name=name,
                                     max_samples=max_samples)
        scores = document_scores(scope, texts, layers, batch_size=batch_size)
        return cls(label or (source if isinstance(source, str) else "benchmark"), tuple(texts), scores,
                   float(threshold), int(min_docs))

    def footprint(self, rows: Sequence[int] | torch.Tensor | None = None) -> FeatureFootprint:
        """The footprint of all samples, or of the samples ``rows``."""
        scores = self.scores if rows is None else {n: s[torch.as_tensor(rows, dtype=torch.long)]
                                                   for n, s in self.scores.items()}
        return FeatureFootprint.from_scores(scores, threshold=self.threshold, min_docs=self.min_docs)

    def __len__(self) -> int:
        return len(self.texts)


def overlap_figure(names: Sequence[str], R: torch.Tensor, *, title: str = "feature coverage between benchmarks"
                   ) -> go.Figure:
    """Heatmap of ``redundancy_matrix``: cell (row i, column j) is the share of j's features that i covers."""
    z = [[float(v) for v in row] for row in R]
    fig = go.Figure(go.Heatmap(z=z, x=list(names), y=list(names), zmin=0, zmax=1, colorscale="Blues",
                               text=[[f"{v:.0%}" for v in row] for row in z], texttemplate="%{text}",
                               hovertemplate="%{y} covers %{z:.0%} of %{x}'s features<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="benchmark covered", yaxis_title="covering benchmark",
                      yaxis_autorange="reversed", template="plotly_white", height=120 + 60 * len(names))
    return fig


def coverage_subsample(scores: Mapping[int, torch.Tensor], n: int, *, threshold: float = 0.0,
                       min_docs: int = 1) -> torch.Tensor:
    """``n`` sample indices that keep the full set's footprint: rounds of greedy set cover of its features.

    Args:
        scores: the samples' document scores ``{layer: [N, d_sae]}`` (``Benchmark.scores``).
        n: samples to keep (<= N). threshold, min_docs: the footprint's rule.

    Returns:
        ``[n]`` int64 indices in the order picked (a round's picks first; once no sample adds a feature, the
        remaining places go to the samples activating the most footprint features).
    """
    N = next(iter(scores.values())).shape[0]
    if not 1 <= n <= N:
        raise ValueError(f"n must be in 1..{N} (the benchmark's samples), got {n}")
    fp = FeatureFootprint.from_scores(scores, threshold=threshold, min_docs=min_docs)
    targets = {layer: fp.features(layer).tolist() for layer in fp.layers}
    chosen: list[int] = []
    left = torch.ones(N, dtype=torch.bool)
    while len(chosen) < n:
        pool = torch.nonzero(left).flatten()
        picks = greedy_cover({k: v[pool] for k, v in scores.items()}, target_features=targets,
                             budget=n - len(chosen), threshold=threshold)
        if not picks:
            break
        for p in picks:
            chosen.append(int(pool[p.index]))
            left[pool[p.index]] = False
    if len(chosen) < n:
        breadth = sum((scores[k][:, targets[k]] > threshold).sum(1) for k in targets)
        breadth = torch.where(left, breadth, torch.full_like(breadth, -1))
        rest = breadth.argsort(descending=True, stable=True)[:n - len(chosen)]
        chosen += rest.tolist()
    return torch.tensor(chosen, dtype=torch.long)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of ``x`` [n], ties sharing their mean rank."""
    order = x.double().argsort()
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    for v in torch.unique(x):
        tie = x == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two ``[M]`` score vectors (Pearson of their tie-averaged ranks)."""
    ra, rb = _ranks(torch.as_tensor(a)), _ranks(torch.as_tensor(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    return float(ra @ rb) / denom if denom else float("nan")


@dataclass(frozen=True)
class RankingCheck:
    """How well a subsample keeps the models' ranking.

    Attributes:
        rho: Spearman ρ of the models' mean scores on the subsample vs on the full set.
        random_rho: mean ρ of ``trials`` random subsamples of the same size. random_rhos: each trial's ρ.
        full, sub: ``[M]`` mean score per model on the full set and on the subsample.
    """

    rho: float
    random_rho: float
    random_rhos: tuple[float, ...]
    full: torch.Tensor
    sub: torch.Tensor

    def __str__(self) -> str:
        return (f"Spearman rho {self.rho:.3f} on the subsample (random subsamples of the same size: mean "
                f"{self.random_rho:.3f}, min {min(self.random_rhos):.3f})")


def ranking_check(per_model: torch.Tensor, subsample: Sequence[int] | torch.Tensor, *, trials: int = 20,
                  seed: int = 0) -> RankingCheck:
    """Rank correlation of models' scores on ``subsample`` vs the full set, beside random subsamples.

    Args:
        per_model: ``[M, N]`` each model's score on each sample (M >= 3 models).
        subsample: indices into N. trials: random subsamples drawn. seed: their seed.
    """
    per_model = torch.as_tensor(per_model, dtype=torch.float64)
    if per_model.ndim != 2 or per_model.shape[0] < 3:
        raise ValueError(f"per_model must be [M, N] with M >= 3 models to rank, got {tuple(per_model.shape)}")
    idx = torch.as_tensor(subsample, dtype=torch.long)
    full, sub = per_model.mean(1), per_model[:, idx].mean(1)
    g = torch.Generator().manual_seed(seed)
    rhos = tuple(spearman(full, per_model[:, torch.randperm(per_model.shape[1], generator=g)[:len(idx)]].mean(1))
                 for _ in range(trials))
    return RankingCheck(spearman(full, sub), sum(rhos) / len(rhos), rhos, full, sub)
