"""The activation store: atomic sharded writes, resume bookkeeping, manifest merge, every reader path, and the
compact code layout (uint16 indices, packed high bits, version-1 stores with int32 indices still read)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_scope.store import ActivationStore
from qwen_scope.store_files import config_hash
from qwen_scope.store_writer import (ShardWriter, code_bytes, index_layout, merge_manifest, pack_indices,
                                     unpack_indices)

D_MODEL, D_SAE, K = 8, 32, 4
POINTS = {"resid_post.1": {"dense": True, "d_model": D_MODEL, "sae": {"release": "r", "layer": 1, "k": K,
                                                                     "d_sae": D_SAE, "index_layout": "uint16"}},
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
        **{f"sae.resid_post.1.{k}": v for k, v in pack_indices(indices, "uint16").items()},
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
    store = ActivationStore(tmp_path)
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
    store = ActivationStore(tmp_path)
    store.verify()
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
    with pytest.raises(FileNotFoundError, match="qwen-scope collect"):
        ActivationStore(tmp_path / "nowhere")


@pytest.mark.parametrize("d_sae", [32, 65536, 81920, 131072, 1 << 20, 1 << 25])
def test_pack_indices_is_lossless_in_every_layout(d_sae):
    g = torch.Generator().manual_seed(d_sae % 1000)
    indices = torch.randint(0, d_sae, (37, 13), generator=g)
    indices[0, :2] = torch.tensor([0, d_sae - 1])
    layout = index_layout(d_sae)
    packed = pack_indices(indices, layout)
    assert torch.equal(unpack_indices(packed["indices"], packed.get("indices_high"), layout), indices)
    want = {32: "uint16", 65536: "uint16", 81920: "uint16+1", 131072: "uint16+1", 1 << 20: "uint16+4",
            1 << 25: "int32"}[d_sae]
    assert layout == want and packed["indices"].dtype == (torch.int32 if want == "int32" else torch.uint16)
    # bytes a code with bf16 values and k = 100 (the 2B release): 4 up to 64K features, 6 before this layout
    assert code_bytes(d_sae, 100) == {"uint16": 4, "uint16+1": 4.13, "uint16+4": 4.5, "int32": 6}[want]


def test_a_shard_stores_two_bytes_an_index(tmp_path):
    _write(tmp_path, [16])
    with safe_open(str(tmp_path / "rank000" / "shard-000000.safetensors"), framework="pt") as f:
        idx, val = f.get_slice("sae.resid_post.1.indices"), f.get_slice("sae.resid_post.1.values")
        assert (idx.get_dtype(), val.get_dtype()) == ("U16", "BF16") and idx.get_shape() == [16, K]


def test_a_version_1_store_with_int32_indices_reads_the_same_codes(tmp_path):
    """What the writer before the compact layout left: int32 indices, no index_layout, format version 1."""
    points = {p: {**i, "sae": i["sae"] and {k: v for k, v in i["sae"].items() if k != "index_layout"}}
              for p, i in POINTS.items()}
    config = _config(points=points)
    tensors = _shard(0, 16, seed=1)
    low = tensors.pop("sae.resid_post.1.indices")
    tensors["sae.resid_post.1.indices"] = low.int()
    (tmp_path / "rank000").mkdir()
    meta = {"qwen-scope-activations": json.dumps({"config_hash": config_hash(config), "rank": 0, "index": 0},
                                                 sort_keys=True)}
    path = tmp_path / "rank000" / "shard-000000.safetensors"
    save_file(tensors, str(path), metadata=meta)
    from qwen_scope.store_files import file_sha256

    record = {"file": "rank000/shard-000000.safetensors", "index": 0, "n_tokens": 16, "n_rows": 1, "n_pad": 0,
              "cursor": [1, 0], "sha256": file_sha256(path), "bytes": path.stat().st_size}
    (tmp_path / "rank000" / "progress.json").write_text(json.dumps({
        "format": "qwen-scope-activations", "version": 1, "config_hash": config_hash(config), "config": config,
        "rank": 0, "world_size": 1, "complete": True, "shards": [record], "stats": {}}))
    merge_manifest(tmp_path)
    store = ActivationStore(tmp_path)
    codes = store.sae_codes("resid_post.1")
    assert store.manifest["version"] == 1 and codes.indices.dtype == torch.long
    assert torch.equal(codes.indices, low.long()) and torch.equal(codes.values, tensors["sae.resid_post.1.values"])
    assert store.feature_index("resid_post.1", top_n=2).counts.sum() == (codes.values > 0).sum()
