"""The TopK SAE trainer: recovers planted directions, folds into the exact release form, saves what saes.load reads
(atomically, at valid layers only), logs token-weighted metrics."""
from __future__ import annotations

import pytest
import safetensors.torch
import torch

import saes.training
from saes import load
from saes.topk import TopKSAE
from saes.training import SAETrainer, SAETrainingConfig, evaluate_sae, save_release, save_sae, train_sae
from saes.training_data import store_activations, tensor_batches
from tests.factories import random_sae_state


def planted(n_tokens: int, d_model: int = 32, n_feat: int = 64, active: int = 3, seed: int = 0):
    """Tokens that are sums of ``active`` of ``n_feat`` unit directions (magnitudes 1-2) plus an offset and noise."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(n_feat, d_model, generator=g)
    dirs = dirs / dirs.norm(dim=1, keepdim=True)
    idx = torch.rand(n_tokens, n_feat, generator=g).argsort(dim=1)[:, :active]
    z = torch.zeros(n_tokens, n_feat).scatter_(1, idx, 1 + torch.rand(n_tokens, active, generator=g))
    return z @ dirs + 0.5 + 0.01 * torch.randn(n_tokens, d_model, generator=g), dirs


def _sae(seed: int = 0) -> TopKSAE:
    return TopKSAE.from_release_state(random_sae_state(seed=seed), k=8)


@pytest.fixture
def one_thread():
    # Hundreds of tiny steps: one thread is several times faster than two on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_planted_sparse_directions_are_recovered(one_thread):
    x, dirs = planted(20_000)
    config = SAETrainingConfig(d_sae=128, k=3, n_tokens=200_000, batch_size=512, lr=3e-3, dead_after_tokens=5000)
    result = train_sae(x, config, progress=False)
    w = result.sae.W_dec.detach()
    best = (dirs @ (w / w.norm(dim=0))).max(dim=1).values      # [n_feat] best cosine per planted direction
    assert (best > 0.9).float().mean() >= 0.95, best
    assert best.mean() > 0.97
    metrics = evaluate_sae(result.sae, x)
    assert metrics["fve"] > 0.9 and metrics["l0"] == pytest.approx(3.0)
    # Half the latents are surplus (128 for 64 true features): they end up dead, and the trainer reports it.
    assert 0.3 < result.final["dead"] < 0.7
    assert [h["step"] for h in result.history][:2] == [50, 100]
    assert result.history[-1]["fve"] > result.history[0]["fve"]


def test_export_folds_scale_and_pre_subtraction_into_release_form():
    x, _ = planted(2048, seed=1)
    config = SAETrainingConfig(d_sae=64, k=4, n_tokens=4096, batch_size=512, lr=3e-3)
    trainer = SAETrainer(32, config, x[:512])
    for batch in tensor_batches(x, 512, epochs=1):
        trainer.step(batch)
    with torch.no_grad():
        xn = x / trainer.scale
        _, values, indices = trainer._encode(xn)
        recon_train = trainer._decode(values, indices) * trainer.scale
    sae = trainer.export()
    codes = sae.encode_sparse(x)
    assert torch.equal(codes.indices.sort(-1).values, indices.sort(-1).values)
    torch.testing.assert_close(codes.values, values * trainer.scale, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sae(x), recon_train, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sae.decoder_norms(), torch.ones(64), rtol=1e-5, atol=1e-5)


def test_decoder_gradient_is_projected_off_the_columns():
    x, _ = planted(512, seed=2)
    trainer = SAETrainer(32, SAETrainingConfig(d_sae=64, k=4, n_tokens=512), x)
    trainer.W_dec.grad = torch.randn_like(trainer.W_dec)
    trainer._project_decoder_grad()
    parallel = (trainer.W_dec.grad * trainer.W_dec.data).sum(0)
    torch.testing.assert_close(parallel, torch.zeros(64), atol=1e-5, rtol=0)


def test_aux_loss_trains_only_dead_latents():
    x, _ = planted(512, seed=3)
    trainer = SAETrainer(32, SAETrainingConfig(d_sae=64, k=4, n_tokens=512, dead_after_tokens=100), x)
    dead = torch.zeros(64, dtype=torch.bool)
    dead[::4] = True
    trainer.tokens_since_fired[dead] = 1000
    pre, values, indices = trainer._encode(x / trainer.scale)
    aux = trainer._aux_loss(pre, torch.randn(512, 32))
    assert aux > 0
    grad = torch.autograd.grad(aux, trainer.W_enc)[0]
    assert grad[dead].abs().sum() > 0
    assert grad[~dead].abs().sum() == 0
    trainer.tokens_since_fired.zero_()
    assert trainer._aux_loss(pre, torch.randn(512, 32)) == 0


def test_evaluate_reports_exact_fve_and_l0():
    d = 16
    eye = torch.eye(d)
    # Features +e_i and -e_i with k = d reconstruct any x exactly: relu(x) - relu(-x) = x.
    exact = TopKSAE(torch.cat([eye, -eye]), torch.cat([eye, -eye], 1), torch.zeros(2 * d), torch.zeros(d), k=d)
    x = torch.randn(1000, d)
    metrics = evaluate_sae(exact, [x[:300], x[300:]], batch_size=128)
    assert metrics["fve"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["l0"] == pytest.approx(float((x != 0).sum(-1).float().mean()))
    assert metrics["n_tokens"] == 1000 and metrics["dead_fraction"] == 0.0
    mean_only = TopKSAE(torch.zeros(2 * d, d), torch.zeros(d, 2 * d), torch.zeros(2 * d), x.mean(0), k=1)
    assert evaluate_sae(mean_only, x)["fve"] == pytest.approx(0.0, abs=1e-5)


def test_saved_release_has_the_exact_layout_and_loads_back(tmp_path):
    saes = {n: TopKSAE(*(torch.randn(*s) for s in [(48, 16), (16, 48), (48,), (16,)]), k=8) for n in range(2)}
    out = save_release(saes, tmp_path / "SAE-Res-Nano-W0K-L0_8", info={"note": "test", "fve": 0.123456789})
    from safetensors import safe_open

    for n, sae in saes.items():
        state = torch.load(out / f"layer{n}.sae.pt", weights_only=True)
        assert sorted(state) == ["W_dec", "W_enc", "b_dec", "b_enc"]
        assert all(t.dtype == torch.float32 for t in state.values())
        for key, t in sae.release_state().items():
            assert torch.equal(state[key], t)
        with safe_open(str(out / f"layer{n}.sae.safetensors"), "pt") as f:
            assert f.metadata()["k"] == "8" and f.metadata()["layer"] == str(n)
            assert torch.equal(f.get_tensor("W_dec"), sae.W_dec.detach())
    assert '"fve": 0.123457' in (out / "training.json").read_text()
    import saes as saes_pkg

    if not hasattr(saes_pkg, "load"):
        pytest.skip("saes.load has not landed yet")
    loaded = saes_pkg.load(str(out), 1)
    assert loaded.k == 8
    torch.testing.assert_close(loaded.W_enc.detach(), saes[1].W_enc.detach())


def test_save_rejects_mixed_k_and_unknown_formats(tmp_path):
    a = TopKSAE(torch.randn(8, 4), torch.randn(4, 8), torch.randn(8), torch.randn(4), k=2)
    b = TopKSAE(torch.randn(8, 4), torch.randn(4, 8), torch.randn(8), torch.randn(4), k=3)
    with pytest.raises(ValueError, match="one k"):
        save_release({0: a, 1: b}, tmp_path)
    with pytest.raises(ValueError, match="formats"):
        save_sae(a, tmp_path, 0, formats=("npz",))


def test_train_sae_rejects_empty_input():
    with pytest.raises(ValueError, match="no activations"):
        train_sae(iter([]), SAETrainingConfig(d_sae=8, k=2, n_tokens=10), progress=False)


def test_learning_rate_is_constant_then_decays_linearly_to_zero():
    x, _ = planted(256, seed=4)
    trainer = SAETrainer(32, SAETrainingConfig(d_sae=64, k=4, n_tokens=1000, batch_size=10, lr=1e-3,
                                               lr_decay_fraction=0.2), x)
    lrs = [trainer.lr_at(s) for s in range(100)]
    assert lrs[:80] == [1e-3] * 80
    assert lrs[80] == pytest.approx(1e-3) and lrs[90] == pytest.approx(5e-4) and lrs[99] == pytest.approx(5e-5)


def test_trains_from_a_collected_activation_store(tmp_path):
    from qwen_scope.collect import collect
    from qwen_scope.store import ActivationStore
    from tests.factories import tiny_model

    g = torch.Generator().manual_seed(0)
    corpus = [{"input_ids": torch.randint(0, 256, (40,), generator=g).tolist()} for _ in range(30)]
    collect(tiny_model("qwen3_5"), corpus, points=["resid_post.1"], token_budget=1000, context_len=32,
            out_dir=tmp_path / "store", batch_size=4, store_dtype=torch.float32, separator_id=None, progress=False)
    store = ActivationStore(tmp_path / "store")
    got = torch.cat(list(store_activations(store, "resid_post.1", chunk_tokens=128, shuffle_buffer=512)))
    want = store.dense("resid_post.1", 0, 1000).float()
    assert got.shape == (1000, 64)
    assert torch.equal(got[got[:, 0].argsort()], want[want[:, 0].argsort()])
    config = SAETrainingConfig(d_sae=128, k=4, n_tokens=1000, batch_size=128, log_every=4)
    result = train_sae(store_activations(store, "resid_post.1", chunk_tokens=128), config, progress=False)
    assert result.final["tokens"] == 1000 and result.sae.d_model == 64


def test_safetensors_only_release_directory_loads_by_layer(tmp_path):
    sae = TopKSAE.from_release_state(random_sae_state(d_model=16, d_sae=64, seed=3), k=4)
    out = tmp_path / "SAE-Res-Tiny-W0K-L0_4"
    save_sae(sae, out, 2, formats=("safetensors",))
    assert not (out / "layer2.sae.pt").exists()
    loaded = load(out, 2)
    x = torch.randn(5, 16)
    assert loaded.k == 4
    torch.testing.assert_close(loaded.encode(x), sae.encode(x), rtol=0, atol=0)


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


@pytest.mark.parametrize("layer", [-1, 2.0, True])
def test_save_sae_refuses_a_layer_no_loader_can_find(tmp_path, layer):
    # layer=-1 would write layer-1.sae.pt, which load() and SAEBank never find.
    root = tmp_path / "SAE-Res-MyModel-W0K-L0_8"
    with pytest.raises(ValueError, match=r"layer must be a non-negative int.*got"):
        save_sae(_sae(), root, layer)
    assert not root.exists()


def test_save_sae_accepts_a_numpy_integer_layer(tmp_path):
    import numpy as np

    paths = save_sae(_sae(), tmp_path / "SAE-Res-MyModel-W0K-L0_8", np.int64(3), formats=("pt",))
    assert [p.name for p in paths] == ["layer3.sae.pt"]


@pytest.mark.parametrize("name", ["my-sae-run", "SAE-Res-Qwen3.5-2B-Base-W32K-L0_100"])
def test_a_saved_release_loads_back_by_directory_whatever_its_name_says(tmp_path, name):
    # A plain name gives no k; a published set's name gives the wrong sizes and k: release.json wins over both.
    sae = _sae(3)
    out = save_release({2: sae, 5: _sae(4)}, tmp_path / name)
    back = load(out, 2)
    assert back.k == sae.k and back.d_sae == sae.d_sae and back.release is None
    torch.testing.assert_close(back.W_dec.detach(), sae.W_dec.detach(), rtol=0, atol=0)
    assert load(out, "layer5").layer == 5
    with pytest.raises(ValueError, match=r"k=3 contradicts .*release\.json, which says k="):
        load(out, 2, k=3)


def _finite_batches(n_batches: int, batch: int = 64, d_model: int = 16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, d_model, generator=g) for _ in range(n_batches)]


def test_train_sae_warns_or_raises_when_the_data_runs_out_and_reports_the_trained_tokens():
    config = SAETrainingConfig(d_sae=32, k=4, n_tokens=1000, batch_size=64, log_every=5)
    with pytest.warns(UserWarning, match=r"ran out after 320 of the 1,000 tokens asked for \(5 of 16 steps\)"):
        result = train_sae(_finite_batches(5), config, progress=False)
    assert result.n_tokens == 320 and result.history[-1]["tokens"] == 320
    with pytest.raises(ValueError, match="ran out after 320 of the 1,000 tokens"):
        train_sae(_finite_batches(5), config, progress=False, on_short_data="raise")
    # A Tensor is cycled to the full budget: no warning, the tokens asked for (to the last short batch).
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = train_sae(torch.cat(_finite_batches(5)), config, progress=False)
    assert full.n_tokens == 16 * 64 and full.history[-1]["step"] == 16
