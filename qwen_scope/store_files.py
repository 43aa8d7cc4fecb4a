"""The activation store's files: the writer lock, the temp folder, atomic JSON, safetensors written by us, hashes.

Every temporary file of a store lives in ``<store>/.tmp/`` under a unique name (owner, pid, random token), so a
kill at any moment leaves nothing outside it and the next writer sweeps it. Files are created with ``open``'s
default mode, so the user's umask decides who can read them (a group-shared store stays group-readable); the
safetensors library's own writer creates a 0600 temp file next to the target, which is why shards are serialised
here instead.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import secrets
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FORMAT = "qwen-scope-activations"
VERSION = 2  # 2: compact SAE indices (uint16 low bits + packed high bits); 1 (int32 indices) is still read
MANIFEST = "manifest.json"
SHARD_NAME = "rank{rank:03d}/shard-{index:06d}.safetensors"
TMP = ".tmp"
LOCK = ".lock"


def config_hash(config: dict) -> str:
    """Stable sha256 (first 16 hex digits) of a JSON-able config dict."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- temp folder
def temp_path(root: Path, owner: str, name: str) -> Path:
    """A fresh temp file name in ``root/.tmp/`` (created): ``{owner}-{name}.{pid}-{token}.tmp``."""
    folder = Path(root) / TMP
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{owner}-{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def sweep_temp(root: Path, owner: str | None = None) -> list[Path]:
    """Delete the temp files of ``owner`` (all of them when None) and stray temps of older layouts; return them."""
    root = Path(root)
    pattern = "*" if owner is None else f"{owner}-*"
    stray = list((root / TMP).glob(pattern))
    if owner is None:
        # where earlier writers and safetensors' own writer left theirs (".shard-…tmp-PID", ".tmpXXXXXX")
        stray += list(root.glob(".*.tmp-*")) + list(root.glob("rank*/.*tmp*")) + list(root.glob("index/.*tmp*"))
    for p in stray:
        p.unlink(missing_ok=True)
    return stray


def atomic_write_json(path: Path, obj: dict, *, root: Path | None = None, owner: str = "store") -> None:
    """Write ``obj`` as JSON to ``path`` via a temp file in ``root/.tmp/`` (root: the store, default the file's
    folder), fsync and rename: readers see the old file or the new one, never half of one."""
    path = Path(path)
    tmp = temp_path(path.parent if root is None else root, owner, path.name)
    try:
        with open(tmp, "x") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


# ---------------------------------------------------------------------------------------------- safetensors
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "bool": "BOOL"}


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Serialise CPU ``tensors`` in the safetensors format to ``path`` (created with the umask's mode), fsynced.

    The tensors' bytes go to the file straight from their memory (no serialised copy of a ~1 GiB shard). Tensors
    are laid out by name, so the same tensors always give the same bytes.
    """
    import torch

    header, offset, items = {}, 0, sorted(tensors.items())
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "xb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, t in items:
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


_HASH_BLOCK = 1 << 26
_hash_pool: ThreadPoolExecutor | None = None


def file_sha256(path: Path) -> str:
    """Block-tree sha256 of a file: sha256 over the sha256 digests of its 64 MiB blocks, hashed in parallel threads.

    A multi-GB shard hashes at memory speed instead of one core's sha256 rate; the reader recomputes the same.
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


# ---------------------------------------------------------------------------------------------- the lock
class StoreBusyError(ValueError):
    """Another live process holds the writer lock of this store (or of this rank's folder)."""


class StoreLock:
    """An exclusive writer lock on a folder: ``flock`` on ``<folder>/.lock``, which records the holder.

    The kernel drops the lock when the holder exits or is killed, so a crashed run never blocks the next. Where the
    filesystem has no ``flock``, the lock file is created exclusively instead and a holder that is gone (its pid no
    longer alive on this host) is detected as stale and replaced.

    Args:
        folder: the folder to lock (created). what: how the error names the writer (e.g. ``"collect"``).
    Raises:
        StoreBusyError: a live holder; the message names its pid, host, start time and command.
    """

    def __init__(self, folder: str | os.PathLike, what: str = "collect"):
        self.path = Path(folder) / LOCK
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._exclusive = False
        self.what = what
        self._acquire()

    def _acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusyError(self._busy_message(_read_holder(self.path))) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            self._acquire_exclusive()
            return
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_holder()).encode())
        self._fd = fd

    def _acquire_exclusive(self) -> None:
        path = self.path.with_name(LOCK + ".pid")
        for _ in range(2):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                holder = _read_holder(path)
                if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
                    path.unlink(missing_ok=True)  # stale: its writer died without releasing it
                    continue
                raise StoreBusyError(self._busy_message(holder, path)) from None
            os.write(fd, json.dumps(_holder()).encode())
            self._fd, self._exclusive, self.path = fd, True, path
            return
        raise StoreBusyError(self._busy_message(_read_holder(path), path))

    def _busy_message(self, holder: dict, path: Path | None = None) -> str:
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}, running "
               f"{holder.get('argv')!r}") if holder else "another process"
        hint = f" (delete {path} if that run is gone)" if path is not None and holder.get("host") != \
            socket.gethostname() else ""
        return (f"{self.path.parent} is being written by another {self.what} run ({who}){hint}; wait for it to "
                f"finish, or write to another --out")

    def release(self) -> None:
        if self._fd is None:
            return
        if self._exclusive:
            self.path.unlink(missing_ok=True)
        else:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _holder() -> dict:
    import sys

    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": " ".join(sys.argv)[:200]}


def _read_holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
