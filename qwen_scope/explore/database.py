"""The feature database: per-feature statistics and examples mined from a collection run, saved as a directory.

Built by :func:`qwen_scope.explore.build_feature_database` in one streaming pass (see ``builder.py``); this module
holds the result, its queries, the user's labels/notes and the on-disk format::

    db_dir/
      database.json         config, token counts, provenance (model, point, release, layer)
      database.safetensors  count / sum / max / histogram per feature, top examples and samples with context windows,
                            co-occurrence counts of the tracked features
      labels.json           {"<feature>": {"label", "notes", "explanation", "detection_auroc", "explainer"}} —
                            written whenever you annotate or store an explanation

Example:
    >>> db = FeatureDatabase.load("runs/db")
    >>> db.top_examples(123)[0].value, db.density[123]
    >>> db.annotate(123, label="Python keywords")
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qwen_scope.explore._buffer import KeyedTopK

# Fixed log-spaced histogram grid shared by all features (so it can be filled in one pass without knowing the max):
# 16 bins per decade from 1e-4 to 1e5, plus an underflow bucket (index 0) and an overflow bucket (last index).
HIST_EDGES = torch.logspace(-4, 5, 9 * 16 + 1, dtype=torch.float64)
N_HIST = HIST_EDGES.numel() + 1

FORMAT_VERSION = 1
_INFO_KEY = "qwen_scope_feature_database"  # safetensors metadata key holding the database description


@dataclass(frozen=True)
class DatabaseConfig:
    """How the database is mined.

    Args:
        d_sae: number of SAE features.
        n_top: top-activating examples kept per feature (SAEDashboard: 20).
        n_bins: activation-quantile bins per feature (SAEDashboard: 10).
        per_bin: samples shown per bin (SAEDashboard: 5).
        context: tokens of context (left, right) kept around the activating token (SAEDashboard: (5, 5)).
        exclude_position_0: leave position 0 (the attention sink / BOS) out of every statistic and example.
        cooccurrence: ``"auto"`` (track all features when d_sae <= 4096), ``"all"``, ``"none"``, or a list of
            feature ids whose co-occurrence with every feature is counted (memory: len(list) * d_sae int64).
        seed: seed of the random keys used for the bin samples.
    """

    d_sae: int
    n_top: int = 20
    n_bins: int = 10
    per_bin: int = 5
    context: tuple[int, int] = (5, 5)
    exclude_position_0: bool = True
    cooccurrence: str | tuple[int, ...] = "auto"
    seed: int = 0

    def __post_init__(self):
        for name in ("d_sae", "n_top", "n_bins", "per_bin"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DatabaseConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if len(self.context) != 2 or min(self.context) < 0:
            raise ValueError(f"DatabaseConfig.context must be (left, right) >= 0 tokens, got {self.context!r}")
        object.__setattr__(self, "context", tuple(int(c) for c in self.context))
        if isinstance(self.cooccurrence, str):
            if self.cooccurrence not in ("auto", "all", "none"):
                raise ValueError(f"DatabaseConfig.cooccurrence must be 'auto', 'all', 'none' or a list of feature "
                                 f"ids, got {self.cooccurrence!r}")
        else:
            object.__setattr__(self, "cooccurrence", tuple(sorted({int(f) for f in self.cooccurrence})))

    @property
    def n_samples(self) -> int:
        """Size of each feature's uniform sample of firings (the pool the quantile bins are drawn from)."""
        return self.n_bins * self.per_bin

    @property
    def window(self) -> int:
        return self.context[0] + 1 + self.context[1]

    def tracked_features(self) -> torch.Tensor:
        """Feature ids whose co-occurrence is counted (int64, sorted)."""
        mode = self.cooccurrence
        if mode == "auto":
            mode = "all" if self.d_sae <= 4096 else "none"
        if mode == "all":
            return torch.arange(self.d_sae)
        if mode == "none":
            return torch.zeros(0, dtype=torch.int64)
        return torch.tensor(mode, dtype=torch.int64)


@dataclass(frozen=True)
class Example:
    """One activating token with its context window (clipped to its document).

    ``tokens``/``values`` run over the window; ``values`` are this feature's activations on each token;
    ``mark`` is the index of the activating token in ``tokens``; ``token_index`` its global offset in the source.
    """

    feature: int
    value: float
    token_index: int
    tokens: tuple[int, ...]
    values: tuple[float, ...]
    mark: int


@dataclass(frozen=True)
class QuantileBin:
    """Samples whose activation lies in ``[lo, hi]`` (a quantile interval of the feature's firings).

    ``contains`` is the fraction of the feature's firings estimated to fall in this bin.
    """

    lo: float
    hi: float
    contains: float
    examples: tuple[Example, ...]


@dataclass(frozen=True)
class Cooccurrence:
    """Feature ``other`` fired on ``count`` of the tokens where the queried feature fired."""

    other: int
    count: int
    jaccard: float
    fraction: float


@dataclass
class FeatureDatabase:
    """Per-feature statistics and examples; see the module docstring. Build with ``build_feature_database``."""

    config: DatabaseConfig
    n_tokens_seen: int
    n_tokens: int
    count: torch.Tensor  # [d_sae] int64 firings
    act_sum: torch.Tensor  # [d_sae] float64
    act_max: torch.Tensor  # [d_sae] float32
    hist: torch.Tensor  # [d_sae, N_HIST] int64
    top: KeyedTopK
    samples: KeyedTopK
    tracked: torch.Tensor  # [n_tracked] int64
    cooc: torch.Tensor  # [n_tracked, d_sae] int64
    meta: dict = field(default_factory=dict)
    labels: dict[int, dict[str, str]] = field(default_factory=dict)
    path: Path | None = None

    # ------------------------------------------------------------------ statistics
    @property
    def d_sae(self) -> int:
        return self.config.d_sae

    @property
    def density(self) -> torch.Tensor:
        """Fraction of counted tokens where each feature fires, ``[d_sae]`` float64 (Neuronpedia's frac_nonzero)."""
        return self.count.double() / max(self.n_tokens, 1)

    @property
    def mean_activation(self) -> torch.Tensor:
        """Mean activation over the tokens where each feature fires, ``[d_sae]`` (0 for dead features)."""
        return self.act_sum / self.count.clamp(min=1).double()

    @property
    def max_activation(self) -> torch.Tensor:
        return self.act_max

    def top_features(self, n: int = 20, by: str = "max") -> list[int]:
        """The ``n`` live features ranked by ``by`` in ("max", "density", "mean", "count")."""
        metric = {"max": self.act_max.double(), "density": self.density, "mean": self.mean_activation,
                  "count": self.count.double()}
        if by not in metric:
            raise ValueError(f"top_features(by={by!r}): expected one of {sorted(metric)}")
        score = metric[by].masked_fill(self.count == 0, float("-inf"))
        n = min(n, int((self.count > 0).sum()))
        return score.topk(n).indices.tolist()

    def _check(self, feature: int) -> int:
        feature = int(feature)
        if not 0 <= feature < self.d_sae:
            raise ValueError(f"feature {feature} out of range: this database has d_sae={self.d_sae} features")
        return feature

    # ------------------------------------------------------------------ examples
    def _example(self, buf: KeyedTopK, feature: int, slot: int) -> Example:
        row = buf.ptr[feature, slot]
        tokens = buf.pool_tokens[row]
        keep = tokens >= 0
        left = self.config.context[0]
        return Example(feature=feature, value=float(buf.value[feature, slot]),
                       token_index=int(buf.token_index[feature, slot]), tokens=tuple(tokens[keep].tolist()),
                       values=tuple(buf.pool_values[row][keep].tolist()), mark=int(keep[:left].sum()))

    def top_examples(self, feature: int, n: int | None = None) -> list[Example]:
        """The top-activating examples of ``feature``, largest first (at most ``config.n_top``)."""
        feature = self._check(feature)
        filled = int((self.top.token_index[feature] >= 0).sum())
        return [self._example(self.top, feature, s) for s in range(min(filled, n or filled))]

    def quantile_bins(self, feature: int) -> list[QuantileBin]:
        """Samples of ``feature`` from ``config.n_bins`` activation-quantile bins, lowest bin first.

        The bins are quantiles of a uniform random sample of the feature's firings (``config.n_samples`` of them,
        priority-sampled in the streaming pass); each sample is shown in exactly one bin. Empty for dead features.
        """
        feature = self._check(feature)
        filled = self.samples.token_index[feature] >= 0
        slots = torch.nonzero(filled).flatten()
        if slots.numel() == 0:
            return []
        values = self.samples.value[feature, slots].double()
        n_bins = min(self.config.n_bins, slots.numel())
        edges = torch.quantile(values, torch.linspace(0, 1, n_bins + 1, dtype=torch.float64))
        # Bin i holds edges[i] <= v < edges[i+1]; the last bin is closed on the right.
        which = (torch.bucketize(values, edges[1:-1], right=True))
        bins = []
        for i in range(n_bins):
            members = slots[which == i]
            bins.append(QuantileBin(lo=float(edges[i]), hi=float(edges[i + 1]),
                                    contains=members.numel() / slots.numel(),
                                    examples=tuple(self._example(self.samples, feature, int(s)) for s in members)))
        return bins

    def histogram(self, feature: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The activation histogram of ``feature`` on the fixed log grid, trimmed to its non-empty range.

        Returns:
            ``(edges [n+1] float64, counts [n] int64)``; under/overflow buckets are folded into the end bins.
        """
        feature = self._check(feature)
        counts = self.hist[feature]
        grid = torch.cat([HIST_EDGES[:1] / 10, HIST_EDGES, HIST_EDGES[-1:] * 10])
        nz = torch.nonzero(counts).flatten()
        if nz.numel() == 0:
            return grid[:1], counts[:0]
        lo, hi = int(nz[0]), int(nz[-1])
        return grid[lo:hi + 2], counts[lo:hi + 1]

    def cooccurring(self, feature: int, n: int = 10) -> list[Cooccurrence]:
        """Features that fire on the same tokens as ``feature``, ranked by Jaccard index (self excluded).

        Raises:
            ValueError: if the feature's co-occurrence was not tracked (see ``DatabaseConfig.cooccurrence``).
        """
        feature = self._check(feature)
        row = torch.searchsorted(self.tracked, torch.tensor(feature))
        if row >= self.tracked.numel() or self.tracked[row] != feature:
            raise ValueError(f"co-occurrence of feature {feature} was not tracked; rebuild with "
                             f"cooccurrence='all' or a list including {feature}")
        counts = self.cooc[row].double()
        union = self.count[feature].double() + self.count.double() - counts
        jaccard = torch.where(union > 0, counts / union.clamp(min=1), torch.zeros_like(counts))
        jaccard[feature] = -1.0
        n = min(n, int((counts > 0).sum()) - int(counts[feature] > 0))
        order = jaccard.topk(max(n, 0)).indices.tolist()
        own = max(int(self.count[feature]), 1)
        return [Cooccurrence(other=g, count=int(counts[g]), jaccard=float(jaccard[g]), fraction=float(counts[g]) / own)
                for g in order]

    # ------------------------------------------------------------------ labels
    def label(self, feature: int) -> str:
        return self.labels.get(self._check(feature), {}).get("label", "")

    def notes(self, feature: int) -> str:
        return self.labels.get(self._check(feature), {}).get("notes", "")

    def annotate(self, feature: int, label: str | None = None, notes: str | None = None) -> None:
        """Set a feature's free-text label and/or notes; saved to ``labels.json`` at once if the db has a path."""
        entry = self.labels.setdefault(self._check(feature), {})
        if label is not None:
            entry["label"] = str(label)
        if notes is not None:
            entry["notes"] = str(notes)
        if self.path is not None:
            self._write_labels(self.path)

    def explanation(self, feature: int) -> dict | None:
        """The automatic explanation of ``feature``: ``{"text", "detection_auroc", "explainer"}``, or None."""
        entry = self.labels.get(self._check(feature), {})
        if "explanation" not in entry:
            return None
        return {"text": entry["explanation"], "detection_auroc": entry.get("detection_auroc"),
                "explainer": entry.get("explainer", "")}

    def set_explanation(self, feature: int, text: str, *, score: float | None = None, explainer: str = "") -> None:
        """Store an automatic explanation (``qwen_scope.evals.explain_features`` writes them) beside the user's
        label; saved to ``labels.json`` at once if the db has a path."""
        entry = self.labels.setdefault(self._check(feature), {})
        entry.update(explanation=str(text), detection_auroc=None if score is None else float(score),
                     explainer=str(explainer))
        if self.path is not None:
            self._write_labels(self.path)

    def search(self, query: str, decode: Callable[[int], str] | None = None) -> list[int]:
        """Features whose label, notes or explanation contain ``query`` (case-insensitive), or whose top-activating
        token (decoded with ``decode``) does; an integer query also matches that feature id."""
        q = query.strip().lower()
        hits = [f for f, e in sorted(self.labels.items())
                if q and any(q in str(e.get(key, "")).lower() for key in ("label", "notes", "explanation"))]
        if q.isdigit() and int(q) < self.d_sae and int(q) not in hits:
            hits.insert(0, int(q))
        if decode is not None and q:
            for f in torch.nonzero(self.top.token_index[:, 0] >= 0).flatten().tolist():
                ex = self._example(self.top, f, 0)
                if f not in hits and q in decode(ex.tokens[ex.mark]).strip().lower():
                    hits.append(f)
        return hits

    def _write_labels(self, path: Path) -> None:
        data = {str(f): e for f, e in sorted(self.labels.items())}
        tmp = path / f".labels.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False))
        tmp.replace(path / "labels.json")

    # ------------------------------------------------------------------ I/O
    def save(self, path: str | Path) -> Path:
        """Write the database (and its labels) to directory ``path``; returns it. Later labels go there too.

        Atomic: the tensors and their description go into one safetensors file (the description also in its
        metadata) written under a temporary name and renamed, so an interrupted save leaves the previous database
        whole; ``database.json`` is the same description for people and tools, renamed into place after it.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {"count": self.count, "act_sum": self.act_sum, "act_max": self.act_max, "hist": self.hist,
                   "tracked": self.tracked, "cooc": self.cooc, **self.top.state("top"),
                   **self.samples.state("samples")}
        info = {"format_version": FORMAT_VERSION, "config": asdict(self.config), "n_tokens_seen": self.n_tokens_seen,
                "n_tokens": self.n_tokens, "meta": self.meta}
        text = json.dumps(info, indent=1)
        for name, write in (("database.safetensors", lambda f: save_file(
                                {k: v.contiguous() for k, v in tensors.items()}, str(f), metadata={_INFO_KEY: text})),
                            ("database.json", lambda f: f.write_text(text))):
            tmp = path / f".{name}.tmp-{os.getpid()}"
            write(tmp)
            tmp.replace(path / name)
        self.path = path
        self._write_labels(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> FeatureDatabase:
        """Read a database written by :meth:`save` (labels included)."""
        path = Path(path)
        tensor_file, info_file = path / "database.safetensors", path / "database.json"
        if not tensor_file.is_file():
            raise FileNotFoundError(f"{tensor_file} not found: expected a feature database directory written by "
                                    f"FeatureDatabase.save() or `qwen-scope explore`")
        with safe_open(str(tensor_file), "pt") as f:
            text = (f.metadata() or {}).get(_INFO_KEY)
        if text is None:  # written before the description moved into the tensor file
            if not info_file.is_file():
                raise FileNotFoundError(f"{info_file} not found next to {tensor_file.name}: the database directory "
                                        "is incomplete; rebuild it with `qwen-scope explore`")
            text = info_file.read_text()
        info = json.loads(text)
        if info.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{tensor_file} has format_version {info.get('format_version')}, this qwen-scope reads "
                             f"{FORMAT_VERSION}; rebuild the database")
        cfg = dict(info["config"])
        cfg["context"] = tuple(cfg["context"])
        if isinstance(cfg["cooccurrence"], list):
            cfg["cooccurrence"] = tuple(cfg["cooccurrence"])
        t = load_file(str(tensor_file))
        labels_file = path / "labels.json"
        labels = {int(k): v for k, v in json.loads(labels_file.read_text()).items()} if labels_file.is_file() else {}
        return cls(config=DatabaseConfig(**cfg), n_tokens_seen=info["n_tokens_seen"], n_tokens=info["n_tokens"],
                   count=t["count"], act_sum=t["act_sum"], act_max=t["act_max"], hist=t["hist"],
                   top=KeyedTopK.from_state(t, "top"), samples=KeyedTopK.from_state(t, "samples"),
                   tracked=t["tracked"], cooc=t["cooc"], meta=info.get("meta", {}), labels=labels, path=path)

    def __repr__(self) -> str:
        alive = int((self.count > 0).sum())
        return (f"FeatureDatabase(d_sae={self.d_sae}, n_tokens={self.n_tokens}, alive={alive}, "
                f"n_top={self.config.n_top}, meta={self.meta})")

    def _repr_html_(self) -> str:
        from qwen_scope.explore.html import database_summary_html

        return database_summary_html(self)
