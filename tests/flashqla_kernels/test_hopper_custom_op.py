"""The custom ops of ``hopper.custom_op`` on CPU, with the Hopper launchers swapped for their torch / float64
formulations (the kernels need an sm_90 GPU; ``test_hopper_bwd_gpu.py`` runs the real ones): the op's gradients equal
autograd through the torch path, ``torch.library.opcheck`` passes (schema, fake tensors, autograd registration,
AOT dispatch), and ``torch.compile`` traces the public op with the custom op in its graph."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels import chunk_gated_delta_rule
from flashqla_kernels.gated_delta_rule import api
from flashqla_kernels.gated_delta_rule.hopper import backward, custom_op, forward
from flashqla_kernels.gated_delta_rule.reference_bwd import chunk_gated_delta_rule_bwd_ref
from flashqla_kernels.gated_delta_rule.torch_path import chunk_gated_delta_rule_torch


def _fwd_stand_in(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  cu_seqlens, save_states=False):
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, cu_seqlens)
    if not save_states:
        return o, ht
    # the saved states' shapes as the launcher returns them (kernel head dims: 16 -> 64, 8 -> 64)
    B, T, Hv = q.shape[0], q.shape[1], v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    Kp, Vp = forward.padded_head_dim(k.shape[3]), forward.padded_head_dim(v.shape[3])
    return (o, ht, torch.full((forward.saved_chunks(B, T, N), Hv, Kp, Vp), 0.5), torch.full((B * T, Hv, Vp), 0.25),
            torch.full((B * T, Hv), -0.5), torch.full((B * T, Hv, 64), 0.125, dtype=torch.float16))


def _bwd_stand_in(q, k, v, g, beta, do, dht, *, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                  states=None):
    grads = chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, scale=scale, initial_state=initial_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    like = (q, k, v, g, beta)
    return (*(d.to(x.dtype) for d, x in zip(grads[:5], like)), None if grads[5] is None else grads[5].float())


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The dispatcher takes the kernel path and the launchers run their torch / reference formulations."""
    calls = {"fwd": 0, "bwd": 0}

    def fwd(*a, **kw):
        calls["fwd"] += 1
        # the public op and the custom op have run the launcher's checks: it must not run them again
        assert kw.pop("checked") is True
        out = _fwd_stand_in(*a, **kw)
        calls["saved"] = out[2:]
        return out

    def bwd(*a, **kw):
        calls["bwd"] += 1
        calls["states"] = kw.get("states")
        return _bwd_stand_in(*a, **kw)

    monkeypatch.setattr(api, "_verifiers", lambda op, *a: ())
    monkeypatch.setattr(forward, "chunk_gated_delta_rule_fwd", fwd)
    monkeypatch.setattr(backward, "chunk_gated_delta_rule_bwd", bwd)
    return calls


def _inputs(lengths=(37, 70, 1), Hk=2, Hv=4, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(1, T, Hk, K, generator=gen)
    k = torch.randn(1, T, Hk, K, generator=gen)
    v = torch.randn(1, T, Hv, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen)) / 4
    beta = torch.sigmoid(torch.randn(1, T, Hv, generator=gen))
    h0 = torch.randn(len(lengths), Hv, K, V, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [q, k, v, g, beta, h0], cu


def _grads(fn, tensors, cu, do, dht):
    xs = [x.clone().requires_grad_() for x in tensors]
    o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    torch.autograd.backward((o, ht), (do, dht))
    return o.detach(), ht.detach(), [x.grad for x in xs]


def test_gradients_through_the_custom_op_equal_autograd_of_the_torch_path(kernels_on_cpu, monkeypatch):
    assert custom_op.SAVE_STATES is True  # the default: the forward under grad saves the states
    tensors, cu = _inputs()
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(tensors[2].shape, generator=gen)
    dht = torch.randn(tensors[5].shape, generator=gen)
    o, ht, grads = _grads(chunk_gated_delta_rule, tensors, cu, do, dht)
    assert (kernels_on_cpu["fwd"], kernels_on_cpu["bwd"]) == (1, 1)
    # the states the forward saved reach the backward as they were
    saved, states = kernels_on_cpu["saved"], kernels_on_cpu["states"]
    assert len(saved) == 4 and states is not None and len(states) == 4
    assert all(torch.equal(a, b) for a, b in zip(saved, states))
    o_t, ht_t, grads_t = _grads(chunk_gated_delta_rule_torch, tensors, cu, do, dht)
    torch.testing.assert_close(o, o_t)
    torch.testing.assert_close(ht, ht_t)
    for name, d, d_t in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_t):
        assert d is not None and d.shape == d_t.shape, name
        torch.testing.assert_close(d, d_t, rtol=1e-4, atol=1e-4, msg=name)

    # without grad the launcher runs directly: no custom op, nothing saved
    with torch.no_grad():
        chunk_gated_delta_rule(*tensors[:5], cu_seqlens=cu)
    assert (kernels_on_cpu["fwd"], kernels_on_cpu["bwd"], kernels_on_cpu["saved"]) == (2, 1, ())


def test_without_saved_states_the_backward_recomputes_them(kernels_on_cpu, monkeypatch):
    monkeypatch.setattr(custom_op, "SAVE_STATES", False)
    tensors, cu = _inputs(lengths=(20, 9))
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(tensors[2].shape, generator=gen)
    dht = torch.randn(tensors[5].shape, generator=gen)
    _, _, grads = _grads(chunk_gated_delta_rule, tensors, cu, do, dht)
    assert kernels_on_cpu["saved"] == () and kernels_on_cpu["states"] is None
    _, _, grads_t = _grads(chunk_gated_delta_rule_torch, tensors, cu, do, dht)
    for d, d_t in zip(grads, grads_t):
        torch.testing.assert_close(d, d_t, rtol=1e-4, atol=1e-4)


def test_only_the_output_or_only_the_final_state_may_carry_a_gradient(kernels_on_cpu):
    tensors, cu = _inputs(lengths=(20, 9))
    v = tensors[2].clone().requires_grad_()
    o, ht = chunk_gated_delta_rule(tensors[0], tensors[1], v, *tensors[3:5], initial_state=tensors[5],
                                   output_final_state=True, cu_seqlens=cu)
    (dv_state,) = torch.autograd.grad(ht.sum(), v)
    o, _ = chunk_gated_delta_rule(tensors[0], tensors[1], v, *tensors[3:5], initial_state=tensors[5], cu_seqlens=cu)
    (dv_out,) = torch.autograd.grad(o.sum(), v)
    for fn_out, d in ((lambda o, ht: ht.sum(), dv_state), (lambda o, ht: o.sum(), dv_out)):
        vt = tensors[2].clone().requires_grad_()
        o_t, ht_t = chunk_gated_delta_rule_torch(tensors[0], tensors[1], vt, *tensors[3:5],
                                                 initial_state=tensors[5], output_final_state=True, cu_seqlens=cu)
        (d_t,) = torch.autograd.grad(fn_out(o_t, ht_t), vt)
        torch.testing.assert_close(d, d_t, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_state,save_states", [(True, True), (False, True), (True, False)])
def test_opcheck_passes_for_the_forward_op(kernels_on_cpu, with_state, save_states):
    tensors, cu = _inputs(lengths=(20, 9))
    xs = [x.requires_grad_() for x in tensors]
    args = (*xs[:5], xs[5] if with_state else None, cu, 16 ** -0.5, with_state, True, save_states)
    torch.library.opcheck(torch.ops.flashqla_kernels.chunk_gated_delta_rule.default, args)


def test_torch_compile_traces_the_public_op_into_one_graph(kernels_on_cpu):
    tensors, cu = _inputs(lengths=(20, 9))
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(tensors[2].shape, generator=gen)
    dht = torch.randn(tensors[5].shape, generator=gen)

    def step(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                       output_final_state=output_final_state,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
        return o * 2.0, ht

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    o_c, ht_c, grads_c = _grads(lambda *a, **kw: compiled(*a, **kw), tensors, cu, do, dht)
    o_e, ht_e, grads_e = _grads(step, tensors, cu, do, dht)
    torch.testing.assert_close(o_c, o_e)
    torch.testing.assert_close(ht_c, ht_e)
    for d_c, d_e in zip(grads_c, grads_e):
        torch.testing.assert_close(d_c, d_e)
    torch._dynamo.reset()


def test_the_ops_are_registered_with_their_schemas():
    schema = str(torch.ops.flashqla_kernels.chunk_gated_delta_rule.default._schema)
    assert "Tensor? initial_state, Tensor? cu_seqlens, float scale" in schema
    assert custom_op.chunk_gated_delta_rule.__module__ == custom_op.__name__
    bwd_schema = str(torch.ops.flashqla_kernels.chunk_gated_delta_rule_bwd.default._schema)
    assert bwd_schema.endswith("-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
