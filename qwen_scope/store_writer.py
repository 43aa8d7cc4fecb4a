"""Writing the activation store: shard files written atomically, per-rank progress, the merged manifest, the code
layout.

The layout and the crash-safety contract are described in ``qwen_scope.store`` (the reader). A shard file is written
to a temp file in ``<store>/.tmp/``, fsynced and renamed into ``rank{r}/``; only then is it recorded in
``rank{r}/progress.json`` (also temp + rename). Each rank's writer holds the lock of its folder while it lives.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from qwen_scope.store_check import VerifyCache, find_damaged
from qwen_scope.store_files import (FORMAT, MANIFEST, SHARD_NAME, VERSION, StoreLock, atomic_write_json,
                                    config_hash, file_sha256, fsync_dir, sweep_temp, temp_path, write_safetensors)


# ---------------------------------------------------------------------------------------------- code layout
def index_layout(d_sae: int) -> str:
    """How SAE feature indices are stored: ``"uint16"`` (d_sae <= 65536), ``"uint16+<h>"`` (the low 16 bits, plus
    ``h`` high bits bit-packed into ``indices_high``, for d_sae <= 2^24) or ``"int32"`` (wider, and stores of
    format version 1)."""
    bits = max(1, (int(d_sae) - 1).bit_length())
    return "uint16" if bits <= 16 else f"uint16+{bits - 16}" if bits <= 24 else "int32"


def code_bytes(d_sae: int, k: int, value_bytes: int = 2) -> float:
    """Bytes one stored SAE code takes (value + index) in ``index_layout(d_sae)``."""
    layout = index_layout(d_sae)
    index = 4 if layout == "int32" else 2 if layout == "uint16" else 2 + -(-k * int(layout[7:]) // 8) / k
    return value_bytes + index


def pack_indices(indices: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """``indices [n, k]`` (any integer dtype, any device) in ``layout`` (``index_layout(d_sae)``):
    ``{"indices": ...}`` and, with high bits, ``{"indices_high": [n, ceil(k * h / 8)] uint8}``."""
    if layout == "int32":
        return {"indices": indices.int()}
    # the cast keeps the low 16 bits (two's complement wrap-around); the view reads them back unsigned
    out = {"indices": indices.to(torch.int16).view(torch.uint16)}
    if layout != "uint16":
        n, k = indices.shape
        h = int(layout[7:])
        shifts = torch.arange(16, 16 + h, device=indices.device)
        bits = ((indices.long()[..., None] >> shifts) & 1).reshape(n, k * h)
        bits = F.pad(bits, (0, -(k * h) % 8)).reshape(n, -1, 8)
        out["indices_high"] = (bits << torch.arange(8, device=indices.device)).sum(-1).to(torch.uint8)
    return out


def unpack_indices(low: torch.Tensor, high: torch.Tensor | None, layout: str) -> torch.Tensor:
    """The inverse of ``pack_indices``: LongTensor ``[n, k]`` (``low`` is int32 in stores of format version 1)."""
    indices = low.long()
    if high is None or layout in ("int32", "uint16"):
        return indices
    n, k = low.shape
    h = int(layout[7:])
    bits = (high.long()[..., None] >> torch.arange(8)) & 1
    bits = bits.reshape(n, -1)[:, :k * h].reshape(n, k, h)
    return indices | (bits << torch.arange(16, 16 + h)).sum(-1)


# ---------------------------------------------------------------------------------------------- writer
class ShardWriter:
    """Writes one rank's shards and its ``progress.json``; knows where a previous run of the same config stopped.

    Args:
        out_dir: store directory (created).
        config: JSON-able dict that fully determines the content (model, points, corpus, packing, ...); its hash
            guards resume: a different config in the same ``out_dir`` is an error unless ``overwrite=True``.
        rank, world_size: this process's rank and the number of ranks.
        overwrite: discard this rank's previous progress instead of resuming.
        repair: accept recorded shards that are missing or damaged (listed in ``damaged``) for ``rewrite``;
            without it they are an error naming them.
        workers: background threads writing shard files (the caller keeps computing meanwhile).
        max_pending: shards in flight before ``write`` blocks (bounds host memory).

    After construction, ``cursor`` is the opaque resume state passed with the last complete shard (``None`` for a
    fresh run), ``n_rows`` / ``n_tokens`` / ``n_pad`` count what is already on disk and ``damaged`` lists
    ``(position in shards, reason)`` of the recorded shards whose files are missing or differ from their record.
    """

    def __init__(self, out_dir: str | os.PathLike, config: dict, *, rank: int = 0, world_size: int = 1,
                 overwrite: bool = False, repair: bool = False, workers: int = 2, max_pending: int = 2):
        self.root = Path(out_dir)
        self.dir = self.root / f"rank{rank:03d}"
        self.lock = StoreLock(self.dir)
        try:
            self.config, self.hash = config, config_hash(config)
            self.rank, self.world_size = rank, world_size
            self.progress_path = self.dir / "progress.json"
            self.owner = self.dir.name
            sweep_temp(self.root, self.owner)
            for stale in self.dir.glob(".*tmp*"):
                stale.unlink(missing_ok=True)
            state = self._load_previous(overwrite)
            self.shards: list[dict] = state.get("shards", [])
            self.complete: bool = state.get("complete", False)
            self.stats: dict = state.get("stats", {})
            self.verified = VerifyCache(self.dir)
            self.damaged = find_damaged(self.root, self.shards, self.verified)
            if self.damaged and not repair:
                raise ValueError(_damage_message(self.root, self.shards, self.damaged))
        except BaseException:
            self.lock.release()
            raise
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"shard-writer-{rank}")
        self._pending: list[tuple[Future, dict]] = []
        self.max_pending = max_pending

    def _load_previous(self, overwrite: bool) -> dict:
        if overwrite:
            for old in self.dir.glob("shard-*.safetensors"):
                old.unlink()
            self.progress_path.unlink(missing_ok=True)
            (self.dir / VerifyCache.NAME).unlink(missing_ok=True)
        if not self.progress_path.exists():
            return {}
        try:
            state = json.loads(self.progress_path.read_text())
        except ValueError as err:
            raise ValueError(f"{self.progress_path} is not valid JSON ({err}); the rank's record of its shards is "
                             f"lost: rerun with --overwrite (overwrite=True) to collect this store again") from None
        if state.get("config_hash") != self.hash:
            old = state.get("config", {})
            diff = sorted(k for k in set(old) | set(self.config) if old.get(k) != self.config.get(k))
            raise ValueError(
                f"{self.progress_path} belongs to a different collection (config hash {state.get('config_hash')}, "
                f"this run {self.hash}; differing keys: {diff}). Use a new out_dir, or overwrite=True "
                f"(--overwrite) to discard it.")
        return state

    @property
    def cursor(self) -> dict | None:
        return self.shards[-1]["cursor"] if self.shards else None

    @property
    def n_rows(self) -> int:
        return sum(s["n_rows"] for s in self.shards)

    @property
    def n_tokens(self) -> int:
        return sum(s["n_tokens"] for s in self.shards)

    @property
    def n_pad(self) -> int:
        return sum(s["n_pad"] for s in self.shards)

    def _meta(self, index: int) -> dict[str, str]:
        # One metadata key: the shard's bytes must not depend on how often a run was interrupted.
        return {FORMAT: json.dumps({"config_hash": self.hash, "rank": self.rank, "index": index}, sort_keys=True)}

    def write(self, tensors: dict[str, torch.Tensor], *, n_rows: int, n_pad: int, cursor: dict) -> None:
        """Queue one shard (CPU tensors, ``token_ids [n]`` included); record it once its file is renamed into place.

        Args:
            tensors: ``token_ids``, ``doc_index``, ``positions`` ``[n]`` and ``dense.{point}`` / ``sae.{point}.*``.
            n_rows: packed rows in this shard; n_pad: padding tokens they carried (not stored).
            cursor: resume state after this shard (JSON-able), handed back by ``cursor`` on resume.
        """
        index = len(self.shards) + len(self._pending)
        name = SHARD_NAME.format(rank=self.rank, index=index)
        record = {"file": name, "index": index, "n_tokens": int(tensors["token_ids"].numel()),
                  "n_rows": n_rows, "n_pad": n_pad, "cursor": cursor}
        future = self._pool.submit(self._write_file, name, tensors, self._meta(index))
        self._pending.append((future, record))
        self._commit(block=len(self._pending) > self.max_pending)

    def rewrite(self, position: int, tensors: dict[str, torch.Tensor], *, n_rows: int, n_pad: int,
                cursor: dict) -> None:
        """Write the recorded shard at ``position`` again (a repair) and record its new hash.

        Raises:
            ValueError: the recomputed rows are not those recorded (the corpus or the code changed).
        """
        record = self.shards[position]
        got = {"n_tokens": int(tensors["token_ids"].numel()), "n_rows": n_rows, "n_pad": n_pad, "cursor": cursor}
        want = {k: record[k] for k in got}
        if got != want:
            raise ValueError(f"{self.root / record['file']}: the recomputed shard holds {got}, its record {want}; "
                             f"the corpus no longer yields the recorded rows, so it cannot be repaired: rerun "
                             f"with --overwrite to collect the store again")
        record["sha256"], record["bytes"] = self._write_file(record["file"], tensors, self._meta(record["index"]))
        self.damaged = [d for d in self.damaged if d[0] != position]
        self._save()

    def _write_file(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict) -> tuple[str, int]:
        path = self.root / name
        tmp = temp_path(self.root, self.owner, path.name)
        try:
            write_safetensors(tmp, {k: v.contiguous() for k, v in tensors.items()}, metadata)
            digest = file_sha256(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        self.verified.remember(path, digest)
        return digest, path.stat().st_size

    def _commit(self, block: bool) -> None:
        changed = False
        while self._pending and (block or self._pending[0][0].done()):
            future, record = self._pending.pop(0)
            record["sha256"], record["bytes"] = future.result()
            self.shards.append(record)
            changed, block = True, block and len(self._pending) > self.max_pending
        if changed:
            self._save()

    def flush(self) -> None:
        """Wait for every queued shard and record it."""
        while self._pending:
            self._commit(block=True)

    def finish(self, stats: dict | None = None) -> None:
        """Flush, mark this rank complete, store ``stats`` (JSON-able) in its progress file, release the lock."""
        self.flush()
        self.complete = True
        self.stats = dict(stats or {})
        self._save()
        self.close()

    def close(self) -> None:
        """Flush, stop the writer threads and release the rank's lock."""
        try:
            self.flush()
        finally:
            self._pool.shutdown()
            self.verified.save()
            self.lock.release()

    def _save(self) -> None:
        atomic_write_json(self.progress_path, {
            "format": FORMAT, "version": VERSION, "config_hash": self.hash, "config": self.config,
            "rank": self.rank, "world_size": self.world_size, "complete": self.complete,
            "shards": self.shards, "stats": self.stats}, root=self.root, owner=self.owner)


def _damage_message(root: Path, shards: list[dict], damaged: list[tuple[int, str]]) -> str:
    listed = "; ".join(f"{shards[i]['file']} ({why})" for i, why in damaged[:5])
    more = f" and {len(damaged) - 5} more" if len(damaged) > 5 else ""
    return (f"{root}: {len(damaged)} recorded shard(s) are missing or damaged: {listed}{more}. Rerun the same "
            f"collect command with --repair (repair=True) to recompute exactly those, or --overwrite to start over")


def merge_manifest(out_dir: str | os.PathLike, *, write: bool = True) -> dict:
    """Merge every rank's ``progress.json`` into one manifest (global shard offsets, totals); write it atomically.

    Returns:
        The manifest dict (also written to ``out_dir/manifest.json`` when ``write``).
    """
    root = Path(out_dir)
    ranks = sorted(root.glob("rank*/progress.json"))
    if not ranks:
        raise FileNotFoundError(f"{root} holds no activation store (no manifest.json, no rank*/progress.json); "
                                f"run `qwen-scope collect ... --out {root}` first")
    states = []
    for p in ranks:
        try:
            states.append(json.loads(p.read_text()))
        except ValueError as err:
            raise ValueError(f"{p} is not valid JSON ({err}); rerun the collect command with --overwrite") from None
    first = states[0]
    hashes = {s["config_hash"] for s in states}
    if len(hashes) != 1:
        raise ValueError(f"{root}: rank progress files disagree on the config hash {sorted(hashes)}; "
                         f"the directory mixes two collections")
    shards, start = [], 0
    for state in sorted(states, key=lambda s: s["rank"]):
        for record in state["shards"]:
            shards.append({**record, "rank": state["rank"], "start": start})
            start += record["n_tokens"]
    n_pad, n_rows = sum(s["n_pad"] for s in shards), sum(s["n_rows"] for s in shards)
    config = first["config"]
    complete = len(states) == first["world_size"] and all(s["complete"] for s in states)
    manifest = {
        "format": FORMAT, "version": max(s.get("version", 1) for s in states), "config_hash": first["config_hash"],
        "config": config,
        **{k: config.get(k) for k in ("model", "points", "sae", "context_len", "bos_policy", "store_dtype")},
        "world_size": first["world_size"], "complete": complete, "n_tokens": start, "n_rows": n_rows,
        "n_pad": n_pad, "padding_fraction": n_pad / max(1, n_pad + start), "shards": shards,
        "rank_stats": [s.get("stats", {}) for s in states]}
    if write:
        atomic_write_json(root / MANIFEST, manifest, root=root)
    return manifest
