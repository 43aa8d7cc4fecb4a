"""``SAEBank``: the SAEs of one release, loaded lazily per layer and kept under an LRU memory bound.

One Qwen3.5-27B layer is 3.4 GB in fp32, so a bank never holds more than ``max_bytes`` / ``max_layers``: touching a
layer that is not resident evicts the least recently used ones first (before loading, so peaks stay bounded).
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from saes.loading import _release_from_path, load, resolve
from saes.registry import Release, get_release
from saes.topk import TopKSAE

# A release directory holds layer{n}.sae.pt and/or layer{n}.sae.safetensors (saes.training can write either).
_LAYER_FILE_RE = re.compile(r"layer(\d+)\.sae\.(?:pt|safetensors)")


def _nbytes(sae: TopKSAE) -> int:
    return sum(p.numel() * p.element_size() for p in sae.parameters())


class SAEBank:
    """Lazy, LRU-bounded access to the per-layer SAEs of one release.

    Args:
        source: release id, repo id or release directory (anything ``saes.load`` accepts except a single file).
        layers: the layers this bank serves (default: all layers of the release / all files in the directory).
        max_bytes: bound on resident weight bytes (``None`` = unbounded). A single layer larger than the bound is
            still returned; it is then the only one resident.
        max_layers: bound on resident layers (``None`` = unbounded).
        **load_kwargs: passed to ``saes.load`` (``device``, ``dtype``, ``revision``, ``cache_dir``,
            ``safetensors_cache``, ``k``, ``expected_d_model``).

    Example:
        >>> bank = SAEBank("qwen-scope-3.5-27b-w80k-l50", max_layers=2, device="cuda", dtype=torch.bfloat16)
        >>> codes = bank[31].encode_sparse(resid)      # loads layer 31 on first use
    """

    def __init__(self, source: str | Path, layers: Iterable[int] | None = None, *, max_bytes: int | None = None,
                 max_layers: int | None = None, **load_kwargs):
        if "layer" in load_kwargs:
            raise TypeError("SAEBank serves many layers; pass layers=[...] instead of layer=")
        for name, bound in (("max_bytes", max_bytes), ("max_layers", max_layers)):
            if bound is not None and bound < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {bound}")
        self.source = source
        self.max_bytes, self.max_layers = max_bytes, max_layers
        self._load_kwargs = load_kwargs
        self.release: Release | None = self._probe_release()
        self._layers = self._available_layers(layers)
        self._resident: OrderedDict[int, TopKSAE] = OrderedDict()
        self._layer_bytes: int | None = None
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = 0

    def _probe_release(self) -> Release | None:
        path = Path(str(self.source)).expanduser()
        if path.is_file():
            raise ValueError(f"SAEBank needs a release or directory, got the single file {path}; use saes.load()")
        if path.is_dir():
            return _release_from_path(path)
        return get_release(str(self.source))

    def _available_layers(self, layers: Iterable[int] | None) -> tuple[int, ...]:
        path = Path(str(self.source)).expanduser()
        if layers is None:
            if self.release is not None and self.release.n_layers is not None:
                return tuple(self.release.layers)
            if path.is_dir():
                found = sorted({int(m[1]) for p in path.glob("layer*.sae.*")
                                if (m := _LAYER_FILE_RE.fullmatch(p.name))})
                if found:
                    return tuple(found)
            raise ValueError(f"cannot tell which layers {self.source} has; pass layers=[...]")
        out = tuple(int(n) for n in layers)
        if self.release is not None:
            for n in out:
                self.release.check_layer(n)
        return out

    # ---------------------------------------------------------------- mapping-like access
    @property
    def layers(self) -> tuple[int, ...]:
        """Layers this bank can serve."""
        return self._layers

    @property
    def loaded(self) -> list[int]:
        """Resident layers, least recently used first."""
        with self._lock:
            return list(self._resident)

    @property
    def nbytes(self) -> int:
        """Bytes of weights currently resident."""
        with self._lock:
            return sum(_nbytes(s) for s in self._resident.values())

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterator[int]:
        return iter(self._layers)

    def __contains__(self, layer: object) -> bool:
        return layer in self._layers

    def __getitem__(self, layer: int) -> TopKSAE:
        return self.get(layer)

    def get(self, layer: int) -> TopKSAE:
        """The SAE of ``layer``, loading it (and evicting LRU layers) if it is not resident."""
        if layer not in self._layers:
            raise KeyError(f"layer {layer!r} is not in this bank ({self.source}); it serves layers "
                           f"{list(self._layers)}")
        with self._lock:
            if layer in self._resident:
                self.hits += 1
                self._resident.move_to_end(layer)
                return self._resident[layer]
            self.misses += 1
            self._make_room(self._layer_bytes or self._estimate_bytes(), adding=True)
            sae = load(self.source, layer, **self._load_kwargs)
            self._layer_bytes = _nbytes(sae)
            self._resident[layer] = sae
            self._make_room(0, adding=False)
            return sae

    def _estimate_bytes(self) -> int:
        r = self.release
        if r is None or r.file_bytes is None:
            return 0
        dtype = self._load_kwargs.get("dtype") or torch.float32
        return r.file_bytes // 4 * torch.empty((), dtype=dtype).element_size()

    def _make_room(self, incoming: int, adding: bool) -> None:
        """Evict LRU layers until ``incoming`` more bytes (and a layer, if ``adding``) fit; the newest stays."""
        while len(self._resident) > (0 if adding else 1):
            over_layers = self.max_layers is not None and len(self._resident) + adding > self.max_layers
            over_bytes = self.max_bytes is not None and self.nbytes + incoming > self.max_bytes
            if not (over_layers or over_bytes):
                break
            self._resident.popitem(last=False)
            self.evictions += 1

    def evict(self, layer: int | None = None) -> None:
        """Drop ``layer`` (or every layer when ``None``) from memory."""
        with self._lock:
            if layer is None:
                self._resident.clear()
            else:
                self._resident.pop(layer, None)

    def preload(self, layers: Iterable[int]) -> None:
        """Load ``layers`` now (subject to the bounds: later ones may evict earlier ones)."""
        for n in layers:
            self.get(n)

    def path(self, layer: int):
        """The file ``layer`` would be loaded from (resolves through the hub cache; loads nothing)."""
        kwargs = {k: self._load_kwargs[k] for k in ("revision", "cache_dir", "k") if k in self._load_kwargs}
        return resolve(self.source, layer, **kwargs)[0]

    def __repr__(self) -> str:
        name = self.release.id if self.release is not None else str(self.source)
        return (f"SAEBank({name}, layers={len(self._layers)}, loaded={self.loaded}, nbytes={self.nbytes}, "
                f"max_bytes={self.max_bytes}, max_layers={self.max_layers})")
