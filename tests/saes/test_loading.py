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


def test_online_without_a_hub_an_uncached_file_fails_after_one_short_request(tmp_path, monkeypatch):
    import time

    import huggingface_hub

    import saes.loading

    calls = []

    def no_network(url, timeout=None, **kw):
        calls.append(timeout)
        raise ConnectionError("Failed to establish a new connection: [Errno 101] Network is unreachable")

    def no_download(*a, **kw):
        raise AssertionError("the download must not start (its retries are what makes users wait)")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_network)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"layer12\.sae\.pt of Qwen/SAE-Res-Qwen3\.5-2B-Base-W32K-L0_100.*not in "
                                                r"cache.*hub did not answer \(ConnectionError: .*Network is unreachable\)"
                                                r".*hf download"):
        load("qwen-scope-3.5-2b-base-w32k-l100", 12, cache_dir=tmp_path)
    assert calls == [saes.loading.HUB_PROBE_TIMEOUT_S] and time.perf_counter() - start < 1.0


def test_a_cached_file_loads_without_touching_the_network(tmp_path, monkeypatch, nano_registered):
    import huggingface_hub

    write_hub_cache_release(tmp_path / "hub")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("get_hf_file_metadata", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, lambda *a, **kw: pytest.fail("the network was asked"))
    _assert_is_state(load("qwen-scope-3.5-nano-base-w0k-l8", 2, cache_dir=tmp_path / "hub"), seed=2)


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


# ---------------------------------------------------------------------------------------------------- hostile files
def test_non_finite_weights_are_refused_naming_file_and_tensor(tmp_path):
    for key, value in (("W_dec", float("nan")), ("b_enc", float("inf"))):
        state = random_sae_state()
        state[key].view(-1)[[3, 7]] = value
        root = _bad_release(tmp_path, state)
        with pytest.raises(SAEFileError, match=rf"layer0\.sae\.pt: {key} has 2 non-finite value\(s\) \(NaN or Inf\) "
                                               rf"of {state[key].numel()}"):
            load(root, 0)


def test_refused_pickle_says_it_holds_code_not_that_it_is_truncated(tmp_path):
    import os

    class Global:
        def __reduce__(self):
            return os.getcwd, ()

    root = _bad_release(tmp_path, {**random_sae_state(), "W_enc": Global()})
    with pytest.raises(SAEFileError) as info:
        load(root, 0)
    message = str(info.value)
    assert "refused to load" in message and "holds code" in message and "truncated" not in message


def test_a_symlink_to_a_system_file_or_a_directory_is_the_loaders_error(tmp_path):
    root = tmp_path / "SAE-Res-Bad-W0K-L0_4"
    root.mkdir()
    (root / "layer0.sae.pt").symlink_to("/etc/hostname" if __import__("os").path.exists("/etc/hostname")
                                        else "/etc/passwd")
    with pytest.raises(SAEFileError, match=r"layer0\.sae\.pt"):
        load(root, 0)
    (root / "layer1.sae.pt").mkdir()
    with pytest.raises(SAEFileError, match=r"layer1\.sae\.pt is a directory"):
        load(root, 1)


def _fuzzed_files(seed: int, n: int):
    """Damaged variants of one small SAE file: bit flips, cut-offs, spliced bytes, and re-saved odd payloads."""
    import io

    g = torch.Generator().manual_seed(seed)
    state = random_sae_state(d_model=8, d_sae=16)
    buf = io.BytesIO()
    torch.save(state, buf)
    good = buf.getvalue()
    odd_payloads = [
        {}, {"W_enc": 1}, {**state, "W_enc": torch.zeros(0, 8)}, {**state, "W_enc": torch.zeros(16)},
        {**state, "W_dec": torch.zeros(8, 16, dtype=torch.complex64)}, {**state, 3: torch.zeros(1)},
        {**state, "W_enc": state["W_enc"].to_sparse()}, {k: v.bfloat16() for k, v in state.items()}, None, "text",
        {**state, "b_dec": torch.zeros(8, 1)}, (state,), {**state, "W_enc": torch.zeros(16, 8, 2)},
    ]
    for i in range(n):
        data = bytearray(good)
        kind = i % 4
        if kind == 0:
            for pos in torch.randint(0, len(data), (int(torch.randint(1, 20, (1,), generator=g)),), generator=g):
                data[int(pos)] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
        elif kind == 1:
            data = data[: int(torch.randint(0, len(data), (1,), generator=g))]
        elif kind == 2:
            start = int(torch.randint(0, len(data), (1,), generator=g))
            data[start:start + 64] = torch.randint(0, 256, (64,), generator=g, dtype=torch.uint8).numpy().tobytes()
        else:
            out = io.BytesIO()
            torch.save(odd_payloads[(i // 4) % len(odd_payloads)], out)
            data = bytearray(out.getvalue())
        yield bytes(data)


def test_every_malformed_file_is_the_loaders_error_or_a_valid_load(tmp_path):
    # Seeded, small: each outcome must be SAEFileError naming the file, or an SAE that computes finite codes.
    root = tmp_path / "SAE-Res-Fuzz-W0K-L0_4"
    root.mkdir()
    outcomes = {"refused": 0, "loaded": 0}
    for i, data in enumerate(_fuzzed_files(seed=0, n=160)):
        path = root / f"layer{i}.sae.pt"
        path.write_bytes(data)
        try:
            with __import__("warnings").catch_warnings():
                __import__("warnings").simplefilter("ignore")
                sae = load(root, i)
        except SAEFileError as e:
            assert f"layer{i}.sae.pt" in str(e), str(e)
            outcomes["refused"] += 1
            continue
        codes = sae.encode(torch.randn(3, sae.d_model))
        assert codes.shape == (3, sae.d_sae) and bool(torch.isfinite(codes).all())
        outcomes["loaded"] += 1
    assert outcomes["refused"] > 100 and outcomes["loaded"] >= 1


# ---------------------------------------------------------------------------------------------------- cache under stress
def test_concurrent_cache_loads_from_threads_all_succeed_with_the_same_weights(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    root = write_sae_release(tmp_path, n_layers=2)
    cache = tmp_path / "st"

    def one(i):
        return load(root, i % 2, dtype=torch.bfloat16, safetensors_cache=cache)

    with ThreadPoolExecutor(6) as pool:
        loaded = list(pool.map(one, range(36)))
    for i, sae in enumerate(loaded):
        _assert_is_state(sae, seed=i % 2, dtype=torch.bfloat16)
    assert len(list(cache.glob("*.safetensors"))) == 2 and not list(cache.glob(".*tmp"))


def test_cache_never_serves_a_replaced_file_of_the_same_size_and_mtime(tmp_path):
    import os

    root = write_sae_release(tmp_path, n_layers=1)
    path = root / "layer0.sae.pt"
    cache = tmp_path / "st"
    _assert_is_state(load(root, 0, safetensors_cache=cache), seed=0)
    stat = path.stat()
    # Same name elsewhere: torch.save records the file's name inside the archive, and the size must match.
    (tmp_path / "new").mkdir()
    replacement = tmp_path / "new" / "layer0.sae.pt"
    torch.save(random_sae_state(seed=5), replacement)
    assert replacement.stat().st_size == stat.st_size
    os.replace(replacement, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    _assert_is_state(load(root, 0, safetensors_cache=cache), seed=5)


# ---------------------------------------------------------------------------------------------------- sae-lens habits
def test_sae_lens_layer_ids_and_cfg(tmp_path):
    root = write_sae_release(tmp_path)
    sae = load(root, "layer2")
    _assert_is_state(sae, seed=2)
    assert load(root / "layer1.sae.pt", "layer1").layer == 1
    cfg = sae.cfg
    assert (cfg.d_in, cfg.d_sae, cfg.k, cfg.layer, cfg.hook_name, cfg.release) == (
        D_MODEL, 256, 8, 2, "blocks.2.hook_resid_post", "qwen-scope-3.5-nano-base-w0k-l8")
    with pytest.raises(TypeError, match="sae-lens SAE id like 'layer12'"):
        load(root, "two")


def test_sae_lens_orientation_habits_are_refused_not_silently_wrong(tmp_path):
    sae = load(write_sae_release(tmp_path), 0)
    state = random_sae_state(seed=0)
    torch.testing.assert_close(sae.W_dec[:, 5].detach(), state["W_dec"][:, 5])
    torch.testing.assert_close(sae.W_enc[5].detach(), state["W_enc"][5])
    with pytest.raises(IndexError, match=r"W_dec\[5\]: W_dec is \[d_model, d_sae\].*W_dec\[:, f\]"):
        sae.W_dec[5]
    with pytest.raises(IndexError, match=r"W_enc\[:, 5\]: W_enc is \[d_sae, d_model\].*W_enc\[f\]"):
        sae.W_enc[:, 5]
    torch.testing.assert_close(sae.decoder_directions(5)[0], state["W_dec"][:, 5])
