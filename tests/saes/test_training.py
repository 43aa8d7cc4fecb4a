"""The TopK SAE trainer: recovers planted directions, folds into the exact release form, saves what saes.load reads."""
from __future__ import annotations

import torch
import pytest

from saes.topk import TopKSAE
from saes.training import SAETrainer, SAETrainingConfig, evaluate_sae, save_release, save_sae, train_sae
from saes.training_data import model_activations, rebatch, store_activations, tensor_batches


def planted(n_tokens: int, d_model: int = 32, n_feat: int = 64, active: int = 3, seed: int = 0):
    """Tokens that are sums of ``active`` of ``n_feat`` unit directions (magnitudes 1-2) plus an offset and noise."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(n_feat, d_model, generator=g)
    dirs = dirs / dirs.norm(dim=1, keepdim=True)
    idx = torch.rand(n_tokens, n_feat, generator=g).argsort(dim=1)[:, :active]
    z = torch.zeros(n_tokens, n_feat).scatter_(1, idx, 1 + torch.rand(n_tokens, active, generator=g))
    return z @ dirs + 0.5 + 0.01 * torch.randn(n_tokens, d_model, generator=g), dirs


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


def test_rebatch_keeps_every_token_and_cuts_exact_batches():
    chunks = [torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 1000 * i for i, n in enumerate([7, 30, 1, 50])]
    everything = torch.cat(chunks)
    for buffer in (0, 40):
        batches = list(rebatch(chunks, 16, shuffle_buffer=buffer, seed=1))
        assert [b.shape[0] for b in batches[:-1]] == [16] * (len(batches) - 1)
        got = torch.cat(batches)
        assert torch.equal(got[got[:, 0].argsort()], everything[everything[:, 0].argsort()])
    assert not torch.equal(torch.cat(list(rebatch(chunks, 16, shuffle_buffer=40))), everything)


def test_model_activations_match_block_outputs():
    from tests.factories import tiny_model

    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (2, 9))
    got = list(model_activations(model, [ids], [0, 2], skip_positions=1))[0]
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    n_hooks = len(model.model.layers[2]._forward_hooks)
    for n in (0, 2):
        torch.testing.assert_close(got[n], hidden[n + 1][:, 1:].reshape(-1, hidden[0].shape[-1]))
    single = next(model_activations(model, [ids], 2, skip_positions=0))
    assert single.shape == (18, 64)
    assert len(model.model.layers[2]._forward_hooks) == n_hooks
    with pytest.raises(ValueError, match="out of range"):
        next(model_activations(model, [ids], 7))


def test_store_activations_reads_dense_chunks():
    data = torch.randn(300, 8)

    class FakeStore:
        points = ["resid_post.1"]

        def iter_chunks(self, point, kind="sae", chunk_tokens=64):
            assert kind == "dense"
            for start in range(0, 300, chunk_tokens):
                yield start, data[start:start + chunk_tokens]

    got = torch.cat(list(store_activations(FakeStore(), "resid_post.1", chunk_tokens=64, shuffle_buffer=128)))
    assert torch.equal(got[got[:, 0].argsort()], data[data[:, 0].argsort()])
    with pytest.raises(ValueError, match="resid_post.0"):
        next(store_activations(FakeStore(), "resid_post.0"))


def test_train_sae_rejects_empty_input():
    with pytest.raises(ValueError, match="no activations"):
        train_sae(iter([]), SAETrainingConfig(d_sae=8, k=2, n_tokens=10), progress=False)


def test_store_activations_prefers_the_stores_shuffled_iterator():
    calls = []

    class ShuffledStore:
        points = ["resid_post.0"]

        def iter_shuffled(self, point, batch_size, buffer_tokens=1 << 20, seed=0, *, kind="dense", dtype=None,
                          drop_last=False):
            calls.append((point, batch_size, buffer_tokens, seed, kind, dtype))
            yield torch.ones(batch_size, 4)

    got = list(store_activations(ShuffledStore(), "resid_post.0", chunk_tokens=32, shuffle_buffer=64, seed=5))
    assert calls == [("resid_post.0", 32, 64, 5, "dense", torch.float32)]
    assert len(got) == 1 and got[0].shape == (32, 4)


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
    import saes
    from tests.factories import random_sae_state

    sae = TopKSAE.from_release_state(random_sae_state(d_model=16, d_sae=64, seed=3), k=4)
    out = tmp_path / "SAE-Res-Tiny-W0K-L0_4"
    save_sae(sae, out, 2, formats=("safetensors",))
    assert not (out / "layer2.sae.pt").exists()
    loaded = saes.load(out, 2)
    x = torch.randn(5, 16)
    assert loaded.k == 4
    torch.testing.assert_close(loaded.encode(x), sae.encode(x), rtol=0, atol=0)
