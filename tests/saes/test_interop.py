"""Round trips through sae-lens 6.x TopKSAE: identical encode / decode / forward both ways."""
from __future__ import annotations

import pytest
import torch

from saes import TopKSAE, from_sae_lens, load, to_sae_lens
from tests.factories import D_MODEL, random_sae_state, write_sae_release

sae_lens = pytest.importorskip("sae_lens")


def _sae(seed=0, k=8) -> TopKSAE:
    return TopKSAE.from_release_state(random_sae_state(D_MODEL, 256, seed), k=k)


def test_to_sae_lens_gives_identical_outputs_and_transposed_weights():
    ours = _sae()
    theirs = to_sae_lens(ours)
    assert isinstance(theirs, sae_lens.TopKSAE)
    assert theirs.W_enc.shape == (D_MODEL, 256) and theirs.W_dec.shape == (256, D_MODEL)
    assert theirs.cfg.k == 8 and not theirs.cfg.apply_b_dec_to_input
    x = torch.randn(2, 5, D_MODEL)
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(x), ours.encode(x), rtol=1e-6, atol=1e-6)
        z = ours.encode(x)
        torch.testing.assert_close(theirs.decode(z), ours.decode(z), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs(x), ours(x), rtol=1e-5, atol=1e-5)


def test_from_sae_lens_round_trip_is_bit_exact():
    ours = _sae(seed=4)
    back = from_sae_lens(to_sae_lens(ours))
    assert back.k == ours.k
    for key, value in ours.release_state().items():
        torch.testing.assert_close(back.release_state()[key], value, rtol=0, atol=0)


def test_loaded_release_carries_sae_lens_metadata(tmp_path):
    sae = load(write_sae_release(tmp_path), 3)
    theirs = to_sae_lens(sae, dtype=torch.float64)
    meta = theirs.cfg.metadata
    assert (meta.hook_name, meta.hf_hook_name, meta.model_name) == \
        ("blocks.3.hook_resid_post", "model.layers.3", "Qwen/Qwen3.5-Nano-Base")
    assert theirs.W_enc.dtype == torch.float64
    assert from_sae_lens(theirs).layer == 3


@pytest.mark.parametrize("apply_b_dec_to_input", [False, True])
@pytest.mark.parametrize("rescale", [False, True])
def test_from_sae_lens_folds_b_dec_subtraction_and_decoder_norm_rescaling(apply_b_dec_to_input, rescale):
    cfg = sae_lens.TopKSAEConfig(d_in=D_MODEL, d_sae=256, k=8, dtype="float64", apply_b_dec_to_input=apply_b_dec_to_input,
                                 rescale_acts_by_decoder_norm=rescale)
    theirs = sae_lens.TopKSAE(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        theirs.W_dec.mul_(torch.rand(256, 1, generator=g, dtype=torch.float64) + 0.5)
    ours = from_sae_lens(theirs)
    x = torch.randn(6, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        z = theirs.encode(x)
        assert ((z > 0).sum(-1) > 0).all()
        torch.testing.assert_close(ours.encode(x), z, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ours.decode(z), theirs.decode(z), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-10, atol=1e-10)


def test_from_sae_lens_refuses_what_it_cannot_express():
    cfg = sae_lens.TopKSAEConfig(d_in=D_MODEL, d_sae=256, k=8, normalize_activations="layer_norm")
    with pytest.raises(ValueError, match="normalize_activations='layer_norm'"):
        from_sae_lens(sae_lens.TopKSAE(cfg))
    std = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=D_MODEL, d_sae=256))
    with pytest.raises(TypeError, match="architecture 'topk'"):
        from_sae_lens(std)
