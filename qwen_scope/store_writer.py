"""Writing the activation store: shard files written atomically, per-rank progress, and the merged manifest.

The layout and the crash-safety contract are described in ``qwen_scope.store`` (the reader). A shard file is written
to a temporary name, fsynced and renamed; only then is it recorded in ``rank{r}/progress.json`` (also temp + rename).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMAT = "qwen-scope-activations"
VERSION = 1
MANIFEST = "manifest.json"


# ---------------------------------------------------------------------------------------------- file helpers
def config_hash(config: dict) -> str:
    """Stable sha256 (first 16 hex digits) of a JSON-able config dict."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file, fsync and rename (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


_HASH_BLOCK = 1 << 26
_hash_pool: ThreadPoolExecutor | None = None


def file_sha256(path: Path) -> str:
    """Block-tree sha256 of a file: sha256 over the sha256 digests of its 64 MiB blocks, hashed in parallel threads.

    A multi-GB shard hashes at memory speed instead of one core's sha256 rate; ``verify`` recomputes the same.
    """
    global _hash_pool
    if _hash_pool is None:
        _hash_pool = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="sha256")
    size = os.path.getsize(path)
    if size == 0:
        return hashlib.sha256(b"").hexdigest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            digests = _hash_pool.map(lambda a: hashlib.sha256(view[a:a + _HASH_BLOCK]).digest(),
                                     range(0, size, _HASH_BLOCK))
            return hashlib.sha256(b"".join(digests)).hexdigest()
        finally:
            view.release()


def _write_shard_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return digest, path.stat().st_size


# ---------------------------------------------------------------------------------------------- writer
class ShardWriter:
    """Writes one rank's shards and its ``progress.json``; knows where a previous run of the same config stopped.

    Args:
        out_dir: store directory (created).
        config: JSON-able dict that fully determines the content (model, points, corpus, packing, ...); its hash
            guards resume: a different config in the same ``out_dir`` is an error unless ``overwrite=True``.
        rank, world_size: this process's rank and the number of ranks.
        overwrite: discard this rank's previous progress instead of resuming.
        workers: background threads writing shard files (the caller keeps computing meanwhile).
        max_pending: shards in flight before ``write`` blocks (bounds host memory).

    After construction, ``cursor`` is the opaque resume state passed with the last complete shard (``None`` for a
    fresh run), and ``n_rows`` / ``n_tokens`` / ``n_pad`` count what is already on disk.
    """

    def __init__(self, out_dir: str | os.PathLike, config: dict, *, rank: int = 0, world_size: int = 1,
                 overwrite: bool = False, workers: int = 2, max_pending: int = 2):
        self.root = Path(out_dir)
        self.dir = self.root / f"rank{rank:03d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config, self.hash = config, config_hash(config)
        self.rank, self.world_size = rank, world_size
        self.progress_path = self.dir / "progress.json"
        for stale in self.dir.glob(".*.tmp-*"):
            stale.unlink(missing_ok=True)
        state = self._load_previous(overwrite)
        self.shards: list[dict] = state.get("shards", [])
        self.complete: bool = state.get("complete", False)
        self.stats: dict = state.get("stats", {})
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"shard-writer-{rank}")
        self._pending: list[tuple[Future, dict]] = []
        self.max_pending = max_pending

    def _load_previous(self, overwrite: bool) -> dict:
        if overwrite:
            for old in self.dir.glob("shard-*.safetensors"):
                old.unlink()
            self.progress_path.unlink(missing_ok=True)
        if not self.progress_path.exists():
            return {}
        state = json.loads(self.progress_path.read_text())
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

    def write(self, tensors: dict[str, torch.Tensor], *, n_rows: int, n_pad: int, cursor: dict) -> None:
        """Queue one shard (CPU tensors, ``token_ids [n]`` included); record it once its file is renamed into place.

        Args:
            tensors: ``token_ids``, ``doc_index``, ``positions`` ``[n]`` and ``dense.{point}`` / ``sae.{point}.*``.
            n_rows: packed rows in this shard; n_pad: padding tokens they carried (not stored).
            cursor: resume state after this shard (JSON-able), handed back by ``cursor`` on resume.
        """
        index = len(self.shards) + len(self._pending)
        name = f"shard-{index:06d}.safetensors"
        record = {"file": f"{self.dir.name}/{name}", "index": index, "n_tokens": int(tensors["token_ids"].numel()),
                  "n_rows": n_rows, "n_pad": n_pad, "cursor": cursor}
        # One metadata key: safetensors writes its metadata map in arbitrary order, and shards should be
        # byte-identical however often a run was interrupted.
        meta = {FORMAT: json.dumps({"config_hash": self.hash, "rank": self.rank, "index": index}, sort_keys=True)}
        self._pending.append((self._pool.submit(_write_shard_file, self.dir / name, tensors, meta), record))
        self._commit(block=len(self._pending) > self.max_pending)

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
        """Flush, mark this rank complete and store ``stats`` (JSON-able) in its progress file."""
        self.flush()
        self.complete = True
        self.stats = dict(stats or {})
        self._save()
        self._pool.shutdown()

    def close(self) -> None:
        self.flush()
        self._pool.shutdown()

    def _save(self) -> None:
        atomic_write_json(self.progress_path, {
            "format": FORMAT, "version": VERSION, "config_hash": self.hash, "config": self.config,
            "rank": self.rank, "world_size": self.world_size, "complete": self.complete,
            "shards": self.shards, "stats": self.stats})


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
    states = [json.loads(p.read_text()) for p in ranks]
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
        "format": FORMAT, "version": VERSION, "config_hash": first["config_hash"], "config": config,
        **{k: config.get(k) for k in ("model", "points", "sae", "context_len", "bos_policy", "store_dtype")},
        "world_size": first["world_size"], "complete": complete, "n_tokens": start, "n_rows": n_rows,
        "n_pad": n_pad, "padding_fraction": n_pad / max(1, n_pad + start), "shards": shards,
        "rank_stats": [s.get("stats", {}) for s in states]}
    if write:
        atomic_write_json(root / MANIFEST, manifest)
    return manifest
