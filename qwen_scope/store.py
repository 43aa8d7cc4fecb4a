"""The activation store: sharded safetensors + a JSON manifest, written atomically, read memory-mapped and verified.

Layout of a store directory::

    manifest.json                      # merged view: config + hash, every shard (file, start, tokens, sha256)
    .lock                              # the writer lock (held by rank 0 of a collect run)
    .tmp/                              # every temp file of writers and readers (swept when a writer starts)
    rank000/.lock                      # the rank's writer lock
    rank000/progress.json              # per-rank bookkeeping, the resume point (rewritten after every shard)
    rank000/verified.json              # sha256 of shards already checked, by file identity (inode, size, mtime)
    rank000/shard-000000.safetensors   # token_ids [n], doc_index [n], positions [n], and per point:
                                       #   dense.{point} [n, d_model]; sae.{point}.values [n, k] (store dtype),
                                       #   sae.{point}.indices [n, k] uint16 (+ .indices_high, packed high bits,
                                       #   when d_sae > 65536; int32 in stores of format version 1)

Store order is rank 0's shards, then rank 1's, ...; a token's global offset is its index in that order. A shard file
is written to a temporary name, fsynced and renamed; only then is it recorded in ``progress.json`` (also written
temp + rename). A shard that is on disk but not recorded is rewritten on resume, so a SIGKILL at any moment loses at
most the shard in flight and never duplicates one. ``ActivationStore`` reads ``manifest.json`` or, while a run is
still going (no manifest yet), merges the progress files on the fly. Opening checks the manifest, a shard's first
read checks its header and (unless ``verify=False``) its sha256, once per file identity (``qwen_scope.store_check``).

Example:
    >>> store = ActivationStore("acts/")
    >>> for start, codes in store.iter_chunks("resid_post.12", kind="sae"):
    ...     print(start, codes.values.shape)               # SparseCodes [n, k]
    >>> x = store.dense("resid_post.12", 0, 1024)          # [1024, d_model]
    >>> for batch in store.iter_shuffled("resid_post.12", batch_size=4096, buffer_tokens=2**20, seed=0): ...
"""
from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from saes import SparseCodes
from qwen_scope.store_check import (VerifyCache, check_against_progress, check_manifest, check_shard,
                                    damaged_message, REPAIR)
from qwen_scope.store_files import MANIFEST, temp_path, write_safetensors
from qwen_scope.store_writer import merge_manifest, unpack_indices


# ---------------------------------------------------------------------------------------------- reader
@dataclass(frozen=True)
class FeatureIndex:
    """Per-feature statistics and top activations of one SAE point, for top-k mining.

    Attributes:
        counts: ``[d_sae]`` int64, tokens where the feature is active (value > 0).
        sums: ``[d_sae]`` float64, sum of its activations (mean = sums / counts).
        top_values: ``[d_sae, top_n]`` float32, largest activations, descending (0 where fewer exist).
        top_offsets: ``[d_sae, top_n]`` int64, their global token offsets (-1 where fewer exist).
        n_tokens: tokens scanned.
    """

    counts: torch.Tensor
    sums: torch.Tensor
    top_values: torch.Tensor
    top_offsets: torch.Tensor
    n_tokens: int

    def top(self, feature: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(offsets [m], values [m])`` of the feature's strongest activations, descending (m <= n)."""
        keep = self.top_offsets[feature] >= 0
        return self.top_offsets[feature][keep][:n], self.top_values[feature][keep][:n]

    @property
    def frequency(self) -> torch.Tensor:
        """``[d_sae]`` fraction of tokens on which each feature fires."""
        return self.counts.double() / max(1, self.n_tokens)


class ActivationStore:
    """Read a store written by ``qwen_scope.collect``: memory-mapped shards, chunked and shuffled iteration.

    Args:
        path: the store directory (``manifest.json``, or the ``rank*/progress.json`` of a run still going).
        verify: check each shard's sha256 against the manifest on its first read (default; a shard already
            checked and unchanged since costs a ``stat``). False reads shards unchecked; the manifest and the shard
            headers are checked either way.
        max_open: shard files kept memory-mapped at once.

    Attributes:
        manifest: dict (model, points, sae, context_len, bos_policy, n_tokens, shards, ...).
        points: names of the stored hook points (canonical, e.g. ``"resid_post.12"``).
        n_tokens: tokens in store order (global offsets run ``0 .. n_tokens-1``).
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, max_open: int = 32):
        self.root = Path(path)
        manifest_path = self.root / MANIFEST
        if manifest_path.exists():
            try:
                self.manifest = json.loads(manifest_path.read_text())
            except ValueError as err:
                raise ValueError(f"{manifest_path} is not valid JSON ({err}); rerun the same collect command to "
                                 f"merge it again from the rank progress files") from None
            check_manifest(self.root, self.manifest)
            if any(self.root.glob("rank*/progress.json")):
                check_against_progress(self.root, self.manifest, merge_manifest(self.root, write=False))
        else:
            self.manifest = merge_manifest(self.root, write=False)
            check_manifest(self.root, self.manifest)
        self.shards = self.manifest["shards"]
        self._starts = [s["start"] for s in self.shards]
        self._handles: dict[int, object] = {}
        self._max_open = max_open
        self._meta_cache: dict[str, torch.Tensor] = {}
        self._verify = verify
        self._checked: set[int] = set()
        self._caches: dict[str, VerifyCache] = {}

    # ------------------------------------------------------------------ description
    @property
    def points(self) -> list[str]:
        return list(self.manifest["points"])

    @property
    def n_tokens(self) -> int:
        return self.manifest["n_tokens"]

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (f"ActivationStore({str(self.root)!r}, model={self.manifest.get('model')!r}, "
                f"n_tokens={self.n_tokens}, points={self.points}, complete={self.manifest.get('complete')})")

    def point_info(self, point: str) -> dict:
        """What is stored for ``point``: ``{"dense": bool, "d_model": int, "sae": {release, layer, k, d_sae}|None}``."""
        points = self.manifest["points"]
        if point not in points:
            raise KeyError(f"point {point!r} is not in the store at {self.root}; stored points: {list(points)}")
        return points[point]

    def verify(self) -> None:
        """Check every shard now (header and sha256); raise ``ValueError`` naming the first damaged one."""
        for i in range(len(self.shards)):
            self._handle(i, sha256=True)

    # ------------------------------------------------------------------ raw reads
    def _handle(self, i: int, sha256: bool | None = None):
        if i not in self._handles:
            if len(self._handles) >= self._max_open:
                self._handles.pop(next(iter(self._handles)))
            record = self.shards[i]
            path = self.root / record["file"]
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard {i} of the store is missing; {REPAIR}")
            if (self._verify if sha256 is None else sha256) and i not in self._checked:
                cache = self._caches.setdefault(path.parent.name, VerifyCache(path.parent))
                got = cache.sha256(path)
                cache.save()
                if got != record["sha256"]:
                    raise ValueError(damaged_message(path, got, record["sha256"]))
                self._checked.add(i)
            handle = safe_open(str(path), framework="pt")
            check_shard(self.root, record, handle.metadata(), handle.get_slice("token_ids").get_shape()[0],
                        self.manifest["config_hash"])
            self._handles[i] = handle
        return self._handles[i]

    def _read(self, key: str, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside the store's [0, {self.n_tokens})")
        parts, i = [], max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self.shards) and self._starts[i] < stop:
            s0 = self._starts[i]
            a, b = max(start, s0) - s0, min(stop, s0 + self.shards[i]["n_tokens"]) - s0
            if b > a:
                parts.append(self._handle(i).get_slice(key)[a:b])
            i += 1
        if not parts:
            if not self.shards:
                raise ValueError(f"the store at {self.root} holds no shards yet")
            return self._handle(0).get_slice(key)[0:0]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _meta(self, key: str) -> torch.Tensor:
        if key not in self._meta_cache:
            self._meta_cache[key] = self._read(key, 0, self.n_tokens).long()
        return self._meta_cache[key]

    def token_ids(self) -> torch.Tensor:
        """All token ids in store order: LongTensor ``[N]``."""
        return self._meta("token_ids")

    def doc_index(self) -> torch.Tensor:
        """Corpus index of each token's document: LongTensor ``[N]``."""
        return self._meta("doc_index")

    def positions(self) -> torch.Tensor:
        """Each token's position in the context the model saw (0 = first token of a packed row): LongTensor ``[N]``."""
        return self._meta("positions")

    def dense(self, point: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Dense activations of ``point`` for tokens ``[start, stop)``: ``[n, d_model]`` in the stored dtype."""
        if not self.point_info(point)["dense"]:
            raise ValueError(f"point {point!r} has SAE codes but no dense activations in {self.root}; use "
                             f"sae_codes()/feature_acts(), or collect again with points=[{point!r}]")
        return self._read(f"dense.{point}", start, self.n_tokens if stop is None else stop)

    def sae_codes(self, point: str, start: int = 0, stop: int | None = None) -> SparseCodes:
        """SAE codes of ``point`` for tokens ``[start, stop)``: ``SparseCodes(values [n, k], indices [n, k] int64)``."""
        if not self.point_info(point)["sae"]:
            raise ValueError(f"point {point!r} has no SAE codes in {self.root}; points with codes: "
                             f"{[p for p, i in self.manifest['points'].items() if i['sae']]}")
        stop = self.n_tokens if stop is None else stop
        layout = self.point_info(point)["sae"].get("index_layout", "int32")
        high = self._read(f"sae.{point}.indices_high", start, stop) if "+" in layout else None
        return SparseCodes(self._read(f"sae.{point}.values", start, stop),
                           unpack_indices(self._read(f"sae.{point}.indices", start, stop), high, layout))

    def feature_acts(self, point: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """SAE codes back to dense feature activations: ``[n, d_sae]`` (dtype of the stored values)."""
        return self.sae_codes(point, start, stop).to_dense(self.point_info(point)["sae"]["d_sae"])

    def _payload(self, point: str, kind: str, start: int, stop: int):
        return self.dense(point, start, stop) if kind == "dense" else self.sae_codes(point, start, stop)

    def _kind(self, point: str, kind: str | None) -> str:
        info = self.point_info(point)
        kind = kind or ("sae" if info["sae"] else "dense")
        if kind not in ("sae", "dense"):
            raise ValueError(f"kind must be 'sae' or 'dense', got {kind!r}")
        return kind

    # ------------------------------------------------------------------ iteration
    def iter_chunks(self, point: str, kind: str | None = None, chunk_tokens: int = 65536
                    ) -> Iterator[tuple[int, torch.Tensor | SparseCodes]]:
        """Yield ``(start, payload)`` over the whole store in order, chunks never crossing a shard.

        Args:
            point: a stored point; kind: ``"sae"`` (SparseCodes ``[n, k]``) or ``"dense"`` (``[n, d_model]``);
                default: codes if stored, else dense. chunk_tokens: at most this many tokens per chunk.
        """
        kind = self._kind(point, kind)
        for s in self.shards:
            for a in range(0, s["n_tokens"], chunk_tokens):
                start = s["start"] + a
                yield start, self._payload(point, kind, start, min(start + chunk_tokens, s["start"] + s["n_tokens"]))

    def iter_shuffled(self, point: str, batch_size: int, buffer_tokens: int = 1 << 20, seed: int = 0, *,
                      kind: str = "dense", dtype: torch.dtype | None = None, drop_last: bool = False
                      ) -> Iterator[torch.Tensor | SparseCodes]:
        """Shuffled training batches, every token exactly once per call (one epoch).

        Pieces of ``buffer_tokens // 16`` tokens are read in a random order into a buffer of ~``buffer_tokens``,
        which is permuted and cut into batches; the remainder carries into the next buffer.

        Args:
            point: a stored point. batch_size: tokens per batch. buffer_tokens: shuffle buffer size (memory bound).
            seed: the order is a function of the seed alone. kind: ``"dense"`` (``[batch_size, d_model]``) or
                ``"sae"`` (SparseCodes). dtype: cast dense batches (e.g. ``torch.float32``). drop_last: drop the
                final short batch.
        """
        kind = self._kind(point, kind)
        piece = max(1, buffer_tokens // 16)
        pieces = [(s["start"] + a, s["start"] + min(a + piece, s["n_tokens"]))
                  for s in self.shards for a in range(0, s["n_tokens"], piece)]
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(pieces), generator=g).tolist()
        carry: list[tuple[torch.Tensor, ...]] = []
        n_carry = 0
        for j, p in enumerate(order):
            payload = self._payload(point, kind, *pieces[p])
            carry.append(tuple(payload) if kind == "sae" else (payload,))
            n_carry += pieces[p][1] - pieces[p][0]
            if n_carry < buffer_tokens and j < len(order) - 1:
                continue
            perm = torch.randperm(n_carry, generator=g)
            buf = [torch.cat(cols)[perm] for cols in zip(*carry)]
            n_full = n_carry // batch_size * batch_size
            for a in range(0, n_full, batch_size):
                yield self._batch(kind, [t[a:a + batch_size] for t in buf], dtype)
            carry, n_carry = [tuple(t[n_full:] for t in buf)], n_carry - n_full
        if n_carry and not drop_last:
            yield self._batch(kind, list(carry[0]), dtype)

    @staticmethod
    def _batch(kind: str, cols: list[torch.Tensor], dtype: torch.dtype | None):
        if kind == "sae":
            return SparseCodes(*cols)
        return cols[0] if dtype is None else cols[0].to(dtype)

    # ------------------------------------------------------------------ per-feature index
    def feature_index(self, point: str, top_n: int = 32, *, chunk_tokens: int = 65536, cache: bool = True
                      ) -> FeatureIndex:
        """Per-feature counts, sums and the ``top_n`` strongest activations (global offsets), in one pass.

        Cached in ``<store>/index/`` keyed by the config hash and token count. Ties keep the earlier token.
        """
        info = self.point_info(point)
        if not info["sae"]:
            raise ValueError(f"feature_index needs SAE codes; point {point!r} in {self.root} has none")
        d_sae = info["sae"]["d_sae"]
        path = self.root / "index" / f"{point}.top{top_n}.safetensors"
        key = {"config_hash": self.manifest["config_hash"], "n_tokens": str(self.n_tokens)}
        if cache and path.exists():
            with safe_open(str(path), framework="pt") as f:
                if f.metadata() == key:
                    return FeatureIndex(**{k: f.get_tensor(k) for k in f.keys()}, n_tokens=self.n_tokens)
        counts = torch.zeros(d_sae, dtype=torch.long)
        sums = torch.zeros(d_sae, dtype=torch.float64)
        top_v = torch.zeros(d_sae, top_n)
        top_o = torch.full((d_sae, top_n), -1, dtype=torch.long)
        for start, codes in self.iter_chunks(point, kind="sae", chunk_tokens=chunk_tokens):
            vals, feats = codes.values.float().reshape(-1), codes.indices.reshape(-1)
            offs = (torch.arange(codes.values.shape[0]) + start).repeat_interleave(codes.values.shape[1])
            live = vals > 0
            counts += torch.bincount(feats[live], minlength=d_sae)
            sums.index_add_(0, feats[live], vals[live].double())
            live &= vals > top_v[feats, -1]
            top_v, top_o = _merge_top(top_v, top_o, feats[live], vals[live], offs[live])
        index = FeatureIndex(counts, sums, top_v, top_o, self.n_tokens)
        if cache:
            self._save_index(path, {"counts": counts, "sums": sums, "top_values": top_v, "top_offsets": top_o}, key)
        return index

    def _save_index(self, path: Path, tensors: dict[str, torch.Tensor], key: dict[str, str]) -> None:
        """Cache a feature index (best effort: a store the user cannot write to is read without the cache)."""
        tmp = None
        try:
            path.parent.mkdir(exist_ok=True)
            tmp = temp_path(self.root, "index", path.name)
            write_safetensors(tmp, tensors, key)
            os.replace(tmp, path)
        except OSError:
            pass
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)


def _merge_top(top_v: torch.Tensor, top_o: torch.Tensor, feats: torch.Tensor, vals: torch.Tensor,
               offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge candidate (feature, value, offset) triples into per-feature top tables ``[d_sae, top_n]``."""
    if feats.numel() == 0:
        return top_v, top_o
    d_sae, top_n = top_v.shape
    have = top_o.reshape(-1) >= 0
    all_f = torch.cat([torch.arange(d_sae).repeat_interleave(top_n)[have], feats])
    all_v = torch.cat([top_v.reshape(-1)[have], vals])
    all_o = torch.cat([top_o.reshape(-1)[have], offs])
    # Sort by (feature asc, value desc, offset asc): stable sorts from the least significant key up.
    order = torch.argsort(all_o, stable=True)
    order = order[torch.argsort(all_v[order], descending=True, stable=True)]
    order = order[torch.argsort(all_f[order], stable=True)]
    f, v, o = all_f[order], all_v[order], all_o[order]
    rank = torch.arange(f.numel()) - torch.searchsorted(f, f)
    keep = rank < top_n
    new_v = torch.zeros_like(top_v)
    new_o = torch.full_like(top_o, -1)
    new_v[f[keep], rank[keep]] = v[keep]
    new_o[f[keep], rank[keep]] = o[keep]
    return new_v, new_o
