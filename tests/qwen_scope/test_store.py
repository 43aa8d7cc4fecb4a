"""The activation store: atomic sharded writes, resume bookkeeping, manifest merge, and every reader path."""
from __future__ import annotations

import json

import pytest
import torch

from qwen_scope.store import ActivationStore
from qwen_scope.store_writer import ShardWriter, merge_manifest

D_MODEL, D_SAE, K = 8, 32, 4
POINTS = {"resid_post.1": {"dense": True, "d_model": D_MODEL, "sae": {"release": "r", "layer": 1, "k": K,
                                                                     "d_sae": D_SAE}},
          "resid_post.0": {"dense": True, "d_model": D_MODEL, "sae": None}}


def _config(**over):
    return {"model": "tiny", "points": POINTS, "sae": None, "context_len": 16, "bos_policy": {},
            "store_dtype": "bfloat16", **over}


def _shard(start: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(n, D_SAE, generator=g).relu()
    values, indices = pre.topk(K, dim=-1)
    return {
        "token_ids": torch.arange(start, start + n, dtype=torch.int32) % 256,
        "doc_index": torch.arange(start, start + n) // 5,
        "positions": (torch.arange(start, start + n) % 16).int(),
        "dense.resid_post.1": torch.randn(n, D_MODEL, generator=g).bfloat16(),
        "dense.resid_post.0": torch.randn(n, D_MODEL, generator=g).bfloat16(),
        "sae.resid_post.1.values": values.bfloat16(),
        "sae.resid_post.1.indices": indices.int(),
    }


def _write(root, sizes, rank=0, world_size=1, config=None, finish=True):
    w = ShardWriter(root, config or _config(), rank=rank, world_size=world_size)
    shards, start = [], 0
    for i, n in enumerate(sizes):
        t = _shard(1000 * rank + start, n, seed=100 * rank + i)
        shards.append(t)
        w.write(t, n_rows=1, n_pad=16 - n % 16 if n % 16 else 0, cursor={"shard": i + 1})
        start += n
    if finish:
        w.finish({"rank": rank})
    else:
        w.close()
    return shards


def _cat(shards, key):
    return torch.cat([s[key] for s in shards])


def test_round_trip_reads_back_every_tensor_across_shard_boundaries(tmp_path):
    shards = _write(tmp_path, [16, 16, 7])
    manifest = merge_manifest(tmp_path)
    assert manifest["n_tokens"] == 39 and manifest["complete"] and len(manifest["shards"]) == 3
    assert [s["start"] for s in manifest["shards"]] == [0, 16, 32]
    store = ActivationStore(tmp_path, verify=True)
    assert store.points == ["resid_post.1", "resid_post.0"] and len(store) == 39
    assert torch.equal(store.token_ids(), _cat(shards, "token_ids").long())
    assert store.token_ids().dtype == torch.long
    assert torch.equal(store.doc_index(), _cat(shards, "doc_index"))
    assert torch.equal(store.positions(), _cat(shards, "positions").long())
    dense = _cat(shards, "dense.resid_post.1")
    assert torch.equal(store.dense("resid_post.1"), dense)
    assert torch.equal(store.dense("resid_post.1", 10, 35), dense[10:35])
    codes = store.sae_codes("resid_post.1", 5, 20)
    assert codes.indices.dtype == torch.long
    assert torch.equal(codes.values, _cat(shards, "sae.resid_post.1.values")[5:20])
    assert torch.equal(codes.indices, _cat(shards, "sae.resid_post.1.indices")[5:20].long())
    dense_codes = store.feature_acts("resid_post.1", 5, 20)
    assert dense_codes.shape == (15, D_SAE) and torch.equal(dense_codes.gather(1, codes.indices), codes.values)
    assert int((dense_codes != 0).sum(1).max()) <= K
    assert store.dense("resid_post.1", 16, 16).shape == (0, D_MODEL)


def test_iter_chunks_covers_the_store_in_order_without_crossing_shards(tmp_path):
    shards = _write(tmp_path, [16, 16, 7])
    store = ActivationStore(tmp_path)
    chunks = list(store.iter_chunks("resid_post.1", kind="sae", chunk_tokens=10))
    assert [s for s, _ in chunks] == [0, 10, 16, 26, 32]
    assert torch.equal(torch.cat([c.values for _, c in chunks]), _cat(shards, "sae.resid_post.1.values"))
    dense = list(store.iter_chunks("resid_post.0", chunk_tokens=100))
    assert [s for s, _ in dense] == [0, 16, 32]
    assert torch.equal(torch.cat([d for _, d in dense]), _cat(shards, "dense.resid_post.0"))


def test_iter_shuffled_yields_every_token_once_and_depends_only_on_the_seed(tmp_path):
    shards = _write(tmp_path, [16, 16, 16, 16, 9])
    store = ActivationStore(tmp_path)
    batches = list(store.iter_shuffled("resid_post.1", batch_size=6, buffer_tokens=24, seed=3))
    assert all(b.shape == (6, D_MODEL) for b in batches[:-1]) and batches[-1].shape[0] == 73 % 6
    got = torch.cat(batches).float()
    want = _cat(shards, "dense.resid_post.1").float()
    assert not torch.equal(got, want)
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(got) == key(want)
    again = torch.cat(list(store.iter_shuffled("resid_post.1", batch_size=6, buffer_tokens=24, seed=3)))
    other = torch.cat(list(store.iter_shuffled("resid_post.1", batch_size=6, buffer_tokens=24, seed=4)))
    assert torch.equal(again, torch.cat(batches)) and not torch.equal(other, again)
    dropped = list(store.iter_shuffled("resid_post.1", 6, 24, 3, drop_last=True, dtype=torch.float32))
    assert len(dropped) == 73 // 6 and dropped[0].dtype == torch.float32
    sae = list(store.iter_shuffled("resid_post.1", 8, 32, 0, kind="sae"))
    assert sum(b.values.shape[0] for b in sae) == 73 and sae[0].indices.shape == (8, K)


def test_feature_index_matches_brute_force_and_is_cached(tmp_path):
    _write(tmp_path, [16, 16, 16, 5])
    store = ActivationStore(tmp_path)
    index = store.feature_index("resid_post.1", top_n=3, chunk_tokens=7)
    acts = store.feature_acts("resid_post.1").float()
    assert torch.equal(index.counts, (acts > 0).sum(0))
    assert torch.allclose(index.sums, acts.double().sum(0))
    for f in range(D_SAE):
        col = acts[:, f]
        # Brute force: descending values, ties to the earlier offset.
        order = sorted(range(len(col)), key=lambda i: (-col[i].item(), i))
        want = [i for i in order if col[i] > 0][:3]
        offsets, values = index.top(f)
        assert offsets.tolist() == want, f
        assert torch.equal(values, col[want])
    assert (store.root / "index" / "resid_post.1.top3.safetensors").exists()
    cached = store.feature_index("resid_post.1", top_n=3)
    assert torch.equal(cached.top_offsets, index.top_offsets) and torch.equal(cached.counts, index.counts)
    assert torch.allclose(index.frequency, (acts > 0).double().mean(0))


def test_resume_state_survives_a_new_writer_and_unrecorded_shards_are_rewritten(tmp_path):
    _write(tmp_path, [16, 16], finish=False)
    # A shard file renamed into place but not recorded (kill between rename and progress write), and a temp file.
    (tmp_path / "rank000" / "shard-000002.safetensors").write_bytes(b"garbage")
    (tmp_path / "rank000" / ".shard-000003.safetensors.tmp-999").write_bytes(b"partial")
    w = ShardWriter(tmp_path, _config())
    assert w.cursor == {"shard": 2} and w.n_tokens == 32 and w.n_rows == 2 and not w.complete
    assert not list((tmp_path / "rank000").glob(".*tmp*"))
    t = _shard(32, 5, seed=7)
    w.write(t, n_rows=1, n_pad=11, cursor={"shard": 3})
    w.finish()
    store = ActivationStore(tmp_path, verify=True)
    assert len(store) == 37 and torch.equal(store.dense("resid_post.0", 32, 37), t["dense.resid_post.0"])
    assert store.manifest["n_pad"] == 11 and abs(store.manifest["padding_fraction"] - 11 / 48) < 1e-12


def test_a_different_config_in_the_same_directory_is_refused_unless_overwritten(tmp_path):
    _write(tmp_path, [16])
    with pytest.raises(ValueError, match=r"different collection.*context_len.*overwrite"):
        ShardWriter(tmp_path, _config(context_len=32))
    w = ShardWriter(tmp_path, _config(context_len=32), overwrite=True)
    assert w.cursor is None and w.n_tokens == 0
    w.close()


def test_ranks_merge_in_rank_order_and_a_partial_store_is_readable_without_manifest(tmp_path):
    a = _write(tmp_path, [16, 4], rank=0, world_size=2)
    b = _write(tmp_path, [16], rank=1, world_size=2, finish=False)
    store = ActivationStore(tmp_path)  # no manifest.json yet: merged from progress files
    assert not (tmp_path / "manifest.json").exists() and not store.manifest["complete"]
    assert torch.equal(store.token_ids(), torch.cat([_cat(a, "token_ids"), _cat(b, "token_ids")]).long())
    assert [s["rank"] for s in store.shards] == [0, 0, 1] and store.shards[2]["start"] == 20
    ShardWriter(tmp_path, _config(), rank=1, world_size=2).finish()
    manifest = merge_manifest(tmp_path)
    assert manifest["complete"] and json.loads((tmp_path / "manifest.json").read_text())["n_tokens"] == 36


def test_reader_errors_name_the_point_and_the_fix(tmp_path):
    _write(tmp_path, [16])
    store = ActivationStore(tmp_path)
    with pytest.raises(KeyError, match="resid_post.9.*stored points"):
        store.dense("resid_post.9", 0, 1)
    with pytest.raises(ValueError, match="no SAE codes"):
        store.sae_codes("resid_post.0")
    with pytest.raises(IndexError, match=r"\[0, 16\)"):
        store.dense("resid_post.0", 10, 17)
    shard = tmp_path / "rank000" / "shard-000000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        ActivationStore(tmp_path, verify=True)
    with pytest.raises(FileNotFoundError, match="qwen-scope collect"):
        ActivationStore(tmp_path / "nowhere")
