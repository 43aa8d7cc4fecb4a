"""TopKSAE math against an independent float64 (numpy) computation, dtypes, edge cases and input errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from saes import SparseCodes, TopKSAE
from tests.factories import random_sae_state

D_MODEL, D_SAE, K = 32, 128, 8


def _sae(k=K, seed=0, **kwargs) -> TopKSAE:
    return TopKSAE.from_release_state(random_sae_state(D_MODEL, D_SAE, seed), k=k, **kwargs)


def _ref_encode(state, x, k):
    """ReLU then top-k in float64 numpy, from the raw release tensors."""
    w_enc, b_enc = state["W_enc"].double().numpy(), state["b_enc"].double().numpy()
    pre = x.double().numpy().reshape(-1, w_enc.shape[1]) @ w_enc.T + b_enc
    act = np.maximum(pre, 0.0)
    out = np.zeros_like(act)
    for row, a in enumerate(act):
        keep = np.argsort(-a, kind="stable")[:k]
        out[row, keep] = a[keep]
    return out.reshape(*x.shape[:-1], w_enc.shape[0])


def _ref_decode(state, z):
    w_dec, b_dec = state["W_dec"].double().numpy(), state["b_dec"].double().numpy()
    return z @ w_dec.T + b_dec


@pytest.mark.parametrize("shape", [(D_MODEL,), (5, D_MODEL), (2, 3, D_MODEL), (1, 1, 4, D_MODEL)])
def test_encode_decode_match_float64_reference_for_any_batch_shape(shape):
    sae = _sae()
    state = random_sae_state(D_MODEL, D_SAE, 0)
    x = torch.randn(shape)
    z_ref = _ref_encode(state, x, K)
    z = sae.encode(x)
    assert z.shape == (*shape[:-1], D_SAE) and z.dtype == torch.float32
    np.testing.assert_allclose(z.detach().numpy(), z_ref, rtol=1e-5, atol=1e-5)
    assert ((z != 0).sum(-1) == K).all()
    np.testing.assert_allclose(sae.decode(z).detach().numpy(), _ref_decode(state, z_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sae(x).detach().numpy(), _ref_decode(state, z_ref), rtol=1e-4, atol=1e-4)


def test_float64_input_is_computed_in_float64():
    sae = _sae().double()
    state = random_sae_state(D_MODEL, D_SAE, 0)
    x = torch.randn(7, D_MODEL, dtype=torch.float64)
    z_ref = _ref_encode(state, x, K)
    np.testing.assert_allclose(sae.encode(x).detach().numpy(), z_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sae(x).detach().numpy(), _ref_decode(state, z_ref), rtol=1e-12, atol=1e-12)


def test_pre_acts_have_no_b_dec_subtraction():
    state = random_sae_state(D_MODEL, D_SAE, 0)
    state["b_dec"] = torch.full((D_MODEL,), 3.0)
    sae = TopKSAE.from_release_state(state, k=K)
    x = torch.randn(4, D_MODEL, dtype=torch.float64)
    ref = x.numpy() @ state["W_enc"].double().numpy().T + state["b_enc"].double().numpy()
    np.testing.assert_allclose(sae.pre_acts(x).detach().numpy(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_fp32_and_return_input_dtype(dtype):
    sae = _sae()
    x = torch.randn(6, D_MODEL).to(dtype)
    expected = sae.encode(x.float())
    z = sae.encode(x)
    assert z.dtype == dtype
    torch.testing.assert_close(z, expected.to(dtype), rtol=0, atol=0)
    codes = sae.encode_sparse(x)
    assert codes.values.dtype == dtype and codes.indices.dtype == torch.int64
    assert sae(x).dtype == dtype and sae.error(x).dtype == dtype and sae.pre_acts(x).dtype == dtype
    torch.testing.assert_close(sae(x), sae(x.float()).to(dtype), rtol=0, atol=0)


def test_bf16_weights_compute_in_fp32_by_default_and_in_bf16_when_told():
    sae = _sae().to(torch.bfloat16)
    x = torch.randn(6, D_MODEL).to(torch.bfloat16)
    fp32 = TopKSAE.from_release_state({k: v.float() for k, v in sae.release_state().items()}, k=K)
    torch.testing.assert_close(sae(x), fp32(x.float()).to(torch.bfloat16), rtol=0, atol=0)
    sae.compute_dtype = torch.bfloat16
    assert sae(x).dtype == torch.bfloat16
    torch.testing.assert_close(sae(x).float(), fp32(x.float()), rtol=0.05, atol=0.1)


def test_encode_sparse_is_sorted_and_equals_dense_encode():
    sae = _sae()
    x = torch.randn(3, 5, D_MODEL)
    codes = sae.encode_sparse(x)
    assert isinstance(codes, SparseCodes) and codes.values.shape == (3, 5, K) and codes.k == K
    assert (codes.values[..., :-1] >= codes.values[..., 1:]).all()
    torch.testing.assert_close(codes.to_dense(D_SAE), sae.encode(x))
    torch.testing.assert_close(sae.decode(codes), sae.decode(sae.encode(x)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sae.error(x), x - sae(x))


def test_fewer_positive_pre_acts_than_k_pad_with_zero_values():
    state = random_sae_state(D_MODEL, D_SAE, 0)
    state["b_enc"] = torch.full((D_SAE,), -100.0)
    state["b_enc"][[3, 40, 77]] = 100.0  # exactly 3 features can be positive
    sae = TopKSAE.from_release_state(state, k=K)
    x = torch.randn(4, D_MODEL)
    z = sae.encode(x)
    assert ((z != 0).sum(-1) == 3).all()
    np.testing.assert_allclose(z.detach().numpy(), _ref_encode(state, x, K), rtol=1e-5, atol=1e-5)
    codes = sae.encode_sparse(x)
    assert codes.values.shape == (4, K)
    assert (codes.values[:, 3:] == 0).all() and (codes.values[:, :3] > 0).all()
    assert set(codes.indices[:, :3].flatten().tolist()) == {3, 40, 77}
    assert ((codes.indices >= 0) & (codes.indices < D_SAE)).all()
    torch.testing.assert_close(sae.decode(codes), sae.decode(z), rtol=1e-5, atol=1e-5)


def test_all_negative_pre_acts_give_zero_codes_and_b_dec_reconstruction():
    state = random_sae_state(D_MODEL, D_SAE, 0)
    state["b_enc"] = torch.full((D_SAE,), -1e4)
    sae = TopKSAE.from_release_state(state, k=K)
    x = torch.randn(2, D_MODEL)
    assert (sae.encode(x) == 0).all()
    torch.testing.assert_close(sae(x), state["b_dec"].expand(2, -1))


def test_feature_codes_equal_the_dense_codes_at_those_features():
    sae = _sae()
    x = torch.randn(3, 5, D_MODEL)
    dense = sae.encode(x)
    # features inside and outside each token's top k, and ones whose pre-activation is negative
    features = torch.randint(0, D_SAE, (3, 5, 6))
    features[..., 0] = sae.encode_sparse(x).indices[..., 0]
    features[..., 1] = sae.encode_sparse(x).indices[..., K - 1]
    torch.testing.assert_close(sae.feature_codes(x, features), dense.gather(-1, features), rtol=0, atol=0)
    # one feature list for every token broadcasts
    shared = torch.tensor([0, 5, 127])
    torch.testing.assert_close(sae.feature_codes(x, shared), dense[..., shared], rtol=0, atol=0)
    assert sae.feature_codes(x.double(), shared).dtype == torch.float64


def test_ties_keep_exactly_k_of_the_largest_values():
    state = random_sae_state(D_MODEL, D_SAE, 0)
    state["W_enc"][:] = state["W_enc"][0]  # every feature gets the same pre-activation
    state["b_enc"][:] = 0.5
    sae = TopKSAE.from_release_state(state, k=K)
    x = torch.randn(3, D_MODEL)
    z = sae.encode(x)
    pre = sae.pre_acts(x)[:, :1].clamp_min(0)
    for row in range(3):
        nonzero = z[row][z[row] != 0]
        expected = K if pre[row] > 0 else 0
        assert nonzero.numel() == expected
        torch.testing.assert_close(nonzero, pre[row].expand(expected))


def test_decode_accepts_sparse_codes_of_any_width():
    sae = _sae()
    state = random_sae_state(D_MODEL, D_SAE, 0)
    idx = torch.tensor([[1, 5, 5], [0, 127, 64]])
    val = torch.tensor([[1.0, 2.0, 0.5], [-1.0, 0.25, 3.0]], dtype=torch.float64)
    dense = np.zeros((2, D_SAE))
    np.add.at(dense, (np.repeat([0, 1], 3), idx.flatten().numpy()), val.flatten().numpy())
    out = sae.double().decode(SparseCodes(val, idx))
    np.testing.assert_allclose(out.detach().numpy(), _ref_decode(state, dense), rtol=1e-12, atol=1e-12)


def test_gradients_of_sparse_path_match_dense_path():
    sae = _sae()
    x = torch.randn(4, D_MODEL)
    sae(x).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in sae.named_parameters()}
    sae.zero_grad()
    sae.decode(sae.encode(x)).pow(2).sum().backward()
    for name, p in sae.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5)


def test_decoder_directions_are_decoder_columns():
    sae = _sae()
    state = random_sae_state(D_MODEL, D_SAE, 0)
    torch.testing.assert_close(sae.decoder_directions([3, 0, 9]), state["W_dec"][:, [3, 0, 9]].T)
    assert sae.decoder_directions(7).shape == (1, D_MODEL)
    torch.testing.assert_close(sae.decoder_directions(torch.tensor([7]))[0], state["W_dec"][:, 7])
    torch.testing.assert_close(sae.decoder_norms(), state["W_dec"].norm(dim=0))
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        sae.decoder_directions([D_SAE])


def test_release_state_round_trips_and_sizes_are_exposed():
    state = random_sae_state(D_MODEL, D_SAE, 3)
    sae = TopKSAE.from_release_state({**state, "extra": torch.zeros(1)}, k=K)
    assert (sae.d_model, sae.d_sae, sae.k) == (D_MODEL, D_SAE, K)
    out = sae.release_state()
    assert list(out) == ["W_enc", "W_dec", "b_enc", "b_dec"]
    for key in out:
        torch.testing.assert_close(out[key], state[key], rtol=0, atol=0)
    assert "d_sae=128" in repr(sae)


def test_an_sae_builds_from_another_saes_weights_sharing_them():
    """benchmarks and users re-wrap an SAE's tensors (e.g. with another compute dtype): the guarded weight classes
    are built from plain tensors, so this works on every supported torch (older ones refuse a Parameter subclass
    built from another subclass instance)."""
    sae = _sae()
    other = TopKSAE(sae.W_enc, sae.W_dec, sae.b_enc, sae.b_dec, k=K, compute_dtype=torch.float64)
    assert type(other.W_enc) is type(sae.W_enc) and type(other.W_dec) is type(sae.W_dec)
    assert other.W_enc.data_ptr() == sae.W_enc.data_ptr() and other.W_dec.data_ptr() == sae.W_dec.data_ptr()
    x = torch.randn(4, D_MODEL)
    torch.testing.assert_close(other.encode(x), sae.encode(x.double()).to(other.encode(x).dtype))
    with pytest.raises(IndexError, match="W_dec is"):
        other.W_dec[0]


def test_bad_inputs_raise_clear_errors():
    sae = _sae()
    with pytest.raises(ValueError, match="d_model=32"):
        sae.encode(torch.randn(2, 31))
    with pytest.raises(TypeError, match="floating-point"):
        sae.encode(torch.ones(2, D_MODEL, dtype=torch.long))
    with pytest.raises(ValueError, match="d_sae=128"):
        sae.decode(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        sae.decode(SparseCodes(torch.ones(1, 2), torch.tensor([[0, 500]])))
    state = random_sae_state(D_MODEL, D_SAE, 0)
    for k in (0, D_SAE + 1, 2.0):
        with pytest.raises(ValueError, match="k must be"):
            TopKSAE.from_release_state(state, k=k)
    with pytest.raises(ValueError, match="looks transposed"):
        TopKSAE.from_release_state({**state, "W_dec": state["W_dec"].T}, k=K)
    with pytest.raises(KeyError, match="b_dec"):
        TopKSAE.from_release_state({k: v for k, v in state.items() if k != "b_dec"}, k=K)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    sae = _sae()
    x = torch.randn(4, 3, D_MODEL)
    gpu = _sae().cuda()
    torch.testing.assert_close(gpu(x.cuda().bfloat16()).cpu(), sae(x.bfloat16()), rtol=0.02, atol=0.02)
    torch.testing.assert_close(gpu.encode(x.cuda()).cpu(), sae.encode(x), rtol=1e-4, atol=1e-4)


def test_reconstruction_and_error_skip_the_host_side_index_check(monkeypatch):
    """The range check of user-given SparseCodes reads indices on the host (a device sync on CUDA); codes from the
    SAE's own top-k need none, so forward and error never run it."""
    sae = _sae()
    x = torch.randn(4, D_MODEL)
    want_recon, want_err = sae(x), sae.error(x)

    def no_host_read(*_):
        raise AssertionError("the index range check ran")

    monkeypatch.setattr(torch, "aminmax", no_host_read)
    torch.testing.assert_close(sae(x), want_recon, rtol=0, atol=0)
    torch.testing.assert_close(sae.error(x), want_err, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="range check"):
        sae.decode(sae.encode_sparse(x))
