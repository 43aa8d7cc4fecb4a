"""Checking the store: every manifest edit is refused, a flipped byte is caught on the default read path, a hash is
remembered by file identity (re-opening is free, a changed file is hashed again), a shard of another collection is
refused by its header, and the writer finds missing, garbage and truncated shards."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from qwen_scope import store_check
from qwen_scope.store import ActivationStore
from qwen_scope.store_writer import ShardWriter, merge_manifest
from tests.qwen_scope.test_store import _config, _write

SHARD = "rank000/shard-{:06d}.safetensors"


def _age(*paths, seconds: float = 10.0) -> None:
    """Date shards back, as a shard written a while ago is (a hash remembered within one clock tick of the file's
    mtime is not trusted)."""
    for p in paths:
        t = p.stat().st_mtime_ns - int(seconds * 1e9)
        os.utime(p, ns=(t, t))


def _edit(manifest: dict, how: str) -> None:
    shards = manifest["shards"]
    if how == "total":
        manifest["n_tokens"] += 1
    elif how == "start":
        shards[1]["start"] += 1
    elif how == "shard_tokens":
        shards[1]["n_tokens"] -= 1  # and everything after it made consistent
        shards[2]["start"] -= 1
        manifest["n_tokens"] -= 1
    elif how == "swapped":
        shards[0], shards[1] = shards[1], shards[0]
        shards[0]["start"], shards[1]["start"] = 0, shards[0]["n_tokens"]
    elif how == "dropped_last":
        manifest["n_tokens"] -= shards.pop()["n_tokens"]
    elif how == "parent_path":
        shards[0]["file"] = "../elsewhere/shard-000000.safetensors"
    elif how == "absolute_path":
        shards[0]["file"] = "/etc/passwd"
    elif how == "config":
        manifest["config"]["context_len"] = 64


@pytest.mark.parametrize("how, match", [
    ("total", "n_tokens is 41, its shards hold 40"), ("start", "shard 1 .* starts at 17"),
    ("shard_tokens", "disagrees with the rank progress files about rank000/shard-000001"),
    ("swapped", "shard 0 is rank 0 index 1, after nothing"),
    ("dropped_last", "disagrees with the rank progress files about rank000/shard-000002"),
    ("parent_path", "names file '../elsewhere/shard-000000.safetensors', expected 'rank000/shard-000000"),
    ("absolute_path", "names file '/etc/passwd'"), ("config", "the config was edited")])
def test_every_manifest_edit_is_refused_on_open(tmp_path, how, match):
    _write(tmp_path, [16, 16, 8])
    merge_manifest(tmp_path)
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    _edit(manifest, how)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=match) as err:
        ActivationStore(tmp_path, verify=False)
    assert str(path) in str(err.value) and "rerun the same collect command" in str(err.value)


def test_a_flipped_byte_is_caught_on_the_default_read_path(tmp_path):
    shards = _write(tmp_path, [16, 16])
    shard = tmp_path / SHARD.format(1)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # in the last tensor's data: the header still parses
    shard.write_bytes(bytes(data))
    store = ActivationStore(tmp_path)
    assert torch.equal(store.dense("resid_post.0", 0, 16), shards[0]["dense.resid_post.0"])  # shard 0 is fine
    with pytest.raises(ValueError, match=r"shard-000001.safetensors: sha256 .* differs .* --repair"):
        store.token_ids()
    with pytest.raises(ValueError, match="sha256"):
        ActivationStore(tmp_path).verify()
    assert ActivationStore(tmp_path, verify=False).token_ids().shape == (32,)  # unchecked, on request


def test_a_hash_is_remembered_by_file_identity(tmp_path, monkeypatch):
    _write(tmp_path, [16, 16])
    _age(*tmp_path.glob("rank000/shard-*"))
    ActivationStore(tmp_path).verify()
    remembered = json.loads((tmp_path / "rank000" / "verified.json").read_text())
    assert sorted(remembered) == ["shard-000000.safetensors", "shard-000001.safetensors"]
    hashed = []
    real = store_check.file_sha256
    monkeypatch.setattr(store_check, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    store_check._VERIFIED.clear()  # a new process: only the file remembers
    ActivationStore(tmp_path).verify()
    assert hashed == []
    shard = tmp_path / SHARD.format(0)
    shard.write_bytes(shard.read_bytes())  # same bytes, new mtime: hashed again, once
    _age(shard)
    ActivationStore(tmp_path).verify()
    ActivationStore(tmp_path).verify()
    assert hashed == ["shard-000000.safetensors"]


def test_a_hash_remembered_within_a_clock_tick_of_the_write_is_not_trusted(tmp_path, monkeypatch):
    _write(tmp_path, [16])
    shard = tmp_path / SHARD.format(0)
    cache = store_check.VerifyCache(shard.parent)
    monkeypatch.setattr(store_check.time, "time_ns", lambda: shard.stat().st_mtime_ns + 1000)
    cache.remember(shard, "0" * 64)  # as if hashed 1 us after the last write: a write in the same tick hides
    assert cache.sha256(shard) != "0" * 64


def test_a_shard_of_another_collection_is_refused_by_its_header(tmp_path):
    _write(tmp_path / "a", [16])
    _write(tmp_path / "b", [16], config=_config(context_len=32))
    shutil.copy(tmp_path / "b" / SHARD.format(0), tmp_path / "a" / SHARD.format(0))
    with pytest.raises(ValueError, match="sha256"):
        ActivationStore(tmp_path / "a").token_ids()
    with pytest.raises(ValueError, match=r"header says \{'config_hash': '[0-9a-f]+', 'index': 0, 'rank': 0\}"):
        ActivationStore(tmp_path / "a", verify=False).token_ids()


def test_a_shard_symlinked_outside_the_store_is_refused(tmp_path):
    _write(tmp_path / "a", [16])
    outside = tmp_path / "outside.safetensors"
    shard = tmp_path / "a" / SHARD.format(0)
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    with pytest.raises(ValueError, match="outside the store"):
        ActivationStore(tmp_path / "a").token_ids()


def test_the_writer_finds_missing_garbage_and_truncated_shards(tmp_path):
    _write(tmp_path, [16, 16, 16, 16], finish=False)
    (tmp_path / SHARD.format(0)).unlink()
    garbage = tmp_path / SHARD.format(1)
    garbage.write_bytes(os.urandom(garbage.stat().st_size))
    truncated = tmp_path / SHARD.format(3)
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"3 recorded shard\(s\) are missing or damaged: rank000/shard-000000"
                                         r".*\(missing\); .*000001.* \(sha256 differs from its record\); .*000003"
                                         r".*\(100 bytes, recorded \d+\)\. Rerun .* --repair"):
        ShardWriter(tmp_path, _config())
    w = ShardWriter(tmp_path, _config(), repair=True)
    assert [i for i, _ in w.damaged] == [0, 1, 3] and w.n_tokens == 64
    w.close()
    with pytest.raises(FileNotFoundError, match=r"shard-000000.safetensors: shard 0 of the store is missing"):
        ActivationStore(tmp_path).token_ids()
