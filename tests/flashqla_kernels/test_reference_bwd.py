"""The float64 backward reference: the composed stages equal autograd of the recurrence, each stage autograd of its
forward stage, varlen keeps sequences apart and a padded tail gets exactly zero gradients."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.gated_delta_rule.reference import (
    chunk_local_cumsum_ref, chunk_output_ref, chunk_states_ref, kkt_inverse_ref, l2norm, recompute_w_u_ref,
    recurrent_gated_delta_rule_ref,
)
from flashqla_kernels.gated_delta_rule.reference_bwd import (
    chunk_bwd_dh_ref, chunk_bwd_dqkwg_ref, chunk_bwd_dv_local_ref, chunk_bwd_recompute_ref, chunk_bwd_wy_ref,
    chunk_bwd_step_ref, chunk_gated_delta_rule_bwd_ref, chunk_local_cumsum_bwd_ref, gva_reduce_ref, l2norm_bwd_ref,
)
from tests.flashqla_kernels.test_reference import make_inputs

F64 = torch.float64
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _cotangents(T, Hv, n_states, K=16, V=8, B=1, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, Hv, V, generator=gen, dtype=F64), torch.randn(n_states, Hv, K, V, generator=gen,
                                                                             dtype=F64))


def _grad(fn, inputs, cotangents):
    """autograd of sum_i <fn(inputs)_i, cotangents_i> w.r.t. every input that is not None."""
    leaves = [x.clone().requires_grad_() if x is not None else None for x in inputs]
    outs = fn(*leaves)
    loss = sum((o * c).sum() for o, c in zip(outs, cotangents) if c is not None)
    grads = iter(torch.autograd.grad(loss, [x for x in leaves if x is not None]))
    return [next(grads) if x is not None else None for x in leaves]


def _autograd_of_recurrence(q, k, v, g, beta, h0, do, dht, **kw):
    def fn(q, k, v, g, beta, h0):
        return recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    return _grad(fn, (q, k, v, g, beta, h0), (do, dht))


def _assert_close(got, want, names, tol=1e-10):
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == F64 and a.shape == b.shape, name
        err = (a - b).abs().max().item() if a.numel() else 0.0
        assert err <= tol * max(1.0, b.abs().max().item()), f"{name}: {err:.3e}"


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_backward_equals_autograd_of_the_recurrence(T, ratio):
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 2 * ratio)
    do, dht = _cotangents(T, 2 * ratio, 2, B=2)
    want = _autograd_of_recurrence(q, k, v, g, beta, h0, do, dht, use_qk_l2norm_in_kernel=True)
    got = chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, initial_state=h0, use_qk_l2norm_in_kernel=True)
    _assert_close(got, want, NAMES)
    assert min(x.abs().max() for x in got) > 1e-3


def test_backward_without_l2norm_with_explicit_scale_and_float32_inputs():
    q, k, v, g, beta, h0 = make_inputs(2, 130, 1, 2)
    q, k = 0.25 * q, 0.25 * k
    do, dht = _cotangents(130, 2, 2, B=2)
    want = _autograd_of_recurrence(q, k, v, g, beta, h0, do, dht, scale=0.3)
    got = chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, scale=0.3, initial_state=h0)
    _assert_close(got, want, NAMES)
    got32 = chunk_gated_delta_rule_bwd_ref(*(x.float() for x in (q, k, v, g, beta, do, dht)), scale=0.3,
                                           initial_state=h0.float())
    assert all(x.dtype == torch.float32 for x in got32)


def test_zero_and_saturating_decay_heads():
    q, k, v, g, beta, h0 = make_inputs(1, 130, 1, 4)
    g[..., 0] = 0.0
    g[..., -1] = -40.0
    do, dht = _cotangents(130, 4, 1)
    want = _autograd_of_recurrence(q, k, v, g, beta, h0, do, dht, use_qk_l2norm_in_kernel=True)
    got = chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, initial_state=h0, use_qk_l2norm_in_kernel=True)
    _assert_close(got, want, NAMES)


def test_varlen_backward_keeps_sequences_apart_and_the_padded_tail_at_zero():
    lengths, tail = [1, 64, 47, 65, 1, 130, 63], 5
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, N = sum(lengths) + tail, len(lengths)
    q, k, v, g, beta, h0 = make_inputs(1, T, 2, 4, n_states=N)
    do, dht = _cotangents(T, 4, N)
    kw = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    want = _autograd_of_recurrence(q, k, v, g, beta, h0, do, dht, **kw)
    got = chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, initial_state=h0, **kw)
    _assert_close(got, want, NAMES)
    for name, x in zip(NAMES[:5], got):
        assert torch.equal(x[:, -tail:], torch.zeros_like(x[:, -tail:])), name
    # each sequence alone: no gradient leaks across a sequence start
    for n, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        alone = chunk_gated_delta_rule_bwd_ref(*(x[:, a:b] for x in (q, k, v, g, beta, do)), dht[n:n + 1],
                                               initial_state=h0[n:n + 1], use_qk_l2norm_in_kernel=True)
        _assert_close([x[:, a:b] for x in got[:5]] + [got[5][n:n + 1]], alone, NAMES, tol=1e-12)


def test_without_initial_state_or_dht_and_with_empty_sequences():
    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 2, n_states=3)
    do, dht = _cotangents(70, 2, 3)
    want = _autograd_of_recurrence(q, k, v, g, beta, None, do, None)
    _assert_close(chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do), want, NAMES)
    offsets = torch.tensor([0, 0, 70, 70])
    *_, dh0 = chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=offsets)
    assert torch.equal(dh0[0], dht[0]) and torch.equal(dh0[2], dht[2])


def _stage_inputs(T=150, Hv=4, cu_seqlens=None, N=1):
    q, k, v, g, beta, h0 = make_inputs(1, T, Hv, Hv, n_states=N)
    q, k = l2norm(q), l2norm(k)
    fwd = chunk_bwd_recompute_ref(k, v, g, beta, h0, cu_seqlens)
    return q, k, v, g, beta, h0, fwd


def test_dv_local_is_the_output_gradient_of_v_new():
    q, k, v, g, beta, h0, fwd = _stage_inputs()
    do, _ = _cotangents(150, 4, 1)
    (want,) = _grad(lambda vn: (chunk_output_ref(q, k, vn, fwd.h, fwd.gamma, 0.3),), (fwd.v_new,), (do,))
    assert (chunk_bwd_dv_local_ref(q, k, do, fwd.gamma, 0.3) - want).abs().max() <= 1e-12


def test_state_and_dqkwg_stages_equal_autograd_of_the_state_and_output_stages():
    offsets = torch.tensor([0, 1, 101, 165, 195])  # lengths 1, 100, 64, 30
    q, k, v, g, beta, h0, fwd = _stage_inputs(195, cu_seqlens=offsets, N=4)
    do, dht = _cotangents(195, 4, 4)

    def fn(q, k, w, u, gamma, h0):
        h, v_new, final = chunk_states_ref(k, w, u, gamma, h0, offsets)
        return chunk_output_ref(q, k, v_new, h, gamma, 0.3, offsets), final
    want = _grad(fn, (q, k, fwd.w, fwd.u, fwd.gamma, h0), (do, dht))
    dv_local = chunk_bwd_dv_local_ref(q, k, do, fwd.gamma, 0.3, offsets)
    dh, dv, dh0 = chunk_bwd_dh_ref(q, k, fwd.w, do, dv_local, fwd.gamma, 0.3, dht, offsets)
    dq, dk, dw, dgamma = chunk_bwd_dqkwg_ref(q, k, fwd.v_new, fwd.w, fwd.h, dh, do, dv, fwd.gamma, 0.3, offsets)
    _assert_close([dq, dk, dw, dv, dgamma, dh0], want, ("dq", "dk", "dw", "du", "dgamma", "dh0"), tol=1e-12)


def test_dh_is_the_gradient_of_the_state_leaving_each_chunk():
    q, k, v, g, beta, h0, fwd = _stage_inputs(200)
    do, dht = _cotangents(200, 4, 1)
    dv_local = chunk_bwd_dv_local_ref(q, k, do, fwd.gamma, 0.3)
    dh, _, _ = chunk_bwd_dh_ref(q, k, fwd.w, do, dv_local, fwd.gamma, 0.3, dht)
    assert torch.equal(dh[0, -1], dht[0])
    for i in range(dh.shape[1] - 1):
        s = 64 * (i + 1)
        sl = [x[:, s:] for x in (q, k, fwd.w, fwd.u, fwd.gamma)]

        def suffix(S):
            h, v_new, final = chunk_states_ref(sl[1], sl[2], sl[3], sl[4], S)
            return chunk_output_ref(sl[0], sl[1], v_new, h, sl[4], 0.3), final
        (want,) = _grad(suffix, (fwd.h[:, i + 1],), (do[:, s:], dht))
        assert (dh[0, i] - want[0]).abs().max() <= 1e-12, f"chunk {i}"


def test_wy_stage_is_the_backward_of_kkt_inverse_and_recompute_w_u():
    offsets = torch.tensor([0, 1, 66, 130, 131])
    q, k, v, g, beta, h0, fwd = _stage_inputs(140, cu_seqlens=offsets, N=4)
    gen = torch.Generator().manual_seed(2)
    dw, du = torch.randn(fwd.w.shape, generator=gen, dtype=F64), torch.randn(fwd.u.shape, generator=gen, dtype=F64)

    def fn(k, v, beta, gamma):
        return recompute_w_u_ref(k, v, beta, kkt_inverse_ref(k, beta, gamma, offsets), gamma, offsets)
    want = _grad(fn, (k, v, beta, fwd.gamma), (dw, du))
    got = chunk_bwd_wy_ref(k, v, beta, fwd.A, fwd.gamma, dw, du, offsets)
    _assert_close(got, want, ("dk", "dv", "dbeta", "dgamma"), tol=1e-12)
    assert torch.equal(got[0][:, 131:], torch.zeros_like(got[0][:, 131:]))


def test_cumsum_gva_and_l2norm_backwards_equal_autograd():
    q, k, v, g, beta, h0 = make_inputs(1, 140, 2, 8)
    offsets = torch.tensor([0, 1, 65, 130])
    dgamma, dq = torch.randn_like(g), torch.randn(1, 140, 8, 16, dtype=F64)
    (want,) = _grad(lambda g: (chunk_local_cumsum_ref(g, offsets),), (g,), (dgamma,))
    assert (chunk_local_cumsum_bwd_ref(dgamma, offsets) - want).abs().max() <= 1e-12
    (want,) = _grad(lambda q: (q.repeat_interleave(4, dim=2),), (q,), (dq,))
    assert (gva_reduce_ref(dq, 2) - want).abs().max() <= 1e-12
    (want,) = _grad(lambda q: (l2norm(q),), (q,), (dq[:, :, :2],))
    assert (l2norm_bwd_ref(q, dq[:, :, :2]) - want).abs().max() <= 1e-12


def test_bad_gradient_shapes_raise_actionable_errors():
    q, k, v, g, beta, h0 = make_inputs(1, 8, 2, 4)
    do, dht = _cotangents(8, 4, 1)
    with pytest.raises(ValueError, match=r"do must be the gradient of o, \[B, T, Hv, V\] = \[1,8,4,8\]"):
        chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do[:, :4])
    with pytest.raises(ValueError, match=r"dht must be .* \[N, Hv, K, V\] = \[1,4,16,8\]"):
        chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht[:, :2])


@pytest.mark.parametrize("T", [1, 64, 200])
def test_a_walk_of_chunk_steps_back_over_a_sequence_is_the_whole_backward(T):
    """The fused walk's contract: per value head, going back over the chunks and handing each step the state entering
    its chunk (the forward's h) and the dS its successor returned, gives every gradient of the composed backward
    (ragged last chunk, a head with g = 0 and one with strong decay, h0 and dht), dh0 the last dS."""
    Hv, K, V = 3, 16, 8
    q, k, v, g, beta, h0 = make_inputs(1, T, Hv, Hv, K, V)
    q, k = l2norm(q), l2norm(k)
    do, dht = _cotangents(T, Hv, 1, K, V)
    scale = 0.3
    want = chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, scale=scale, initial_state=h0)
    fwd = chunk_bwd_recompute_ref(k, v, g, beta, h0)
    got = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
    dh0 = torch.zeros_like(h0)
    for h in range(Hv):
        dS = dht[0, h]
        for c in reversed(range(-(-T // 64))):
            s, e = 64 * c, min(64 * c + 64, T)
            step = chunk_bwd_step_ref(q[0, s:e, h], k[0, s:e, h], v[0, s:e, h], fwd.gamma[0, s:e, h],
                                      beta[0, s:e, h], fwd.h[0, c, h], dS, do[0, s:e, h], scale)
            for out, part in zip(got, step[:5]):
                out[0, s:e, h] = part
            dS = step[5]
        dh0[0, h] = dS
    _assert_close(got + [dh0], want, NAMES)
