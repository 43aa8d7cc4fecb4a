"""Build a :class:`FeatureDatabase` in one streaming pass over chunks of SAE codes, with bounded memory.

The builder is source-agnostic: it consumes any iterable of :class:`Chunk` (token ids, document index, positions and
top-k SAE codes of consecutive tokens). :func:`store_chunks` adapts an ``ActivationStore``.

Context windows need tokens on both sides of an activating token, so the builder keeps a sliding window of the stream:
a chunk is processed once ``context[1]`` tokens after it have arrived, and only ``context[0]`` tokens before the
first unprocessed one are kept. Memory: the window (about one chunk plus the context) and the per-feature state
(``d_sae * (n_top + n_bins * per_bin) * window`` tokens and values, a 146-bucket histogram per feature, and
``n_tracked * d_sae`` co-occurrence counts) — independent of the number of tokens streamed.

Example:
    >>> db = build_feature_database(store_chunks(store, "resid_post.12"), d_sae=32768)
    >>> db.save("runs/db12")
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from qwen_scope.explore._buffer import _STATE as _BUFFER_STATE
from qwen_scope.explore._buffer import KeyedTopK
from qwen_scope.explore.database import HIST_EDGES, N_HIST, DatabaseConfig, FeatureDatabase

# Co-occurrence pairs are counted in blocks of at most this many (token, feature, feature) triples.
_PAIR_BLOCK = 1 << 22
# Context windows are gathered for at most this many entries at a time.
_CONTEXT_BLOCK = 1 << 16


class Chunk(NamedTuple):
    """Consecutive tokens of the source and their SAE codes.

    Args:
        token_ids: ``[N]`` token ids.
        doc_index: ``[N]`` document of each token (context windows never cross documents).
        positions: ``[N]`` position of each token in its sequence (position 0 is excluded by default).
        codes: top-k codes with ``values [N, k]`` and ``indices [N, k]`` (``saes.SparseCodes`` or a pair).
        start: global offset of the first token (checked for continuity when given).
    """

    token_ids: torch.Tensor
    doc_index: torch.Tensor
    positions: torch.Tensor
    codes: Any
    start: int | None = None


class FeatureDatabaseBuilder:
    """Streaming builder: ``add(chunk)`` repeatedly, then ``finish()``. See :func:`build_feature_database`."""

    def __init__(self, config: DatabaseConfig, meta: dict | None = None):
        self.config = config
        d, C = config.d_sae, config.window
        self.meta = dict(meta or {})
        self.count = torch.zeros(d, dtype=torch.int64)
        self.act_sum = torch.zeros(d, dtype=torch.float64)
        self.act_max = torch.zeros(d, dtype=torch.float32)
        self.hist = torch.zeros(d * N_HIST, dtype=torch.int64)
        self.top = KeyedTopK(d, config.n_top, C)
        self.samples = KeyedTopK(d, config.n_samples, C)
        self.tracked = config.tracked_features()
        self.slot = torch.full((d,), -1, dtype=torch.int64)
        self.slot[self.tracked] = torch.arange(self.tracked.numel())
        self.cooc = torch.zeros(self.tracked.numel() * d, dtype=torch.int64)
        self.device = self.count.device
        self.hist_edges = HIST_EDGES.to(self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.n_seen = 0
        self.n_counted = 0
        # Sliding window of the stream: global range [win_start, win_start + len); tokens < next are processed.
        self.win_start = 0
        self.next = 0
        self.win: dict[str, torch.Tensor] | None = None
        self._lookup: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ streaming
    def add(self, chunk: Chunk) -> None:
        """Append a chunk; process every token whose right context is now complete."""
        part = self._validate(chunk)
        if self.win is None:
            self.win = part
        else:
            self.win = {k: torch.cat([self.win[k], part[k]]) for k in part}
        self.n_seen += part["tokens"].numel()
        self._lookup = None
        win_end = self.win_start + self.win["tokens"].numel()
        self._process(self.next, win_end - self.config.context[1])
        keep_from = max(self.win_start, self.next - self.config.context[0])
        if keep_from > self.win_start:
            self.win = {k: v[keep_from - self.win_start:] for k, v in self.win.items()}
            self.win_start = keep_from
            self._lookup = None

    def finish(self) -> FeatureDatabase:
        """Process the tail of the stream and return the database."""
        if self.win is not None:
            self._process(self.next, self.win_start + self.win["tokens"].numel())
        d = self.config.d_sae
        for buf in (self.top, self.samples):
            for name in _BUFFER_STATE:
                setattr(buf, name, getattr(buf, name).cpu())
        return FeatureDatabase(config=self.config, n_tokens_seen=self.n_seen, n_tokens=self.n_counted,
                               count=self.count.cpu(), act_sum=self.act_sum.cpu(), act_max=self.act_max.cpu(),
                               hist=self.hist.reshape(d, N_HIST).cpu(), top=self.top, samples=self.samples,
                               tracked=self.tracked.cpu(), cooc=self.cooc.reshape(self.tracked.numel(), d).cpu(),
                               meta=self.meta)

    def _validate(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        if not isinstance(chunk, Chunk):
            chunk = Chunk(*chunk)
        values, indices = chunk.codes[0], chunk.codes[1]
        n = chunk.token_ids.shape[0]
        shapes = {"token_ids": tuple(chunk.token_ids.shape), "doc_index": tuple(chunk.doc_index.shape),
                  "positions": tuple(chunk.positions.shape), "codes.values": tuple(values.shape[:1]),
                  "codes.indices": tuple(indices.shape[:1])}
        if any(s != (n,) for s in shapes.values()) or values.shape != indices.shape or values.ndim != 2:
            raise ValueError(f"chunk shapes disagree: expected token_ids/doc_index/positions [N] and codes "
                             f"values/indices [N, k] with one N; got {shapes}, codes {tuple(values.shape)} / "
                             f"{tuple(indices.shape)}")
        expected = self.win_start + (0 if self.win is None else self.win["tokens"].numel())
        if chunk.start is not None and int(chunk.start) != expected:
            raise ValueError(f"chunk starts at token {chunk.start} but the stream is at token {expected}: chunks must "
                             f"be consecutive and in order (iterate the store once, from the start)")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.config.d_sae):
            raise ValueError(f"codes.indices range [{int(indices.min())}, {int(indices.max())}] does not fit "
                             f"d_sae={self.config.d_sae}; build with the d_sae of the SAE that made the codes")
        dev = self.device
        return {"tokens": chunk.token_ids.to(dev, torch.int32), "docs": chunk.doc_index.to(dev, torch.int64),
                "pos": chunk.positions.to(dev, torch.int64), "values": values.to(dev, torch.float32),
                "indices": indices.to(dev, torch.int64)}

    # ------------------------------------------------------------------ one range of tokens
    def _process(self, a: int, b: int) -> None:
        if b <= a:
            return
        w = self.win
        lo, hi = a - self.win_start, b - self.win_start
        values, indices = w["values"][lo:hi], w["indices"][lo:hi]
        counted = torch.ones(hi - lo, dtype=torch.bool)
        if self.config.exclude_position_0:
            counted &= w["pos"][lo:hi] != 0
        self.n_counted += int(counted.sum())
        active = (values > 0) & counted[:, None]
        t_local, j = torch.nonzero(active, as_tuple=True)
        feature, value = indices[t_local, j], values[t_local, j]
        gidx = t_local + a
        self.next = b
        if feature.numel() == 0:
            return
        ones = torch.ones_like(feature)
        self.count.index_add_(0, feature, ones)
        self.act_sum.index_add_(0, feature, value.double())
        self.act_max.scatter_reduce_(0, feature, value, reduce="amax")
        bucket = torch.bucketize(value.double(), self.hist_edges, right=True)
        self.hist.index_add_(0, feature * N_HIST + bucket, ones)
        self.top.update(feature, value.double(), value, gidx, self._context)
        keys = torch.rand(feature.numel(), generator=self.generator, dtype=torch.float64)
        self.samples.update(feature, keys, value, gidx, self._context)
        if self.tracked.numel():
            self._cooccurrence(indices, active, t_local, feature)

    def _context(self, gidx: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context windows of global tokens ``gidx`` [M] for ``feature`` [M] -> tokens, values [M, C]."""
        w, (left, _), C = self.win, self.config.context, self.config.window
        n_win = w["tokens"].numel()
        if self._lookup is None:
            # The window's (feature, row) pairs as sorted keys: a feature's firings near a row are one search away
            # and at most C consecutive entries long (one entry per (feature, row)).
            keys = (w["indices"] * n_win + torch.arange(n_win)[:, None]).flatten()
            order = torch.argsort(keys)
            self._lookup = (keys[order], w["values"].flatten()[order])
        keys, vals = self._lookup
        tokens, values = [], []
        offsets = torch.arange(C)
        for s in range(0, gidx.numel(), _CONTEXT_BLOCK):
            first = gidx[s:s + _CONTEXT_BLOCK] - self.win_start - left  # window row of context slot 0
            f = feature[s:s + _CONTEXT_BLOCK]
            rows = first[:, None] + offsets  # [M, C]
            inside = (rows >= 0) & (rows < n_win)
            rows_c = rows.clamp(0, n_win - 1)
            inside &= w["docs"][rows_c] == w["docs"][first + left][:, None]
            tokens.append(torch.where(inside, w["tokens"][rows_c], torch.full_like(rows_c, -1, dtype=torch.int32)))
            begin = torch.searchsorted(keys, f * n_win + first.clamp(min=0))
            at = begin[:, None] + offsets  # [M, C]
            in_keys = at < keys.numel()
            at = at.clamp(max=keys.numel() - 1)
            hit_row = keys[at] - f[:, None] * n_win
            col = hit_row - first[:, None]
            hit = in_keys & (hit_row >= 0) & (hit_row < n_win) & (col >= 0) & (col < C)
            out = torch.zeros(rows.shape, dtype=vals.dtype)
            out.scatter_add_(1, torch.where(hit, col, 0), torch.where(hit, vals[at], 0.0))
            values.append(out * inside)
        return torch.cat(tokens), torch.cat(values)

    def _cooccurrence(self, indices, active, t_local, feature) -> None:
        d = self.config.d_sae
        rows = self.slot[feature]
        is_tracked = rows >= 0
        t_local, rows = t_local[is_tracked], rows[is_tracked]
        k = indices.shape[1]
        step = max(1, _PAIR_BLOCK // k)
        for s in range(0, rows.numel(), step):
            t, r = t_local[s:s + step], rows[s:s + step]
            other, ok = indices[t], active[t]  # [m, k]
            flat = (r[:, None] * d + other)[ok]
            self.cooc.index_add_(0, flat, torch.ones_like(flat))


def build_feature_database(chunks: Iterable[Chunk], d_sae: int, *, meta: dict | None = None,
                           device: str | torch.device | None = None, **config: Any) -> FeatureDatabase:
    """Mine a feature database from a stream of SAE-code chunks in one pass.

    Args:
        chunks: consecutive :class:`Chunk` s (or 4/5-tuples in that order), e.g. ``store_chunks(store, point)``.
        d_sae: number of SAE features.
        meta: provenance saved with the database (model, point, release, layer, ...).
        device: where the streaming state lives and the chunks are processed (``"cuda"`` is much faster for
            d_sae in the tens of thousands); the result is on CPU. Default: CPU.
        **config: fields of :class:`DatabaseConfig` (n_top=20, n_bins=10, per_bin=5, context=(5, 5),
            exclude_position_0=True, cooccurrence="auto", seed=0).

    Returns:
        The :class:`FeatureDatabase` (not yet saved; call ``.save(dir)``).

    Example:
        >>> db = build_feature_database(store_chunks(store, "resid_post.3"), d_sae=sae.d_sae, context=(8, 4))
    """
    with torch.device(device or "cpu"):
        builder = FeatureDatabaseBuilder(DatabaseConfig(d_sae=d_sae, **config), meta=meta)
        for chunk in chunks:
            builder.add(chunk)
        return builder.finish()


def store_chunks(store: Any, point: str, *, chunk_tokens: int = 16384) -> Iterator[Chunk]:
    """Adapt an ``ActivationStore`` to the builder: its SAE codes at ``point`` with token ids, documents, positions.

    Args:
        store: a ``qwen_scope.store.ActivationStore`` (anything with ``token_ids()``, ``doc_index()``,
            ``positions()`` and ``iter_chunks(point, kind="sae", chunk_tokens=...)``).
        point: the hook point the SAE codes are stored under, e.g. ``"resid_post.12"``.
        chunk_tokens: tokens per chunk read from the store.
    """
    tokens, docs, positions = store.token_ids(), store.doc_index(), store.positions()
    for start, codes in store.iter_chunks(point, kind="sae", chunk_tokens=chunk_tokens):
        n = codes[0].shape[0]
        yield Chunk(tokens[start:start + n], docs[start:start + n], positions[start:start + n], codes, start)
