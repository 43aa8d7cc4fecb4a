"""Checking the activation store: manifest invariants, shard headers, sha256 verification remembered by file
identity, and the damage scan a rerun of ``collect`` makes.

What is checked, and when:

- the manifest, on every open (free): known format and version, the config hash of its config, every shard file
  named ``rank{r}/shard-{i}`` (so inside the store), shards in (rank, index) order with contiguous starts, the
  total token count, and agreement with the rank progress files it was merged from;
- a shard's header, on its first open (free): the config hash, rank and index it was written with, its token count;
- a shard's sha256, on its first open unless ``verify=False``: hashed once, then remembered by (device, inode,
  size, mtime) in ``rank{r}/verified.json`` and in the process, so opening the store again costs a ``stat``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from qwen_scope.store_files import FORMAT, MANIFEST, SHARD_NAME, atomic_write_json, config_hash, file_sha256

READ_VERSIONS = (1, 2)
REPAIR = "rerun the same collect command with --repair (repair=True) to recompute it"
# File timestamps come from a coarse clock (one kernel tick, up to 10 ms): a hash remembered less than this after the
# file's mtime could miss a later write in the same tick, so it is not trusted and the next open hashes again.
_TICK_NS = 100_000_000
_VERIFIED: dict[tuple, tuple[str, int]] = {}  # (dev, ino, size, mtime_ns) -> (sha256, when it was remembered)


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class VerifyCache:
    """The sha256 of one rank's shard files, remembered by file identity (``rank{r}/verified.json``).

    Args:
        folder: the rank folder. Readers without write access keep what they hash in the process only.
    """

    NAME = "verified.json"

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / self.NAME
        try:
            self.entries: dict = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self._dirty = False

    def sha256(self, path: Path) -> str:
        """The file's sha256: remembered when its identity is unchanged since it was hashed, else hashed now."""
        ident = _identity(path)
        known = _VERIFIED.get(ident)
        entry = self.entries.get(path.name)
        if known is None and entry and tuple(entry["identity"]) == ident:
            known = entry["sha256"], entry["at"]
        if known is not None and known[1] - ident[3] >= _TICK_NS:
            return known[0]
        digest = file_sha256(path)
        self.remember(path, digest, ident)
        return digest

    def remember(self, path: Path, digest: str, ident: tuple | None = None) -> None:
        """Record ``digest`` as the sha256 of ``path`` as it is now."""
        ident = ident or _identity(path)
        at = time.time_ns()
        _VERIFIED[ident] = digest, at
        self.entries[path.name] = {"identity": list(ident), "sha256": digest, "at": at}
        self._dirty = True

    def save(self) -> None:
        """Persist what was hashed (best effort: a read-only store keeps it in the process)."""
        if not self._dirty:
            return
        try:
            atomic_write_json(self.path, self.entries, root=self.folder.parent, owner=f"verify-{self.folder.name}")
            self._dirty = False
        except OSError:
            pass


def find_damaged(root: Path, shards: list[dict], cache: VerifyCache) -> list[tuple[int, str]]:
    """``(position, reason)`` of every recorded shard whose file is missing or differs from its record."""
    damaged = []
    for i, record in enumerate(shards):
        path = Path(root) / record["file"]
        if not path.is_file():
            damaged.append((i, "missing"))
        elif path.stat().st_size != record["bytes"]:
            damaged.append((i, f"{path.stat().st_size} bytes, recorded {record['bytes']}"))
        elif cache.sha256(path) != record["sha256"]:
            damaged.append((i, "sha256 differs from its record"))
    cache.save()
    return damaged


def check_manifest(root: Path, manifest: dict) -> None:
    """Raise ``ValueError`` naming the first broken invariant of ``manifest`` (see the module doc)."""
    where = Path(root) / MANIFEST
    fix = "rerun the same collect command: it merges the manifest again from the rank progress files"
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{where} is not a qwen-scope activation store (format {manifest.get('format')!r}, "
                         f"expected {FORMAT!r})")
    if manifest.get("version", 1) not in READ_VERSIONS:
        raise ValueError(f"{where}: store format version {manifest.get('version')}, this qwen-scope reads "
                         f"{READ_VERSIONS}; upgrade qwen-scope to read it")
    if "config" in manifest and config_hash(manifest["config"]) != manifest.get("config_hash"):
        raise ValueError(f"{where}: its config hashes to {config_hash(manifest['config'])}, its config_hash says "
                         f"{manifest.get('config_hash')}: the config was edited; {fix}")
    start, prev = 0, None
    for j, s in enumerate(manifest["shards"]):
        want = SHARD_NAME.format(rank=s["rank"], index=s["index"])
        if s["file"] != want:
            raise ValueError(f"{where}: shard {j} names file {s['file']!r}, expected {want!r} (shard files live in "
                             f"the store's rank folders); {fix}")
        follows = (s["index"] == prev[1] + 1) if prev and s["rank"] == prev[0] else \
            (s["index"] == 0 and (prev is None or s["rank"] > prev[0]))
        if not follows:
            raise ValueError(f"{where}: shard {j} is rank {s['rank']} index {s['index']}, after "
                             f"{'nothing' if prev is None else f'rank {prev[0]} index {prev[1]}'}: shards must run "
                             f"in rank order, each rank's from index 0 on; {fix}")
        if not isinstance(s["n_tokens"], int) or s["n_tokens"] < 0 or s["start"] != start:
            raise ValueError(f"{where}: shard {j} ({s['file']}) starts at {s['start']} with {s['n_tokens']} tokens; "
                             f"the shards before it end at {start}; {fix}")
        start, prev = start + s["n_tokens"], (s["rank"], s["index"])
    if manifest["n_tokens"] != start:
        raise ValueError(f"{where}: n_tokens is {manifest['n_tokens']}, its shards hold {start}; {fix}")


def check_against_progress(root: Path, manifest: dict, merged: dict) -> None:
    """The manifest's shards must be those the rank progress files record (all of them once it says complete)."""
    keys = ("file", "n_tokens", "sha256")
    recorded = {(s["rank"], s["index"]): tuple(s[k] for k in keys) for s in merged["shards"]}
    listed = {(s["rank"], s["index"]): tuple(s[k] for k in keys) for s in manifest["shards"]}
    differ = sorted(k for k in listed if recorded.get(k) != listed[k])
    if not differ and manifest.get("complete") and listed.keys() != recorded.keys():
        differ = sorted(set(recorded) ^ set(listed))
    if differ or manifest.get("config_hash") != merged["config_hash"]:
        rank, index = differ[0] if differ else (0, 0)
        raise ValueError(f"{Path(root) / MANIFEST} disagrees with the rank progress files about "
                         f"{SHARD_NAME.format(rank=rank, index=index)} (listed {listed.get((rank, index))}, recorded "
                         f"{recorded.get((rank, index))}); rerun the same collect command to merge it again")


def check_shard(root: Path, record: dict, meta: dict | None, n_tokens: int, config: str) -> None:
    """Raise ``ValueError`` when a shard's header (``meta``, its token count) is not the manifest's ``record``."""
    path = Path(root) / record["file"]
    if not path.resolve().is_relative_to(Path(root).resolve()):
        raise ValueError(f"{path} resolves to {path.resolve()}, outside the store {root}; {REPAIR}")
    try:
        got = json.loads((meta or {}).get(FORMAT, "{}"))
    except ValueError:
        got = {}
    want = {"config_hash": config, "rank": record["rank"], "index": record["index"]}
    if got != want:
        raise ValueError(f"{path}: the shard's header says {got or 'nothing'}, its record {want}: the file belongs "
                         f"to another collection or position; {REPAIR}")
    if n_tokens != record["n_tokens"]:
        raise ValueError(f"{path} holds {n_tokens} tokens, its record {record['n_tokens']}; {REPAIR}")


def damaged_message(path: Path, got: str, want: str) -> str:
    return (f"{path}: sha256 {got[:16]}... differs from the store's record {want[:16]}...: the shard is damaged; "
            f"{REPAIR} (ActivationStore(..., verify=False) reads it unchecked)")
