"""saes.load through every path (hub cache offline, release dir, single file, safetensors cache) and bad files."""
from __future__ import annotations

import builtins
import pickle

import pytest
import safetensors.torch
import torch

import saes.registry
from saes import SAEFileError, TopKSAE, check_d_model, get_release, load
from tests.factories import D_MODEL, random_sae_state, write_hub_cache_release, write_sae_release

NANO_REPO = "Qwen/SAE-Res-Qwen3.5-Nano-Base-W0K-L0_8"


def _assert_is_state(sae: TopKSAE, seed: int, dtype=torch.float32):
    state = random_sae_state(seed=seed)
    for key, value in state.items():
        torch.testing.assert_close(getattr(sae, key).detach(), value.to(dtype), rtol=0, atol=0)


@pytest.fixture
def nano_registered(monkeypatch):
    """Register a tiny release (d_model 64, d_sae 256, k 8, 4 layers) so release ids resolve without 500 MB files."""
    nano = saes.registry.Release("qwen-scope-3.5-nano-base-w0k-l8", NANO_REPO, "Qwen/Qwen3.5-Nano-Base", "base",
                                 D_MODEL, 256, 8, 4)
    table = saes.registry._table() + (nano,)
    monkeypatch.setattr(saes.registry, "_table", lambda: table)
    return nano


# ---------------------------------------------------------------------------------------------------- the hub cache
def test_load_by_release_id_and_repo_id_from_offline_hub_cache(tmp_path, monkeypatch, nano_registered):
    write_hub_cache_release(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    by_id = load("qwen-scope-3.5-nano-base-w0k-l8", 2, cache_dir=tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    by_repo = load(NANO_REPO, 2)
    for sae in (by_id, by_repo):
        _assert_is_state(sae, seed=2)
        assert (sae.k, sae.layer, sae.release) == (8, 2, nano_registered)
        assert "snapshots/0123456789abcdef" in sae.source
        assert not any(p.requires_grad for p in sae.parameters()) and not sae.training


def test_unregistered_repo_id_loads_with_k_from_its_name(tmp_path, monkeypatch):
    write_hub_cache_release(tmp_path, repo_id="someone/SAE-Res-Tiny-W0K-L0_5")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sae = load("someone/SAE-Res-Tiny-W0K-L0_5", 1, cache_dir=tmp_path)
    assert sae.k == 5 and not sae.release.registered
    _assert_is_state(sae, seed=1)


def test_uncached_file_in_offline_mode_names_repo_file_and_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"layer12\.sae\.pt of Qwen/SAE-Res-Qwen3\.5-2B-Base-W32K-L0_100.*"
                                                r"offline.*hf download"):
        load("qwen-scope-3.5-2b-base-w32k-l100", 12, cache_dir=tmp_path)


def test_registered_release_rejects_a_file_of_other_sizes(tmp_path, monkeypatch):
    write_hub_cache_release(tmp_path, repo_id="Qwen/SAE-Res-Qwen3.5-2B-Base-W32K-L0_100", layers=[12])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SAEFileError, match=r"layer12\.sae\.pt has d_model=64 but .*W32K-L0_100 has d_model=2048"):
        load("qwen-scope-3.5-2b-base-w32k-l100", 12, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="valid layers are 0..23"):
        load("qwen-scope-3.5-2b-base-w32k-l100", 24, cache_dir=tmp_path)


@pytest.mark.slow
def test_full_size_2b_layer_loads_by_release_id(tmp_path, monkeypatch):
    """The issue's done-criterion with a real-size (537 MB) layer file in a fake hub cache (~8 s, mostly disk)."""
    r = get_release("qwen-scope-3.5-2b-base-w32k-l100")
    snapshot = write_hub_cache_release(tmp_path, repo_id=r.repo_id, layers=[])
    g = torch.Generator().manual_seed(0)
    state = {"W_enc": torch.zeros(r.d_sae, r.d_model), "W_dec": torch.zeros(r.d_model, r.d_sae),
             "b_enc": torch.rand(r.d_sae, generator=g), "b_dec": torch.randn(r.d_model, generator=g)}
    state["W_enc"][:300] = torch.randn(300, r.d_model, generator=g)
    state["W_dec"][:, :300] = torch.randn(r.d_model, 300, generator=g)
    torch.save(state, snapshot / "layer12.sae.pt")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sae = load("qwen-scope-3.5-2b-base-w32k-l100", 12, cache_dir=tmp_path, dtype=torch.bfloat16)
    assert (sae.d_model, sae.d_sae, sae.k, sae.dtype, sae.layer) == (2048, 32768, 100, torch.bfloat16, 12)
    x = torch.randn(3, 2048)
    ref = TopKSAE.from_release_state({k: v.bfloat16().float() for k, v in state.items()}, k=100)
    torch.testing.assert_close(sae.encode(x), ref.encode(x))
    torch.testing.assert_close(sae(x.bfloat16()), ref(x.bfloat16().float()).bfloat16(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------- local paths
def test_load_from_release_directory_and_single_file(tmp_path):
    root = write_sae_release(tmp_path)
    sae = load(root, 3)
    _assert_is_state(sae, seed=3)
    assert sae.k == 8 and sae.release.id == "qwen-scope-3.5-nano-base-w0k-l8"
    single = load(root / "layer1.sae.pt")
    _assert_is_state(single, seed=1)
    assert single.layer == 1
    with pytest.raises(ValueError, match="asked for layer 2 but the file is layer1"):
        load(root / "layer1.sae.pt", 2)
    with pytest.raises(FileNotFoundError, match="layer7.sae.pt does not exist"):
        load(root, 7)


def test_directory_without_k_in_its_name_needs_k(tmp_path):
    root = write_sae_release(tmp_path, repo_name="my_saes")
    with pytest.raises(ValueError, match="pass k= to load"):
        load(root, 0)
    assert load(root, 0, k=4).k == 4
    with pytest.raises(ValueError, match="k=3 contradicts"):
        load(write_sae_release(tmp_path), 0, k=3)


def test_dtype_and_device_are_applied(tmp_path):
    sae = load(write_sae_release(tmp_path), 0, dtype=torch.bfloat16, device="cpu")
    assert sae.dtype == torch.bfloat16 and sae.device.type == "cpu"
    _assert_is_state(sae, seed=0, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="floating-point"):
        load(write_sae_release(tmp_path), 0, dtype=torch.int32)


def test_legacy_serialization_and_extra_keys_still_load(tmp_path):
    root = tmp_path / "SAE-Res-X-W0K-L0_4"
    root.mkdir()
    torch.save({**random_sae_state(seed=5), "note": torch.zeros(1)}, root / "layer0.sae.pt",
               _use_new_zipfile_serialization=False)
    with pytest.warns(UserWarning, match=r"ignoring unexpected keys \['note'\]"):
        sae = load(root, 0)
    _assert_is_state(sae, seed=5)


# ---------------------------------------------------------------------------------------------------- bad input
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"with open({str(self.marker)!r}, 'w') as f: f.write('pwned')",)


def _bad_release(tmp_path, payload=None, raw: bytes | None = None):
    root = tmp_path / "SAE-Res-Bad-W0K-L0_4"
    root.mkdir(exist_ok=True)
    path = root / "layer0.sae.pt"
    if raw is not None:
        path.write_bytes(raw)
    else:
        torch.save(payload, path)
    return root


def test_pickle_carrying_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "marker.txt"
    root = _bad_release(tmp_path, {**random_sae_state(), "evil": _RunsCode(marker)})
    with pytest.raises(SAEFileError, match=r"refused to load .*layer0\.sae\.pt.*weights_only"):
        load(root, 0)
    assert not marker.exists()
    # The payload is real: an unsafe load does run it, so the refusal above is what protected us.
    pickle.loads(pickle.dumps(_RunsCode(marker)))
    assert marker.read_text() == "pwned"


def test_truncated_file_is_reported(tmp_path):
    root = write_sae_release(tmp_path, repo_name="SAE-Res-Bad-W0K-L0_4", n_layers=1)
    data = (root / "layer0.sae.pt").read_bytes()
    (root / "layer0.sae.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(SAEFileError, match=r"layer0\.sae\.pt .*truncated"):
        load(root, 0)
    _bad_release(tmp_path, raw=b"")
    with pytest.raises(SAEFileError, match="truncated"):
        load(root, 0)


@pytest.mark.parametrize("edit, message", [
    (lambda s: {k: v for k, v in s.items() if k != "b_enc"}, r"lacks key\(s\) \['b_enc'\]"),
    (lambda s: {**s, "W_dec": s["W_dec"][:, :100]}, r"W_dec has shape \(64, 100\), expected \(64, 256\)"),
    (lambda s: {**s, "W_dec": s["W_dec"].T.contiguous()}, "looks transposed"),
    (lambda s: {**s, "b_dec": torch.zeros(63)}, r"b_dec has shape \(63,\), expected \(64,\)"),
    (lambda s: {**s, "W_enc": s["W_enc"].long()}, "W_enc must be a floating-point tensor"),
    (lambda s: [s["W_enc"]], "holds a list, expected a dict"),
])
def test_malformed_state_is_reported_with_file_and_mismatch(tmp_path, edit, message):
    root = _bad_release(tmp_path, edit(random_sae_state()))
    with pytest.raises(SAEFileError, match=message) as info:
        load(root, 0)
    assert "layer0.sae.pt" in str(info.value)


def test_d_model_mismatch_with_the_model_names_release_layer_and_sizes(tmp_path, monkeypatch, nano_registered):
    write_hub_cache_release(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"qwen-scope-3.5-nano-base-w0k-l8 layer 1 expects d_model 64, but the model "
                                         r"has hidden size 2048; use .*qwen-scope-3.5-2b-base-w32k-l50"):
        load("qwen-scope-3.5-nano-base-w0k-l8", 1, cache_dir=tmp_path, expected_d_model=2048)
    sae = load("qwen-scope-3.5-nano-base-w0k-l8", 1, cache_dir=tmp_path, expected_d_model=64)
    check_d_model(sae, 64)
    with pytest.raises(ValueError, match="model Qwen/Qwen3-8B has hidden size 4096"):
        check_d_model(sae, 4096, "Qwen/Qwen3-8B")


def test_unknown_source_is_reported():
    with pytest.raises(ValueError, match="unknown Qwen-Scope release 'qwen-scope-9-9b'"):
        load("qwen-scope-9-9b", 0)
    with pytest.raises(FileNotFoundError, match="neither an existing file"):
        load("./no/such/dir", 0)


# ---------------------------------------------------------------------------------------------------- safetensors cache
def test_safetensors_cache_is_written_once_then_memory_mapped(tmp_path, monkeypatch):
    root = write_sae_release(tmp_path)
    cache = tmp_path / "st"
    first = load(root, 2, dtype=torch.bfloat16, safetensors_cache=cache)
    files = list(cache.glob("*.safetensors"))
    assert [f.name.split("--")[:3] for f in files] == [["qwen-scope-3.5-nano-base-w0k-l8", "layer2", "bfloat16"]]
    _assert_is_state(first, seed=2, dtype=torch.bfloat16)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("the .pt was unpickled again")

    monkeypatch.setattr(torch, "load", no_unpickling)
    second = load(root, 2, dtype=torch.bfloat16, safetensors_cache=cache)
    _assert_is_state(second, seed=2, dtype=torch.bfloat16)
    assert len(list(cache.glob("*.safetensors"))) == 1
    # An fp32 cache is a separate file with bit-exact weights.
    monkeypatch.undo()
    _assert_is_state(load(root, 2, safetensors_cache=cache), seed=2)
    assert len(list(cache.glob("*.safetensors"))) == 2


def test_corrupt_safetensors_cache_is_reported(tmp_path):
    root = write_sae_release(tmp_path)
    cache = tmp_path / "st"
    load(root, 0, safetensors_cache=cache)
    (cached,) = cache.glob("*.safetensors")
    cached.write_bytes(cached.read_bytes()[:100])
    with pytest.raises(SAEFileError, match="truncated or corrupt"):
        load(root, 0, safetensors_cache=cache)



def test_failed_safetensors_cache_write_leaves_no_temporary(tmp_path, monkeypatch):
    root = write_sae_release(tmp_path)
    cache = tmp_path / "st"

    def dies_halfway(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", dies_halfway)
    with pytest.raises(OSError, match="No space left"):
        load(root, 1, safetensors_cache=cache)
    assert list(cache.iterdir()) == []
