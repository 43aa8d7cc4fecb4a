"""Defects found in review of saes/: each test failed before its fix."""
from __future__ import annotations

import pytest
import safetensors.torch
import torch

import saes.loading
import saes.training
from saes import SAEBank, TopKSAE, load
from saes.training import save_sae
from tests.factories import random_sae_state, write_sae_release


def _sae(seed: int = 0) -> TopKSAE:
    return TopKSAE.from_release_state(random_sae_state(seed=seed), k=8)


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


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_interrupted_save_keeps_the_previous_file_and_leaves_no_partial_one(tmp_path, monkeypatch, fmt):
    root = tmp_path / "SAE-Res-MyModel-W0K-L0_8"
    save_sae(_sae(seed=1), root, 0, formats=(fmt,))

    def dies_halfway(obj, f, *args, **kwargs):
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04 half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", dies_halfway)
    monkeypatch.setattr(safetensors.torch, "save_file", dies_halfway)
    with pytest.raises(OSError, match="No space left"):
        save_sae(_sae(seed=2), root, 0, formats=(fmt,))
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == [f"layer0.sae.{fmt}"]
    torch.testing.assert_close(load(root, 0).W_dec.detach(), random_sae_state(seed=1)["W_dec"], rtol=0, atol=0)


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


def test_a_one_token_tail_batch_does_not_turn_the_logged_fve_into_minus_infinity():
    # 65 tokens in batches of 64: every epoch ends with a 1-token batch, whose FVE (1 - mse / 0) is undefined.
    x = torch.randn(65, 16, generator=torch.Generator().manual_seed(0))
    config = saes.training.SAETrainingConfig(d_sae=32, k=4, n_tokens=64 * 4, batch_size=64, log_every=2)
    result = saes.training.train_sae(x, config, progress=False)
    assert [h["tokens"] for h in result.history] == [65, 130]
    for entry in result.history:
        assert 0.0 < entry["fve"] < 1.0, entry
    # The window mean is token-weighted: the 64-token batch dominates, the 1-token batch's undefined FVE is left out.
    steps = []
    trainer_step = saes.training.SAETrainer.step

    def spy(self, batch):
        steps.append((batch.shape[0], trainer_step(self, batch)))
        return steps[-1][1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(saes.training.SAETrainer, "step", spy)
        result = saes.training.train_sae(x, config, progress=False)
    assert [n for n, _ in steps] == [64, 1, 64, 1]
    assert steps[1][1]["fve"] != steps[1][1]["fve"]  # nan
    assert result.history[0]["fve"] == pytest.approx(steps[0][1]["fve"])
    assert result.history[0]["mse"] == pytest.approx((64 * steps[0][1]["mse"] + steps[1][1]["mse"]) / 65)


def test_model_activations_leaves_no_hook_on_the_model_between_batches():
    from saes.training_data import model_activations
    from tests.factories import tiny_model

    model = tiny_model("qwen3")
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    batches = model_activations(model, [ids, ids], layer=1)
    first = next(batches)  # the consumer pauses here (e.g. train_sae stopped at n_tokens and keeps the iterator)
    assert not any(m._forward_hooks for m in model.modules())
    with torch.no_grad():
        out = model.model.layers[1].register_forward_hook(lambda mod, a, o: setattr(mod, "_seen", o))
        model(input_ids=ids, use_cache=False)
        out.remove()
    seen = model.model.layers[1]._seen
    torch.testing.assert_close(first, seen[:, 1:].reshape(-1, seen.shape[-1]).float())
    torch.testing.assert_close(next(batches), first)


@pytest.mark.parametrize("shuffle_buffer", [0, 5, 17, 100])
@pytest.mark.parametrize("batch_size", [1, 4, 7, 50])
def test_rebatch_never_yields_an_empty_batch_and_keeps_every_token_once(shuffle_buffer, batch_size):
    # A buffer between batch_size and 2 * batch_size used to emit [0, d_model] batches (nan loss in train_sae).
    from saes.training_data import rebatch

    chunks = [torch.arange(s, s + n, dtype=torch.float32)[:, None] for s, n in [(0, 3), (3, 10), (13, 1), (14, 0),
                                                                               (14, 30)]]
    out = list(rebatch(chunks, batch_size, shuffle_buffer=shuffle_buffer))
    sizes = [b.shape[0] for b in out]
    assert all(n == batch_size for n in sizes[:-1]) and 0 < sizes[-1] <= batch_size, sizes
    assert torch.equal(torch.cat(out).flatten().sort().values, torch.arange(44, dtype=torch.float32))


@pytest.mark.parametrize("layer", [-1, 2.0, True])
def test_save_sae_refuses_a_layer_no_loader_can_find(tmp_path, layer):
    # layer=-1 used to write layer-1.sae.pt, which load() and SAEBank never find.
    root = tmp_path / "SAE-Res-MyModel-W0K-L0_8"
    with pytest.raises(ValueError, match=r"layer must be a non-negative int.*got"):
        save_sae(_sae(), root, layer)
    assert not root.exists()


def test_save_sae_accepts_a_numpy_integer_layer(tmp_path):
    import numpy as np

    paths = save_sae(_sae(), tmp_path / "SAE-Res-MyModel-W0K-L0_8", np.int64(3), formats=("pt",))
    assert [p.name for p in paths] == ["layer3.sae.pt"]
