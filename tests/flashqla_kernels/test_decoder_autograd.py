"""CPU checks of the decoder glue's backward (``flashqla_kernels.decoder.autograd`` and the ``*_bwd`` kernels of
``flashqla_kernels.decoder.hopper``), against autograd through the torch formulation (``torch_path``) in float64:

- the gates' backward (torch code the autograd Function runs as is);
- float64 transliterations of each backward kernel, written as the kernel computes (the conv's tiles of BT tokens
  owning their first BT - (Kc - 1), the halo recomputed, per-tile partial sums of dw and dbias; the norms' row sums
  and per-CTA partial rows of dw), so the kernels' algebra and tiling are checked without a GPU;
- the autograd Functions' plumbing (which gradient goes where, the add's two addends, absent gradients, the norms'
  fp32 rows written in autocast's dtype), with the kernels replaced by those transliterations and the device check
  passed, through ``ops`` as the patches call it.

The kernels themselves run against the same references on an sm_90 GPU (``test_decoder_gpu.py``).
"""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels import dispatch
from flashqla_kernels.decoder import autograd, hopper, ops, torch_path

F64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def conv_bwd_tiled(qkv, weight, bias, dq, dk, dv, *, Hk, K, Hv, BT=8):
    """The conv backward kernel's algorithm in float64: tiles of BT tokens, each forming du for its BT tokens from
    its window of BT + Kc - 1 rows and owning dx and the partial sums of its first BT - (Kc - 1)."""
    B, T, C = qkv.shape
    Kc = weight.shape[-1]
    P, span = Kc - 1, BT - (Kc - 1)
    x, w = qkv.to(F64), weight.to(F64)
    heads = torch.cat([dq.reshape(B, T, Hk * K), dk.reshape(B, T, Hk * K), dv.reshape(B, T, Hv * K)], -1).to(F64)
    dx = torch.zeros(B, T, C, dtype=F64)
    parts_w, parts_b = [], []
    for t0 in range(0, T, span):
        win = torch.zeros(B, BT + P, C, dtype=F64)  # rows i <-> tokens t0 - P + i (zeros outside the sequence)
        lo, hi = max(t0 - P, 0), min(t0 + BT, T)
        win[:, lo - (t0 - P):hi - (t0 - P)] = x[:, lo:hi]
        u = sum(w[:, j] * win[:, j:j + BT] for j in range(Kc)) + (bias.to(F64) if bias is not None else 0)
        go = torch.zeros(B, BT, C, dtype=F64)
        go[:, :min(BT, T - t0)] = heads[:, t0:t0 + BT]
        y = torch.nn.functional.silu(u)
        yh, gh = y.view(B, BT, -1, K), go.view(B, BT, -1, K)
        qk = torch.arange(yh.shape[2]) < 2 * Hk
        r = torch.where(qk, torch.rsqrt((yh * yh).sum(-1) + 1e-6), torch.ones((), dtype=F64))[..., None]
        dot = torch.where(qk, (gh * yh).sum(-1), torch.zeros((), dtype=F64))[..., None]
        s = torch.sigmoid(u)
        du = ((gh * r - yh * dot * r ** 3).view(B, BT, C)) * s * (1 + u * (1 - s))
        du = torch.cat([du, torch.zeros(B, P, C, dtype=F64)], 1)
        own = min(span, T - t0)
        dx[:, t0:t0 + own] = sum(w[:, j] * du[:, P - j:P - j + own] for j in range(Kc))
        parts_w.append(torch.stack([(du[:, :own] * win[:, j:j + own]).sum(1) for j in range(Kc)], -1))
        parts_b.append(du[:, :own].sum(1))
    dw = torch.stack(parts_w).sum((0, 1))
    db = torch.stack(parts_b).sum((0, 1)) if bias is not None else None
    return dx, dw, db


def rms_bwd_rows(x, weight, eps, dy, ds=None, ctas=3):
    """The RMSNorm backward kernel's algorithm in float64: per row dx = r g - x r^3 mean(g x), g = dy (1 + w); dw as
    the sum of ``ctas`` partial rows (CTA c takes rows c, c + ctas, ...)."""
    D = x.shape[-1]
    x2, dy2 = x.reshape(-1, D).to(F64), dy.reshape(-1, D).to(F64)
    r = torch.rsqrt((x2 * x2).mean(-1, keepdim=True) + eps)
    g = dy2 * (1 + weight.to(F64))
    dx = r * g - x2 * r ** 3 * (g * x2).mean(-1, keepdim=True)
    if ds is not None:
        dx = dx + ds.reshape(-1, D).to(F64)
    parts = [(dy2 * x2 * r)[c::ctas].sum(0) for c in range(ctas)]
    return dx.view(x.shape), torch.stack(parts).sum(0)


def gated_bwd_rows(o, z, weight, eps, dy, ctas=3):
    """The gated RMSNorm backward kernel's algorithm in float64."""
    V = o.shape[-1]
    o2, z2, dy2 = o.reshape(-1, V).to(F64), z.reshape(-1, V).to(F64), dy.reshape(-1, V).to(F64)
    w = weight.to(o.dtype).to(F64)
    r = torch.rsqrt((o2 * o2).mean(-1, keepdim=True) + eps)
    s = torch.sigmoid(z2)
    g = dy2 * w * z2 * s
    do = r * g - o2 * r ** 3 * (g * o2).mean(-1, keepdim=True)
    dz = dy2 * o2 * r * w * s * (1 + z2 * (1 - s))
    parts = [(dy2 * o2 * r * z2 * s)[c::ctas].sum(0) for c in range(ctas)]
    return do.view(o.shape), dz.view(z.shape), torch.stack(parts).sum(0)


def silu_mul_bwd_elems(gate, up, dout):
    g, u, d = gate.to(F64), up.to(F64), dout.to(F64)
    s = torch.sigmoid(g)
    return d * u * s * (1 + g * (1 - s)), d * g * s


def _autograd(fn, inputs, grads):
    """Gradients of sum(out * grad) through ``fn`` in float64 (the torch formulation's autograd)."""
    xs = [t.detach().to(F64).requires_grad_(True) if t is not None else None for t in inputs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * g.to(F64)).sum() for o, g in zip(outs, grads) if g is not None)
    live = [t for t in xs if t is not None]
    got = iter(torch.autograd.grad(loss, live, allow_unused=True))
    return [next(got) if t is not None else None for t in xs]


def _rel(x, ref):
    return ((x.to(F64) - ref.to(F64)).norm() / ref.to(F64).norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("B,T,Hk,Hv,K,Kc,bias,BT", [
    (2, 37, 1, 2, 16, 4, False, 8),     # several tiles, a ragged last one
    (1, 5, 1, 1, 8, 4, True, 8),        # shorter than one tile's own tokens
    (2, 29, 2, 2, 8, 2, True, 4),       # conv width 2, one-token halo
])
def test_conv_backward_tiling_matches_autograd(B, T, Hk, Hv, K, Kc, bias, BT):
    g = _gen(1)
    C = (2 * Hk + Hv) * K
    qkv = torch.randn(B, T, C, generator=g, dtype=F64)
    w = 0.5 * torch.randn(C, Kc, generator=g, dtype=F64)
    b = 0.1 * torch.randn(C, generator=g, dtype=F64) if bias else None
    dq, dk = torch.randn(B, T, Hk, K, generator=g, dtype=F64), torch.randn(B, T, Hk, K, generator=g, dtype=F64)
    dv = torch.randn(B, T, Hv, K, generator=g, dtype=F64)

    def fwd(x, w_, b_):
        y = torch_path.causal_conv1d_silu(x, w_, b_)
        q, k, v = torch.split(y, [Hk * K, Hk * K, Hv * K], -1)
        return (torch_path.l2norm_fp32(q.reshape(B, T, Hk, K)), torch_path.l2norm_fp32(k.reshape(B, T, Hk, K)),
                v.reshape(B, T, Hv, K))

    ref = _autograd(fwd, [qkv, w, b], [dq, dk, dv])
    got = conv_bwd_tiled(qkv, w, b, dq, dk, dv, Hk=Hk, K=K, Hv=Hv, BT=BT)
    for name, x, r in zip(("dqkv", "dweight", "dbias"), got, ref):
        if r is None:
            assert x is None
            continue
        assert _rel(x, r) < 1e-12, name


def test_gates_backward_matches_autograd():
    g = _gen(2)
    a, b = torch.randn(2, 7, 3, generator=g, dtype=F64) * 4, torch.randn(2, 7, 3, generator=g, dtype=F64)
    a[0, 0, 0] = 30.0  # past softplus's threshold
    A_log, dt = torch.rand(3, generator=g, dtype=F64) * 3 - 2, torch.randn(3, generator=g, dtype=F64)
    dg, dbeta = torch.randn(2, 7, 3, generator=g, dtype=F64), torch.randn(2, 7, 3, generator=g, dtype=F64)
    ref = _autograd(torch_path.gdn_gates, [a, b, A_log, dt], [dg, dbeta])
    got = autograd.gates_bwd(a, b, A_log, dt, dg, dbeta)
    order = (0, 1, 2, 3)  # gates_bwd: (da, db, dA_log, ddt_bias)
    for i in order:
        assert _rel(got[i], ref[i]) < 1e-12
    da, db, dA, ddt = autograd.gates_bwd(a, b, A_log, dt, None, dbeta)
    assert da is None and dA is None and ddt is None and _rel(db, ref[1]) < 1e-12


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_backward_rows_match_autograd(with_residual):
    g = _gen(3)
    x = torch.randn(5, 64, generator=g, dtype=F64)
    w = 0.1 * torch.randn(64, generator=g, dtype=F64)
    dy = torch.randn(5, 64, generator=g, dtype=F64)
    ds = torch.randn(5, 64, generator=g, dtype=F64) if with_residual else None
    ref = _autograd(lambda x_, w_: torch_path.rms_norm_zero_centred(x_, w_, 1e-6), [x, w], [dy])
    dx, dw = rms_bwd_rows(x, w, 1e-6, dy, ds)
    assert _rel(dx, ref[0] + (ds if ds is not None else 0)) < 1e-12 and _rel(dw, ref[1]) < 1e-12


def test_gated_norm_and_silu_mul_backward_match_autograd():
    g = _gen(4)
    o, z = torch.randn(2, 3, 4, 32, generator=g, dtype=F64), torch.randn(2, 3, 4, 32, generator=g, dtype=F64)
    w, dy = torch.randn(32, generator=g, dtype=F64), torch.randn(2, 3, 4, 32, generator=g, dtype=F64)
    ref = _autograd(lambda o_, z_, w_: torch_path.gated_rms_norm(o_, z_, w_, 1e-6), [o, z, w], [dy])
    for x, r in zip(gated_bwd_rows(o, z, w, 1e-6, dy), ref):
        assert _rel(x, r) < 1e-12
    gate, up, dout = (torch.randn(3, 64, generator=g, dtype=F64) for _ in range(3))
    ref = _autograd(torch_path.silu_mul, [gate, up], [dout])
    for x, r in zip(silu_mul_bwd_elems(gate, up, dout), ref):
        assert _rel(x, r) < 1e-12


class _GlueOnHopper:
    """The dispatcher as ``ops`` sees it, with the device check passed (the GDN op, which asks the real one, stays on
    its torch path)."""

    def __getattr__(self, name):
        return getattr(dispatch, name)

    @staticmethod
    def hopper_reason(*tensors):
        return None


@pytest.fixture
def kernels_as_transliterations(monkeypatch):
    """The glue's device check passed and every glue kernel replaced by its torch formulation (forward) or its
    transliteration (backward), each returning the kernel's dtypes, so ``ops`` runs its autograd Functions on CPU.

    Returns:
        ``{"norm_fwd": [(rows dtype, y dtype)], "norm_bwd": [(rows dtype, dy dtype)]}``, the RMSNorm kernels' calls.
    """
    monkeypatch.setattr(ops, "dispatch", _GlueOnHopper())
    seen = {"norm_fwd": [], "norm_bwd": []}

    def conv_fwd(qkv, weight, bias, a, b, A_log, dt_bias, *, Hk, K, Hv, V, prefix=None):
        assert prefix is None
        return torch_path.conv_split_l2norm_gates(qkv, weight.to(qkv.dtype), bias, a, b, A_log, dt_bias, Hk=Hk, K=K,
                                                  Hv=Hv, V=V)

    def conv_bwd(qkv, weight, bias, dq, dk, dv, *, Hk, K, Hv):
        dx, dw, db = conv_bwd_tiled(qkv, weight.to(qkv.dtype), bias, dq, dk, dv, Hk=Hk, K=K, Hv=Hv)
        return dx.to(qkv.dtype), dw.float(), None if db is None else db.float()

    def rms_fwd(x, weight, eps, *, out_dtype=None):
        # the launchers' contract: y in the rows' dtype, or bf16 / fp16 from fp32 rows
        assert hopper.norm_out_reason(x.dtype, out_dtype) is None, (x.dtype, out_dtype)
        seen["norm_fwd"].append((x.dtype, out_dtype or x.dtype))
        return torch_path.rms_norm_zero_centred(x, weight, eps, out_dtype=out_dtype)

    def add_rms_fwd(a, b, weight, eps, *, out_dtype=None):
        s = a + b
        return s, rms_fwd(s, weight, eps, out_dtype=out_dtype)

    def rms_bwd(x, weight, eps, dy, ds=None):
        seen["norm_bwd"].append((x.dtype, dy.dtype))
        dx, dw = rms_bwd_rows(x, weight, eps, dy, ds)
        return dx.to(x.dtype), dw.float()

    def gated_bwd(o, z, weight, eps, dy):
        do, dz, dw = gated_bwd_rows(o, z, weight, eps, dy)
        return do.to(o.dtype), dz.to(o.dtype), dw.float()

    def silu_bwd(gate, up, dout):
        return tuple(t.to(gate.dtype) for t in silu_mul_bwd_elems(gate, up, dout))

    for name, fn in {"conv_qkv_gates_fwd": conv_fwd, "conv_qkv_bwd": conv_bwd,
                     "rms_norm_fwd": rms_fwd, "rms_norm_bwd": rms_bwd, "add_rms_norm_fwd": add_rms_fwd,
                     "gated_rms_norm_fwd": torch_path.gated_rms_norm, "gated_rms_norm_bwd": gated_bwd,
                     "silu_mul_fwd": torch_path.silu_mul, "silu_mul_bwd": silu_bwd}.items():
        monkeypatch.setattr(hopper, name, fn)
    return seen


def _grads(fn, inputs):
    """(outputs, gradients of sum(outputs * fixed weights) w.r.t. every input requiring grad)."""
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = _gen(9)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    return outs, torch.autograd.grad(loss, inputs)


def test_ops_under_grad_run_the_autograd_functions_with_every_gradient_in_place(kernels_as_transliterations):
    """Through ``ops`` with the kernels replaced: each stage's outputs (their dtypes) and gradients (activations and
    weights, fp32 weights as under autocast; the norms' fp32 rows written in bf16, their gradient read in bf16) equal
    autograd through the torch formulation within bf16 rounding."""
    g = _gen(5)
    bf = torch.bfloat16

    def leaf(*shape, dtype=bf, s=1.0):
        return (s * torch.randn(*shape, generator=g)).to(dtype).requires_grad_(True)

    B, T, Hk, Hv, K = 2, 21, 1, 2, 16
    qkv, a, b = leaf(B, T, (2 * Hk + Hv) * K), leaf(B, T, Hv), leaf(B, T, Hv)
    w_conv, A_log, dt = leaf((2 * Hk + Hv) * K, 4, dtype=torch.float32, s=0.5), leaf(Hv, dtype=torch.float32), \
        leaf(Hv, dtype=torch.float32)
    x, res, wn = leaf(3, 64), leaf(3, 64), leaf(64, dtype=torch.float32, s=0.1)
    x32, res32 = leaf(3, 64, dtype=torch.float32, s=2.0), leaf(3, 64, dtype=torch.float32)
    o, z, wg = leaf(2, 5, 2, 64), leaf(2, 5, 128), leaf(64, s=0.5)
    gate, up = leaf(4, 64), leaf(4, 64)
    cases = {
        "conv_qkv_gates": ((qkv, w_conv, a, b, A_log, dt),
                           lambda f: f.conv_qkv_gates(qkv, w_conv, None, a, b, A_log, dt, Hk=Hk, K=K, Hv=Hv, V=K),
                           lambda: torch_path.conv_split_l2norm_gates(qkv, w_conv.to(bf), None, a, b, A_log, dt,
                                                                      Hk=Hk, K=K, Hv=Hv, V=K)),
        "rms_norm": ((x, wn), lambda f: f.rms_norm(x, wn, 1e-6),
                     lambda: torch_path.rms_norm_zero_centred(x, wn, 1e-6)),
        "add_rms_norm": ((x, res, wn), lambda f: f.add_rms_norm(res, x, wn, 1e-6),
                         lambda: (res + x, torch_path.rms_norm_zero_centred(res + x, wn, 1e-6))),
        "rms_norm fp32 rows, bf16 out": ((x32, wn), lambda f: f.rms_norm(x32, wn, 1e-6, out_dtype=bf),
                                         lambda: torch_path.rms_norm_zero_centred(x32, wn, 1e-6, out_dtype=bf)),
        "add_rms_norm fp32 residual, bf16 out": (
            (x, res32, wn), lambda f: f.add_rms_norm(res32, x, wn, 1e-6, out_dtype=bf),
            lambda: (res32 + x, torch_path.rms_norm_zero_centred(res32 + x, wn, 1e-6, out_dtype=bf))),
        "gated_norm": ((o, z, wg), lambda f: f.gated_norm(o, z, wg, 1e-6),
                       lambda: torch_path.gated_rms_norm(o, z, wg, 1e-6)),
        "silu_mul": ((gate, up), lambda f: f.silu_mul(gate, up), lambda: torch_path.silu_mul(gate, up)),
    }
    for name, (inputs, run, reference) in cases.items():
        outs, got = _grads(lambda: run(ops), inputs)
        ref_outs, ref = _grads(reference, inputs)
        assert [o.dtype for o in outs] == [o.dtype for o in ref_outs], name
        for i, (x_, r_) in enumerate(zip(got, ref)):
            assert x_.dtype == inputs[i].dtype and x_.shape == inputs[i].shape, (name, i)
            assert _rel(x_, r_) < 2e-2, (name, i, _rel(x_, r_))
    # the norms' kernels took fp32 rows to bf16 and, in the backward, read the bf16 gradient as is
    f32 = torch.float32
    assert (f32, bf) in kernels_as_transliterations["norm_fwd"]
    assert (f32, bf) in kernels_as_transliterations["norm_bwd"]


def test_autocast_out_dtype_is_autocasts_for_fp32_rows_only():
    x = torch.randn(2, 64)
    assert ops.autocast_out_dtype(x) == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            assert ops.autocast_out_dtype(x) == dtype
            assert ops.autocast_out_dtype(x.bfloat16()) == torch.bfloat16
            assert ops.autocast_out_dtype(x.double()) == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert ops.autocast_out_dtype(x) == torch.float32


def test_add_rms_norm_backward_when_only_the_sum_is_used(kernels_as_transliterations):
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    s, _ = ops.add_rms_norm(r, x, torch.zeros(64), 1e-6)
    s.float().sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))


def _tiny_trainable_qwen35():
    """A two-layer Qwen3.5 (GDN, then gated attention) whose every glue stage fits the kernels' shapes (GDN head dim
    64, hidden size 64, MLP 128), fp32 weights in train mode."""
    import transformers as tf

    config = tf.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=256)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(config).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.normal_(0.0, 0.1)
    return model


def test_a_patched_training_step_runs_every_glue_function_and_checkpoints(kernels_as_transliterations,
                                                                          monkeypatch):
    """A fine-tuning step as ``finetune`` takes it (fp32 weights, bf16 autocast, LM loss) on the patched model: every
    glue stage with a backward kernel runs its autograd Function (the norms on the fp32 residual stream too, writing
    autocast's bf16 for the projections and reading their bf16 gradient), every parameter gets a gradient as close to
    fp32 transformers' as transformers' own autocast step, and gradient checkpointing (the forward recomputed under
    the backward) gives the same gradients."""
    from flashqla_kernels.patching import patched_gdn_layers

    model = _tiny_trainable_qwen35()
    ids = torch.randint(0, 256, (2, 40), generator=_gen(12))

    def grads(autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    truth, theirs = grads(False), grads(True)
    calls = []
    names = ("_ConvQKVGates", "_GatedNorm", "_RMSNorm", "_AddRMSNorm", "_SiluMul")
    for n in names:
        fn = getattr(autograd, n)
        monkeypatch.setattr(fn, "apply", (lambda n, apply: lambda *a: calls.append(n) or apply(*a))(n, fn.apply))
    # transformers 5.x names it activation checkpointing (the gradient_checkpointing_* names are deprecated)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    with patched_gdn_layers():
        ours = grads(True)
        assert set(calls) == set(names), calls
        n_plain = len(calls)
        enable()
        try:
            checkpointed = grads(True)
        finally:
            disable()
    # the checkpointed step ran the decoder layers' glue twice (the forward, then its replay under the backward) and
    # the final norm, outside the layers, once
    assert len(calls) - n_plain == 2 * n_plain - 1, (n_plain, len(calls))
    # every decoder and final norm (input, post-attention with the residual add, final): fp32 rows in, bf16 out
    f32, bf = torch.float32, torch.bfloat16
    assert set(kernels_as_transliterations["norm_fwd"]) == {(f32, bf)}, kernels_as_transliterations["norm_fwd"]
    assert set(kernels_as_transliterations["norm_bwd"]) == {(f32, bf)}, kernels_as_transliterations["norm_bwd"]
    assert set(ours) == set(truth) == set(checkpointed)
    for n in truth:
        e_ours, e_theirs = _rel(ours[n], truth[n]), _rel(theirs[n], truth[n])
        assert e_ours <= max(1.5 * e_theirs, 2e-2), (n, e_ours, e_theirs)
        assert torch.equal(checkpointed[n], ours[n]), n
