"""SAEBank: layers load lazily and least-recently-used ones are evicted within a count or byte bound; it finds the
layers of every directory layout saes.load reads, and of a release id through the hub cache."""
from __future__ import annotations

import warnings

import pytest
import torch

from saes import SAEBank, SAEFileError, TopKSAE
from saes.training import save_sae
from tests.factories import D_MODEL, random_sae_state, write_hub_cache_release, write_sae_release
from tests.saes.test_loading import _assert_is_state, nano_registered  # noqa: F401  (a fixture)


def _sae(seed: int = 0) -> TopKSAE:
    return TopKSAE.from_release_state(random_sae_state(seed=seed), k=8)


def test_bank_loads_lazily_and_evicts_least_recently_used(tmp_path):
    bank = SAEBank(write_sae_release(tmp_path), max_layers=2)
    assert bank.layers == (0, 1, 2, 3) and bank.loaded == [] and len(bank) == 4 and 3 in bank
    first = bank[0]
    assert bank[0] is first and bank.hits == 1
    bank[1]
    bank[0]
    bank[2]  # evicts 1, the least recently used
    assert bank.loaded == [0, 2] and bank.evictions == 1 and bank.misses == 3
    _assert_is_state(bank[2], seed=2)
    bank.evict(0)
    assert bank.loaded == [2]
    with pytest.raises(KeyError, match="layer 9 is not in this bank"):
        bank[9]


def test_bank_byte_bound_keeps_one_layer_when_only_one_fits(tmp_path):
    per_layer = 4 * (2 * D_MODEL * 256 + 256 + D_MODEL)
    bank = SAEBank(write_sae_release(tmp_path), max_bytes=int(1.5 * per_layer))
    for n in (0, 1, 2):
        bank[n]
        assert bank.loaded == [n] and bank.nbytes == per_layer
    half = SAEBank(write_sae_release(tmp_path), max_bytes=per_layer, dtype=torch.bfloat16)
    half.preload([0, 1, 3])
    assert half.loaded == [1, 3] and half.nbytes == per_layer  # two bf16 layers fit in one fp32 layer's bytes


def test_bank_failure_loads_nothing(tmp_path):
    root = write_sae_release(tmp_path, repo_name="SAE-Res-Bad-W0K-L0_4", n_layers=2)
    (root / "layer1.sae.pt").write_bytes(b"garbage")
    bank = SAEBank(root)
    bank[0]
    with pytest.raises(SAEFileError):
        bank[1]
    assert bank.loaded == [0]


def test_bank_of_a_release_id_resolves_through_the_hub_cache(tmp_path, monkeypatch, nano_registered):
    write_hub_cache_release(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bank = SAEBank("qwen-scope-3.5-nano-base-w0k-l8", layers=[1, 3], cache_dir=tmp_path)
    assert bank.layers == (1, 3) and bank.path(3).name == "layer3.sae.pt"
    _assert_is_state(bank[3], seed=3)
    with pytest.raises(ValueError, match="valid layers are 0..3"):
        SAEBank("qwen-scope-3.5-nano-base-w0k-l8", layers=[4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bank[1]


def test_bank_finds_the_layers_of_a_safetensors_only_directory(tmp_path):
    # save_sae(formats=("safetensors",)) writes directories that load() reads; the bank must list their layers too.
    root = tmp_path / "SAE-Res-MyModel-W0K-L0_8"
    for n in (0, 2, 10):
        save_sae(_sae(seed=n), root, n, formats=("safetensors",))
    bank = SAEBank(root)
    assert bank.layers == (0, 2, 10)
    torch.testing.assert_close(bank[10].W_enc.detach(), random_sae_state(seed=10)["W_enc"], rtol=0, atol=0)


def test_bank_lists_a_layer_once_when_both_formats_are_present(tmp_path):
    root = tmp_path / "SAE-Res-MyModel-W0K-L0_8"
    for n in (1, 3):
        save_sae(_sae(seed=n), root, n)  # .pt and .safetensors
    assert SAEBank(root).layers == (1, 3)
