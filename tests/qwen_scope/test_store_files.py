"""The store's files: one writer at a time (a second gets one error naming the first; a killed holder frees the
lock; a stale pid lock is taken over where there is no flock), temp files only in ``.tmp/`` and swept, files
created with the user's umask, safetensors written by us read by the library."""
from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qwen_scope import store_files
from qwen_scope.store_files import StoreBusyError, StoreLock, sweep_temp, write_safetensors
from qwen_scope.store_writer import ShardWriter
from tests.qwen_scope.test_store import _config, _write

REPO = Path(__file__).resolve().parents[2]
# The holder loads store_files.py alone (stdlib only): importing the package would take seconds.
HOLD = ("import importlib.util, time; spec = importlib.util.spec_from_file_location('store_files', {path!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); lock = m.StoreLock({folder!r}); "
        "print('locked', flush=True); time.sleep(60)")


def _holder(folder: Path) -> subprocess.Popen:
    """A process holding the writer lock of ``folder`` until killed."""
    code = HOLD.format(path=str(REPO / "qwen_scope" / "store_files.py"), folder=str(folder))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_gets_one_error_naming_the_first_and_a_killed_holder_frees_the_lock(tmp_path):
    proc = _holder(tmp_path / "rank000")
    try:
        with pytest.raises(StoreBusyError, match=rf"rank000 is being written by another collect run \(pid "
                                                 rf"{proc.pid} on {socket.gethostname()}.*another --out"):
            ShardWriter(tmp_path, _config())
        assert isinstance(StoreBusyError("x"), ValueError)  # the CLI prints it as one line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    _write(tmp_path, [16])  # the kernel released the dead holder's lock
    assert (tmp_path / "rank000" / "progress.json").exists()


def test_one_process_cannot_open_two_writers_on_one_rank(tmp_path):
    first = ShardWriter(tmp_path, _config())
    with pytest.raises(StoreBusyError, match=f"pid {os.getpid()}"):
        ShardWriter(tmp_path, _config())
    first.close()
    ShardWriter(tmp_path, _config()).close()


def test_without_flock_a_stale_pid_lock_is_taken_over_and_a_live_one_refused(tmp_path, monkeypatch):
    def no_flock(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(store_files.fcntl, "flock", no_flock)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid_file = tmp_path / ".lock.pid"
    pid_file.write_text(f'{{"pid": {int(dead.stdout)}, "host": "{socket.gethostname()}"}}')
    lock = StoreLock(tmp_path)
    assert f'"pid": {os.getpid()}' in pid_file.read_text()
    with pytest.raises(StoreBusyError, match=f"pid {os.getpid()}"):
        StoreLock(tmp_path)
    lock.release()
    assert not pid_file.exists()
    pid_file.write_text('{"pid": 1, "host": "elsewhere"}')  # another host's: alive as far as we can tell
    with pytest.raises(StoreBusyError, match=r"pid 1 on elsewhere.*\(delete .*\.lock\.pid if that run is gone\)"):
        StoreLock(tmp_path)


def test_temp_files_live_in_the_store_temp_folder_and_are_swept(tmp_path):
    _write(tmp_path, [16, 16])
    tmp = tmp_path / ".tmp"
    # what kills at various moments leave: this rank's shard temp, another rank's, a manifest temp, and the
    # temp files of earlier writers (".shard-...tmp-PID") and of safetensors' own writer (".tmpXXXXXX")
    planted = [tmp / "rank000-shard-000002.safetensors.123-ab.tmp", tmp / "rank001-progress.json.9-cd.tmp",
               tmp / "store-manifest.json.5-ef.tmp", tmp_path / "rank000" / ".shard-000002.safetensors.tmp-77",
               tmp_path / "rank000" / ".tmpAb12Cd", tmp_path / ".manifest.json.tmp-5"]
    for p in planted:
        p.write_bytes(b"partial")
    ShardWriter(tmp_path, _config()).close()
    left = sorted(p.name for p in planted if p.exists())
    assert left == [".manifest.json.tmp-5", "rank001-progress.json.9-cd.tmp", "store-manifest.json.5-ef.tmp"]
    assert sorted(p.name for p in sweep_temp(tmp_path)) == left
    assert not any(p.exists() for p in planted)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["rank000/.lock", "rank000/progress.json", "rank000/shard-000000.safetensors",
                     "rank000/shard-000001.safetensors", "rank000/verified.json"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o007, 0o660)])
def test_store_files_are_created_with_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        _write(tmp_path, [16, 16])
        from qwen_scope.store import ActivationStore
        from qwen_scope.store_writer import merge_manifest

        merge_manifest(tmp_path)
        ActivationStore(tmp_path).feature_index("resid_post.1", top_n=2)
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"manifest.json", "progress.json", "shard-000000.safetensors",
                                       "resid_post.1.top2.safetensors"}
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(mode)}
    assert {oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*") if p.is_dir()} == {oct(0o777 & ~umask)}


def test_write_safetensors_is_read_by_safetensors_and_depends_only_on_the_tensors(tmp_path):
    tensors = {"b": torch.randn(5, 3).bfloat16(), "a": torch.arange(7, dtype=torch.int32),
               "u": torch.arange(6).to(torch.uint16).reshape(2, 3), "empty": torch.zeros(0, 4),
               "t": torch.arange(12.0).reshape(3, 4).t()}
    write_safetensors(tmp_path / "x.safetensors", tensors, {"k": "v"})
    write_safetensors(tmp_path / "y.safetensors", dict(reversed(list(tensors.items()))), {"k": "v"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "y.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        write_safetensors(tmp_path / "x.safetensors", tensors)  # temp names are fresh: never written twice
