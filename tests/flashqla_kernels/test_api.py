"""The public op on CPU: torch path vs the float64 reference and transformers' fallback, dtypes, strides, varlen,
gradients, the decode step, and dispatch (verifiers, reasons, forced backends, the recurrent op's grad fallback)."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

from flashqla_kernels import chunk_gated_delta_rule, explain_backend, recurrent_gated_delta_rule
from flashqla_kernels.gated_delta_rule import api
from flashqla_kernels.gated_delta_rule.reference import (
    chunk_gated_delta_rule_ref, l2norm, recurrent_gated_delta_rule_ref,
)
from tests.flashqla_kernels.test_reference import make_inputs

OPS = [chunk_gated_delta_rule, recurrent_gated_delta_rule]


def rel_l2(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("op", OPS, ids=["chunk", "recurrent"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_torch_path_matches_float64_reference(op, T, ratio):
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 2 * ratio)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == s.dtype == torch.float64
    assert (o - o_ref).abs().max() <= 1e-10 and (s - s_ref).abs().max() <= 1e-10


@pytest.mark.parametrize("op", OPS, ids=["chunk", "recurrent"])
def test_varlen_matches_reference_with_tiny_and_boundary_lengths(op):
    lengths = [1, 47, 64, 65, 1, 128]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 2, 4, n_states=len(lengths))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    o_ref, s_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, **kw)
    o, s = op(q, k, v, g, beta, **kw)
    assert (o - o_ref).abs().max() <= 1e-10 and (s - s_ref).abs().max() <= 1e-10


@pytest.mark.parametrize("op", OPS + [chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref],
                         ids=["chunk", "recurrent", "chunk_ref", "recurrent_ref"])
def test_padded_tail_after_the_last_sequence_is_ignored_and_its_outputs_are_zero(op):
    """cu_seqlens[-1] < T (FlashQLA's packed batches): the sequences equal the unpadded call, the tail is 0."""
    lengths, pad = [47, 65], 13
    offsets = torch.tensor([0, 47, 112], dtype=torch.int32)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths) + pad, 2, 4, n_states=len(lengths))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    o, s = op(q, k, v, g, beta, **kw)
    n = sum(lengths)
    o_ref, s_ref = chunk_gated_delta_rule_ref(*(x[:, :n] for x in (q, k, v, g, beta)), **kw)
    assert o.shape == v.shape
    assert (o[:, :n] - o_ref).abs().max() <= 1e-10 and (s - s_ref).abs().max() <= 1e-10
    assert torch.equal(o[:, n:], torch.zeros_like(o[:, n:]))


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_low_precision_inputs_give_q_dtype_output_and_fp32_state(dtype, bound):
    q, k, v, g, beta, h0 = make_inputs(1, 150, 2, 4, K=32, V=32)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    o, s = chunk_gated_delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.to(dtype),
                                  initial_state=h0.float(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel_l2(o, o_ref) <= bound and rel_l2(s, s_ref) <= bound


def test_non_contiguous_inputs_like_transformers_channels_first_views():
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 4, dtype=torch.float32)
    B, T, Hk, K = q.shape
    # transformers splits a [B, C, T] conv output transposed back to [B, T, C]: strides (C*T, 1, K*T, T).
    mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1).transpose(1, 2)
    mixed = mixed.contiguous().transpose(1, 2)
    qs, ks, vs = torch.split(mixed, [Hk * K, Hk * K, v.shape[2] * v.shape[3]], dim=-1)
    qs, ks, vs = qs.reshape(B, T, Hk, K), ks.reshape(B, T, Hk, K), vs.reshape(B, T, *v.shape[2:])
    assert not qs.is_contiguous()
    g_nc, beta_nc = g.transpose(0, 1).contiguous().transpose(0, 1), beta.mT.contiguous().mT
    o1, s1 = chunk_gated_delta_rule(qs, ks, vs, g_nc, beta_nc, initial_state=h0, output_final_state=True)
    o2, s2 = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=0)
    torch.testing.assert_close(s1, s2, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("heads", ["hk", "hv"], ids=["qk_with_Hk_heads_5.23+", "qk_with_Hv_heads_5.22-"])
def test_equals_transformers_torch_fallback(family, heads):
    import importlib

    import transformers

    if heads == "hk" and tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 23):
        pytest.skip(f"transformers {transformers.__version__}'s torch fallback takes q/k with Hv heads only "
                    "(native GVA in the op arrived in 5.23)")
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 4, dtype=torch.float32)
    if heads == "hv":
        q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for ours, theirs, n in ((chunk_gated_delta_rule, mod.torch_chunk_gated_delta_rule, 70),
                            (recurrent_gated_delta_rule, mod.torch_recurrent_gated_delta_rule, 3)):
        theirs = getattr(theirs, "__wrapped__", theirs)
        args = [x[:, :n] for x in (q, k, v, g, beta)]
        o1, s1 = ours(*args, **kw)
        o2, s2 = theirs(*args, **kw)
        torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-4)


def test_gradients_match_float64_autograd_of_the_reference():
    lengths = [1, 70, 64]
    offsets = torch.tensor([0, 1, 71, 135])
    inputs = [x.requires_grad_() for x in make_inputs(1, sum(lengths), 1, 2, K=8, V=4, n_states=3)]
    q, k, v, g, beta, h0 = inputs
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(1, sum(lengths), 2, 4, generator=gen, dtype=torch.float64)
    dht = torch.randn(3, 2, 8, 4, generator=gen, dtype=torch.float64)

    def grads(fn):
        o, s = fn(q, k, v, g, beta, **kw)
        return torch.autograd.grad((o * do).sum() + (s * dht).sum(), inputs)

    for ours, ref in zip(grads(chunk_gated_delta_rule), grads(recurrent_gated_delta_rule_ref)):
        assert ref.abs().max() > 0
        assert (ours - ref).abs().max() <= 1e-9 * max(1.0, ref.abs().max().item())


def test_decode_steps_continue_a_chunked_prefill():
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 4)
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    o, state = chunk_gated_delta_rule(*(x[:, :66] for x in (q, k, v, g, beta)), initial_state=h0,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    steps = [o]
    for t in range(66, 70):
        o_t, state = recurrent_gated_delta_rule(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), initial_state=state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
        steps.append(o_t)
    assert (torch.cat(steps, 1) - o_full).abs().max() <= 1e-12 and (state - s_full).abs().max() <= 1e-12


def test_zero_length_input_returns_empty_output_and_the_initial_state():
    q, k, v, g, beta, h0 = make_inputs(2, 0, 1, 2)
    for op in OPS:
        o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert o.shape == (2, 0, 2, 8) and torch.equal(s, h0)
    q, k, v, g, beta, h0 = make_inputs(1, 10, 1, 2, n_states=3)
    offsets = torch.tensor([0, 0, 10, 10])  # empty sequences keep their initial state
    for op in OPS:
        o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=offsets,
                  use_qk_l2norm_in_kernel=True)
        o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      cu_seqlens=offsets, use_qk_l2norm_in_kernel=True)
        assert torch.equal(s[0], h0[0]) and torch.equal(s[2], h0[2])
        assert (o - o_ref).abs().max() <= 1e-10 and (s - s_ref).abs().max() <= 1e-10


def test_scale_zero_is_honoured_not_replaced_by_default():
    q, k, v, g, beta, _ = make_inputs(1, 10, 1, 1)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.0)
    assert o.abs().max() == 0


def test_explain_backend_on_cpu_names_the_reason():
    q, k, v, g, beta, _ = make_inputs(1, 8, 1, 2)
    text = explain_backend(q, k, v, g, beta)
    assert text.splitlines()[0] == "chunk_gated_delta_rule: backend torch" and "tensors are on cpu" in text
    assert explain_backend(q, k, v, g, beta, backend="torch").startswith("chunk_gated_delta_rule: backend torch")
    recurrent = explain_backend(q, k, v, g, beta, backend="tilelang", op="recurrent")
    assert recurrent.startswith("recurrent_gated_delta_rule: error:") and "tensors are on cpu" in recurrent


def test_forced_tilelang_on_cpu_and_unknown_backend_raise_clear_errors():
    q, k, v, g, beta, _ = make_inputs(1, 8, 1, 2)
    with pytest.raises(ValueError, match=r"backend='tilelang' cannot run chunk_gated_delta_rule.*on cpu"):
        chunk_gated_delta_rule(q, k, v, g, beta, backend="tilelang")
    with pytest.raises(ValueError, match=r"backend='tilelang' cannot run recurrent_gated_delta_rule.*on cpu"):
        recurrent_gated_delta_rule(q, k, v, g, beta, backend="tilelang")
    with pytest.raises(ValueError, match=r"backend must be None \(automatic\), 'tilelang' or 'torch'; got 'triton'"):
        chunk_gated_delta_rule(q, k, v, g, beta, backend="triton")


def test_dispatch_uses_kernels_when_verifiers_pass_with_or_without_grad(monkeypatch):
    """The chunk op has a backward: inputs requiring grad keep the kernels. The recurrent kernel is forward-only:
    its grad inputs take the torch path with one warning, and backend='tilelang' raises."""
    q, k, v, g, beta, _ = make_inputs(1, 8, 1, 2)
    calls = []

    def fake_kernel(*args):
        calls.append(args)
        return torch.zeros(1, 8, 2, 8), None

    monkeypatch.setattr(api, "_verifiers", lambda op, *a: ())
    monkeypatch.setattr(api, "_tilelang_chunk", fake_kernel)
    monkeypatch.setattr(api, "_warned_grad", False)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    assert len(calls) == 1 and o.abs().max() == 0
    assert explain_backend(q, k, v, g, beta).startswith("chunk_gated_delta_rule: backend tilelang")

    qg = q.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunk_gated_delta_rule(qg, k, v, g, beta)
        chunk_gated_delta_rule(qg, k, v, g, beta, backend="tilelang")
    assert len(calls) == 3
    assert explain_backend(qg, k, v, g, beta, backend="tilelang").startswith(
        "chunk_gated_delta_rule: backend tilelang")

    with pytest.warns(UserWarning, match="recurrent TileLang kernel is forward-only"):
        o, _ = recurrent_gated_delta_rule(qg, k, v, g, beta)
    assert o.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recurrent_gated_delta_rule(qg, k, v, g, beta)
    # forced backend: the kernels or one error, never a silent fallback
    with pytest.raises(ValueError, match="requires grad.*forward-only"):
        recurrent_gated_delta_rule(qg, k, v, g, beta, backend="tilelang")
    assert explain_backend(qg, k, v, g, beta, backend="tilelang", op="recurrent").startswith(
        "recurrent_gated_delta_rule: error: backend='tilelang'")


@pytest.mark.parametrize("change, reason", [
    ({}, "one dtype of (bfloat16, float16)"),
    ({"dtype": torch.bfloat16, "K": 320}, "head dims K=320, V=8 unsupported"),
    ({"dtype": torch.bfloat16, "T": 0}, "T = 0: there is nothing to compute"),
    ({"dtype": torch.bfloat16, "Hv": 3, "K": 64, "V": 64}, "Hv / Hk = 3 would need slices of 3"),
])
def test_kernel_requirements_are_reasons_once_the_device_passes(monkeypatch, change, reason):
    """After the device check (here: passed, as on an H200), each of the kernel's own requirements is a reason for
    the torch path, named by explain_backend, and raised for backend='tilelang'."""
    from flashqla_kernels import dispatch

    monkeypatch.setattr(dispatch, "hopper_reason", lambda *tensors: None)
    kw = {"dtype": torch.float64, "T": 8, "Hv": 2, "K": 8, "V": 8} | change
    q, k, v, g, beta, _ = make_inputs(1, kw["T"], 1, kw["Hv"], K=kw["K"], V=kw["V"])
    q, k, v = (x.to(kw["dtype"]) for x in (q, k, v))
    text = explain_backend(q, k, v, g, beta)
    assert text.startswith("chunk_gated_delta_rule: backend torch") and reason in text
    with pytest.raises(ValueError, match=re.escape(reason)):
        chunk_gated_delta_rule(q, k, v, g, beta, backend="tilelang")


@pytest.mark.parametrize("change, reason", [
    ({}, "the recurrent kernel takes bfloat16, float16 or float32"),
    ({"dtype": torch.bfloat16, "V": 48}, "value head dim V=48 unsupported by the recurrent kernel"),
    ({"dtype": torch.bfloat16, "K": 6}, "key head dim K=6 unsupported by the recurrent kernel with V=8"),
    ({"dtype": torch.float32, "T": 0}, "T = 0: there is nothing to compute"),
])
def test_recurrent_kernel_requirements_are_reasons_once_the_device_passes(monkeypatch, change, reason):
    from flashqla_kernels import dispatch

    monkeypatch.setattr(dispatch, "hopper_reason", lambda *tensors: None)
    kw = {"dtype": torch.float64, "T": 1, "K": 8, "V": 8} | change
    q, k, v, g, beta, _ = make_inputs(2, kw["T"], 1, 2, K=kw["K"], V=kw["V"])
    q, k, v = (x.to(kw["dtype"]) for x in (q, k, v))
    text = explain_backend(q, k, v, g, beta, op="recurrent")
    assert text.startswith("recurrent_gated_delta_rule: backend torch") and reason in text
    with pytest.raises(ValueError, match=re.escape(reason)):
        recurrent_gated_delta_rule(q, k, v, g, beta, backend="tilelang")


def test_input_errors_name_the_argument_and_the_fix():
    q, k, v, g, beta, h0 = make_inputs(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, Hv\] = \[1,8,4\]; got \[1,8,3\]"):
        chunk_gated_delta_rule(q, k, v, g, beta[..., :3])
    with pytest.raises(ValueError, match="head-first layouts are not supported"):
        chunk_gated_delta_rule(q[0], k, v, g, beta)
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer tensor"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 8.0]))


def test_l2norm_matches_transformers_helper():
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm as hf_l2norm

    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(l2norm(x), hf_l2norm(x, dim=-1, eps=1e-6), atol=0, rtol=0)
