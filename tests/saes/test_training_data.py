"""Activation sources for SAE training: rebatch keeps every token once in exact batches, model_activations reads block
outputs without leaving hooks behind, store_activations reads a collection store's dense chunks."""
from __future__ import annotations

import pytest
import torch

from saes.training_data import model_activations, rebatch, store_activations
from tests.factories import tiny_model


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


def test_model_activations_leaves_no_hook_on_the_model_between_batches():
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
    # A buffer between batch_size and 2 * batch_size must not emit [0, d_model] batches (nan loss in train_sae).
    chunks = [torch.arange(s, s + n, dtype=torch.float32)[:, None] for s, n in [(0, 3), (3, 10), (13, 1), (14, 0),
                                                                               (14, 30)]]
    out = list(rebatch(chunks, batch_size, shuffle_buffer=shuffle_buffer))
    sizes = [b.shape[0] for b in out]
    assert all(n == batch_size for n in sizes[:-1]) and 0 < sizes[-1] <= batch_size, sizes
    assert torch.equal(torch.cat(out).flatten().sort().values, torch.arange(44, dtype=torch.float32))
