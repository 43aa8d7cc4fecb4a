"""The float64 reference: recurrence and chunked form agree, varlen equals a per-sequence loop, stages compose."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashqla_kernels.gated_delta_rule.reference import (
    chunk_gated_delta_rule_ref, chunk_local_cumsum_ref, chunk_output_ref, chunk_spans, chunk_states_ref,
    chunk_step_gate_factored_ref, chunk_transition_ref, kkt_inverse_ref, l2norm, recompute_w_u_ref,
    recurrent_gated_delta_rule_ref,
)

F64 = torch.float64


def make_inputs(B, T, Hk, Hv, K=16, V=8, dtype=F64, n_states=None, seed=0):
    """Qwen-like inputs: per-head decay rates from none (head 0, g = 0) to very strong (last head)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, Hk, K, generator=gen, dtype=dtype)
    v = torch.randn(B, T, Hv, V, generator=gen, dtype=dtype)
    a_log = torch.linspace(0, 16, Hv, dtype=dtype)
    g = -a_log * F.softplus(0.5 * torch.randn(B, T, Hv, generator=gen, dtype=dtype) + 1)
    beta = torch.rand(B, T, Hv, generator=gen, dtype=dtype)
    h0 = torch.randn(n_states or B, Hv, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, h0


def _both(*args, **kw):
    return (recurrent_gated_delta_rule_ref(*args, output_final_state=True, **kw),
            chunk_gated_delta_rule_ref(*args, output_final_state=True, **kw))


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_recurrent_and_chunked_agree_in_float64(T, ratio):
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 2 * ratio)
    (o1, s1), (o2, s2) = _both(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert o1.dtype == s1.dtype == F64 and o1.shape == (2, T, 2 * ratio, 8) and s1.shape == (2, 2 * ratio, 16, 8)
    assert (o1 - o2).abs().max() <= 1e-10 and (s1 - s2).abs().max() <= 1e-10
    assert o1.abs().max() > 1e-3


def test_zero_and_strong_decay_heads_agree_and_behave():
    q, k, v, g, beta, h0 = make_inputs(1, 130, 1, 4)
    g[..., 0] = 0.0
    g[..., -1] = -40.0
    (o1, s1), (o2, s2) = _both(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert (o1 - o2).abs().max() <= 1e-10 and (s1 - s2).abs().max() <= 1e-10
    # exp(-40) forgets everything each step: the strong head's state is just the last token's write.
    kn = l2norm(k[0, -1, 0])
    expected = torch.outer(kn, beta[0, -1, -1] * v[0, -1, -1])
    torch.testing.assert_close(s1[0, -1], expected, atol=1e-12, rtol=0)


def test_single_token_matches_hand_computation():
    q, k, v, g, beta, h0 = make_inputs(1, 1, 1, 1, K=4, V=3)
    o, s = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
    S = g[0, 0, 0].exp() * h0[0, 0]
    S = S + torch.outer(k[0, 0, 0], beta[0, 0, 0] * (v[0, 0, 0] - S.T @ k[0, 0, 0]))
    torch.testing.assert_close(s[0, 0], S, atol=1e-14, rtol=0)
    torch.testing.assert_close(o[0, 0, 0], 0.7 * S.T @ q[0, 0, 0], atol=1e-14, rtol=0)


def test_default_scale_is_applied_after_l2norm():
    q, k, v, g, beta, _ = make_inputs(1, 5, 1, 1, K=16)
    o_default, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o_unit, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=1.0, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o_default, o_unit * 16 ** -0.5, atol=1e-14, rtol=0)


@pytest.mark.parametrize("ref", [recurrent_gated_delta_rule_ref, chunk_gated_delta_rule_ref])
def test_varlen_equals_per_sequence_loop(ref):
    lengths = [1, 64, 47, 65, 128, 1, 63]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 2, 4, n_states=len(lengths))
    o, s = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
               cu_seqlens=offsets)
    for n, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        o_n, s_n = recurrent_gated_delta_rule_ref(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                  initial_state=h0[n:n + 1], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
        assert (o[:, a:b] - o_n).abs().max() <= 1e-10, f"sequence {n} (length {b - a})"
        assert (s[n] - s_n[0]).abs().max() <= 1e-10, f"state of sequence {n}"


def test_empty_sequences_and_zero_length_input():
    q, k, v, g, beta, h0 = make_inputs(1, 10, 1, 2, n_states=3)
    offsets = torch.tensor([0, 0, 10, 10])
    for ref in (recurrent_gated_delta_rule_ref, chunk_gated_delta_rule_ref):
        _, s = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=offsets)
        assert torch.equal(s[0], h0[0]) and torch.equal(s[2], h0[2])
        o, s = ref(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], initial_state=h0[:1],
                   output_final_state=True)
        assert o.shape == (1, 0, 2, 8) and torch.equal(s, h0[:1])


def test_gated_inverse_is_gate_free_inverse_times_decay():
    q, k, v, g, beta, _ = make_inputs(1, 100, 2, 4)
    k = l2norm(k)
    gamma = chunk_local_cumsum_ref(g)
    A0, A = kkt_inverse_ref(k, beta), kkt_inverse_ref(k, beta, gamma)
    for b, _, _, s, e in chunk_spans(1, 100):
        gc = gamma[b, s:e]
        diff = gc[:, None, :] - gc[None, :, :]  # [i, j, h]
        mask = torch.ones(e - s, e - s, dtype=torch.bool).tril()[:, :, None]
        Gamma = torch.where(mask, diff, torch.tensor(float("-inf"), dtype=F64)).exp()
        torch.testing.assert_close(A[b, s:e, :, :e - s], (Gamma * A0[b, s:e, :, :e - s].transpose(1, 2))
                                   .transpose(1, 2), atol=1e-12, rtol=0)
    assert A0[0, 64:, :, 36:].abs().max() == 0  # tail chunk of 36 tokens: padded columns stay zero


def test_gate_factored_step_matches_fla_stages_and_transition_maps():
    q, k, v, g, beta, h0 = make_inputs(1, 150, 2, 4)
    q, k = l2norm(q), l2norm(k)
    gamma = chunk_local_cumsum_ref(g)
    w, u = recompute_w_u_ref(k, v, beta, kkt_inverse_ref(k, beta, gamma), gamma)
    h, v_new, final = chunk_states_ref(k, w, u, gamma, h0)
    o = chunk_output_ref(q, k, v_new, h, gamma, 0.3)
    M, bias = chunk_transition_ref(k, beta, gamma, v)
    qe, ke = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    S = h0[0]
    for _, _, i, s, e in chunk_spans(1, 150):
        assert (h[0, i] - S).abs().max() <= 1e-12
        o_c, vn_c, S_next = chunk_step_gate_factored_ref(qe[0, s:e], ke[0, s:e], v[0, s:e], beta[0, s:e],
                                                         gamma[0, s:e], S, 0.3)
        assert (o_c - o[0, s:e]).abs().max() <= 1e-12 and (vn_c - v_new[0, s:e]).abs().max() <= 1e-12
        assert (M[0, i] @ S + bias[0, i] - S_next).abs().max() <= 1e-12
        S = S_next
    assert (S - final[0]).abs().max() <= 1e-12


def test_bad_shapes_raise_actionable_errors():
    q, k, v, g, beta, h0 = make_inputs(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"multiple of q/k heads Hk=2"):
        recurrent_gated_delta_rule_ref(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match=r"initial_state must be \[N, Hv, K, V\] = \[1,4,16,8\]"):
        chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0[:, :2])
    with pytest.raises(ValueError, match="end at most at T=8"):
        chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="B must be 1"):
        chunk_gated_delta_rule_ref(*(x.expand(2, *x.shape[1:]) for x in (q, k, v, g, beta)),
                                   cu_seqlens=torch.tensor([0, 8]))
