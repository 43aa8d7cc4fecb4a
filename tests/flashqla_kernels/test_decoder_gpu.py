"""The GDN layer's glue kernels and the whole fused layer on an sm_90 GPU (skipped elsewhere).

Kernels against the torch formulation run in fp32 on the same bf16 inputs (outputs poisoned with NaN first, so an
unwritten element fails; the MLP's silu_mul within one rounding of fp32, element by element); the patched MLP module
against transformers' MLP (the kernel called once); the fused layer (kernels + our chunk op) against transformers'
layer forward, both in bf16, each measured against transformers' layer in fp32 (relative L2 printed per case); greedy
generation of a random model with Qwen3.5's GDN head shape identical with and without the patch.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.decoder import gdn_layer_forward, layer_unsupported_reason, torch_path
from flashqla_kernels.patching import patched_gdn_layers

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

DEV = "cuda"


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _conv_inputs(B, T, Hk, Hv, D, Kc, dtype, prefix, bias, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    C = (2 * Hk + Hv) * D

    def randn(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=g, device=DEV)).to(dtype)

    return dict(qkv=randn(B, T, C), weight=randn(C, Kc, s=0.5), bias=randn(C, s=0.1) if bias else None,
                a=randn(B, T, Hv), b=randn(B, T, Hv),
                A_log=torch.rand(Hv, generator=g, device=DEV) * 3 - 2, dt_bias=torch.randn(Hv, generator=g, device=DEV),
                prefix=randn(B, Kc - 1, C) if prefix else None)


CONV_CASES = {
    # name: (B, T, Hk, Hv, D, Kc, dtype, prefix, bias)
    "qwen35_2b_T1000": (2, 1000, 16, 16, 128, 4, torch.bfloat16, False, False),
    "gva2_T65_prefix": (2, 65, 2, 4, 128, 4, torch.bfloat16, True, False),
    "gva4_T64_bias_fp16": (1, 64, 1, 4, 128, 4, torch.float16, False, True),
    "decode_T1_prefix": (3, 1, 16, 32, 128, 4, torch.bfloat16, True, False),
    "T63_dim64": (2, 63, 2, 4, 64, 4, torch.bfloat16, True, True),
    "T3_shorter_than_kernel_dim256": (1, 3, 2, 2, 256, 4, torch.bfloat16, False, False),
}


@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_conv_gates_kernel_matches_torch_formulation(name):
    from flashqla_kernels.decoder import hopper

    B, T, Hk, Hv, D, Kc, dtype, prefix, bias = CONV_CASES[name]
    x = _conv_inputs(B, T, Hk, Hv, D, Kc, dtype, prefix, bias)
    with toolkit.poisoned_outputs():
        got = hopper.conv_qkv_gates_fwd(**x, Hk=Hk, K=D, Hv=Hv, V=D)
    ref = torch_path.conv_split_l2norm_gates(
        x["qkv"].float(), x["weight"].float(), None if x["bias"] is None else x["bias"].float(), x["a"].float(),
        x["b"].float(), x["A_log"], x["dt_bias"], Hk=Hk, K=D, Hv=Hv, V=D,
        prefix=None if x["prefix"] is None else x["prefix"].float())
    for label, o, r in zip("qkvgb", got, ref):
        assert not o.isnan().any(), f"{name}: {label} has unwritten (NaN) elements"
        tol = 1e-5 if label in "gb" else 6e-3
        assert _rel(o, r) < tol, f"{name}: {label} rel-L2 {_rel(o, r):.2e}"
    assert got[0].is_contiguous() and got[2].is_contiguous() and got[3].dtype == torch.float32
    with toolkit.poisoned_outputs():
        again = hopper.conv_qkv_gates_fwd(**x, Hk=Hk, K=D, Hv=Hv, V=D)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "not deterministic"


@pytest.mark.parametrize("BT,tiles", [(16, 8), (16, 3), (32, 4), (None, None)])  # None: the launcher's default
@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_pipelined_conv_kernel_equals_the_plain_one(name, BT, tiles):
    """The pipelined conv (each CTA walks ``tiles`` token tiles of BT tokens, the next loaded while one is computed)
    writes what the plain kernel writes, bit for bit: the same per-element fp32 math, tiles and halos from other
    places."""
    from flashqla_kernels.decoder.hopper import conv_gates

    B, T, Hk, Hv, D, Kc, dtype, prefix, bias = CONV_CASES[name]
    x = _conv_inputs(B, T, Hk, Hv, D, Kc, dtype, prefix, bias, seed=1)
    with toolkit.poisoned_outputs():
        plain = conv_gates.conv_qkv_gates(**x, Hk=Hk, Hv=Hv, D=D, tiles=0)
        piped = conv_gates.conv_qkv_gates(**x, Hk=Hk, Hv=Hv, D=D, tiles=tiles, BT=BT)
    for label, o, r in zip("qkvgb", piped, plain):
        assert not o.isnan().any(), f"{name}: {label} has unwritten (NaN) elements"
        assert torch.equal(o, r), f"{name} tiles={tiles}: {label} differs by {(o.float() - r.float()).abs().max()}"


@pytest.mark.parametrize("rows,V,dtype", [(8 * 4096 * 16 // 64, 128, torch.bfloat16), (77, 64, torch.float16),
                                          (130, 256, torch.bfloat16)])
def test_gated_norm_kernel_matches_torch_formulation(rows, V, dtype):
    from flashqla_kernels.decoder import hopper

    g = torch.Generator(device=DEV).manual_seed(1)
    o = (3 * torch.randn(rows, V, generator=g, device=DEV)).to(dtype)
    z = torch.randn(rows, V, generator=g, device=DEV).to(dtype)
    w = (1 + 0.2 * torch.randn(V, generator=g, device=DEV)).to(dtype)
    with toolkit.poisoned_outputs():
        got = hopper.gated_rms_norm_fwd(o, z, w, 1e-6)
    ref = torch_path.gated_rms_norm(o.float(), z.float(), w.float(), 1e-6)
    assert not got.isnan().any()
    assert _rel(got, ref) < 5e-3, _rel(got, ref)


@pytest.mark.parametrize("rows,D,dtype", [(8 * 4096, 2048, torch.bfloat16), (8 * 4096 * 8, 256, torch.bfloat16),
                                          (3, 2048, torch.float16), (77, 64, torch.bfloat16)])
def test_rms_norm_kernel_matches_transformers_formulation(rows, D, dtype):
    from flashqla_kernels.decoder import hopper

    g = torch.Generator(device=DEV).manual_seed(2)
    x = (4 * torch.randn(rows, D, generator=g, device=DEV)).to(dtype)
    w = (0.1 * torch.randn(D, generator=g, device=DEV)).to(dtype)
    with toolkit.poisoned_outputs():
        got = hopper.rms_norm_fwd(x, w, 1e-6)
    ref = torch_path.rms_norm_zero_centred(x.float(), w.float(), 1e-6)
    theirs = torch_path.rms_norm_zero_centred(x, w, 1e-6)  # transformers' ops in the model dtype
    assert not got.isnan().any()
    assert _rel(got, ref) <= max(1.5 * _rel(theirs, ref), 4e-3), (_rel(got, ref), _rel(theirs, ref))


@pytest.mark.parametrize("rows,D,dtype", [(8 * 4096, 2048, torch.bfloat16), (3, 2048, torch.float16),
                                          (77, 64, torch.bfloat16)])
def test_add_rms_norm_kernel_is_the_add_then_the_norm_kernel_bit_for_bit(rows, D, dtype):
    """The decoder's mid-layer step in one kernel writes exactly what torch's add and then the RMSNorm kernel write."""
    from flashqla_kernels.decoder import hopper

    g = torch.Generator(device=DEV).manual_seed(5)
    a = (4 * torch.randn(rows, D, generator=g, device=DEV)).to(dtype)
    b = torch.randn(rows, D, generator=g, device=DEV).to(dtype)
    w = (0.1 * torch.randn(D, generator=g, device=DEV)).to(dtype)
    with toolkit.poisoned_outputs():
        s, y = hopper.add_rms_norm_fwd(a, b, w, 1e-6)
        assert torch.equal(s, a + b)
        assert torch.equal(y, hopper.rms_norm_fwd(a + b, w, 1e-6))


def test_patched_decoder_fuses_both_residual_adds_and_matches_transformers_within_bf16(monkeypatch):
    """Qwen3.5-2B-shaped decoder layers (GDN, then attention), fp32 transformers as the truth: with the decoder
    patch every layer runs the add + RMSNorm kernel once and ``down_proj`` accumulates into the sum; each layer's
    output is as close to fp32 as transformers' bf16 forward. A hook on a layer's MLP keeps that layer's end add
    unfused (and the hook fires)."""
    from flashqla_kernels.decoder import ops
    from flashqla_kernels.patching import decoder as decoder_patch

    types = ("linear_attention", "full_attention")
    model32, model = _qwen35_layer(layers=types), _qwen35_layer(layers=types).to(torch.bfloat16)
    calls = []
    add_norm, down_reason = ops.add_rms_norm, decoder_patch.down_residual_reason
    monkeypatch.setattr(ops, "add_rms_norm", lambda *a, **k: calls.append("add_norm") or add_norm(*a, **k))
    monkeypatch.setattr(decoder_patch, "down_residual_reason",
                        lambda *a: (lambda r: calls.append("down" if r is None else "down unfused") or r)(
                            down_reason(*a)))
    ids = torch.randint(0, 1024, (2, 777), device=DEV)

    def outputs(m):
        got = []
        handles = [layer.register_forward_hook(lambda mod, a, o: got.append(o.float())) for layer in m.model.layers]
        try:
            m.model(ids, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return got

    fired = []
    with torch.no_grad():
        truth, theirs = outputs(model32), outputs(model)
        with patched_gdn_layers(decoder=False):
            unfused = outputs(model)
        with patched_gdn_layers():
            ours = outputs(model)
            assert calls == ["add_norm", "down"] * 2, calls
            calls.clear()
            handle = model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: fired.append(o.shape))
            try:
                hooked = outputs(model)
            finally:
                handle.remove()
    assert calls == ["add_norm", "down", "add_norm", "down unfused"], calls
    assert fired == [torch.Size([2, 777, 2048])], fired
    for i, kind in enumerate(types):
        e_ours, e_theirs, e_hooked = _rel(ours[i], truth[i]), _rel(theirs[i], truth[i]), _rel(hooked[i], truth[i])
        print(f"decoder layer {i} ({kind}): rel-L2 vs fp32 transformers: ours {e_ours:.2e}, transformers bf16 "
              f"{e_theirs:.2e}, ours with a hooked MLP {e_hooked:.2e}; ours bit for bit the unfused decoder's: "
              f"{torch.equal(ours[i], unfused[i])} (rel-L2 {_rel(ours[i], unfused[i]):.1e})")
        assert e_ours <= max(1.2 * e_theirs, 1e-2) and e_hooked <= max(1.2 * e_theirs, 1e-2)


SILU_CASES = {
    # name: (shape of gate and up, dtype); D = 6144 is Qwen3.5-2B's intermediate size
    "qwen35_2b_8x4096": ((8, 4096, 6144), torch.bfloat16),
    "rows4097_tail": ((4097, 6144), torch.bfloat16),
    "3x7_fp16": ((3, 7, 6144), torch.float16),
    "rows77_D64": ((77, 64), torch.bfloat16),
    "rows1_D64_fp16": ((1, 64), torch.float16),
    "rows1025_D64": ((1025, 64), torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(SILU_CASES))
def test_silu_mul_kernel_is_fp32_silu_mul_rounded_once(name):
    from flashqla_kernels.decoder import hopper

    shape, dtype = SILU_CASES[name]
    g = torch.Generator(device=DEV).manual_seed(3)
    gate = (3 * torch.randn(shape, generator=g, device=DEV)).to(dtype)
    up = (2 * torch.randn(shape, generator=g, device=DEV)).to(dtype)
    with toolkit.poisoned_outputs():
        got = hopper.silu_mul_fwd(gate, up)
    ref = torch_path.silu_mul(gate.float(), up.float())
    theirs = torch.nn.functional.silu(gate) * up  # transformers' two passes, rounded twice
    assert got.shape == gate.shape and got.dtype == dtype
    assert not got.isnan().any(), f"{name}: unwritten (NaN) elements"
    # one rounding of the fp32 result: within half an ulp (relative 2^-8 bf16, 2^-11 fp16; fp16 subnormals absolute)
    rel, atol = (2.0 ** -8, 0.0) if dtype == torch.bfloat16 else (2.0 ** -11, 2.0 ** -25)
    err = (got.float() - ref).abs() - ((rel + 1e-5) * ref.abs() + atol)
    assert err.max().item() <= 0, f"{name}: {int((err > 0).sum())} elements off by more than one rounding"
    assert _rel(got, ref) <= 1.001 * _rel(theirs, ref), (_rel(got, ref), _rel(theirs, ref))
    print(f"silu_mul {name}: rel-L2 vs fp32 ours {_rel(got, ref):.2e}, torch bf16/fp16 {_rel(theirs, ref):.2e}")


def _mlp_case():
    """Qwen3.5-2B's MLP (2048 -> 6144) on the GPU: (the bf16 module, a bf16 input [2, 777, 2048], the fp32 module's
    output on it, transformers' bf16 output), the fp32 and bf16 modules sharing their weights."""
    import transformers as tf
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP

    config = tf.Qwen3_5TextConfig(hidden_size=2048, intermediate_size=6144)
    torch.manual_seed(0)
    with torch.device(DEV):
        mlp32 = Qwen3_5MLP(config, config.intermediate_size).eval().requires_grad_(False)
    mlp = Qwen3_5MLP(config, config.intermediate_size).to(DEV, torch.bfloat16).eval().requires_grad_(False)
    mlp.load_state_dict(mlp32.state_dict())
    x = torch.randn(2, 777, 2048, device=DEV)
    with torch.no_grad():
        return mlp, x.bfloat16(), mlp32(x), mlp(x.bfloat16())


def test_patched_mlp_runs_the_kernel_and_matches_transformers_within_bf16(monkeypatch):
    from flashqla_kernels.patching import mlp as mlp_patch
    from flashqla_kernels.decoder.hopper import silu_mul

    mlp, x, truth, theirs = _mlp_case()
    calls = []
    kernel = silu_mul.silu_mul
    monkeypatch.setattr(silu_mul, "silu_mul", lambda gate, up: calls.append(gate.shape) or kernel(gate, up))
    monkeypatch.setattr(mlp_patch, "FUSED_MLP_GEMM", False)  # the two projections, then the silu_mul kernel
    with torch.no_grad(), patched_gdn_layers():
        ours = mlp(x)
    assert calls == [torch.Size([2, 777, 6144])], calls
    e_ours, e_theirs = _rel(ours, truth), _rel(theirs, truth)
    print(f"MLP 2048 -> 6144: rel-L2 vs fp32 ours {e_ours:.2e}, transformers bf16 {e_theirs:.2e}")
    assert ours.dtype == torch.bfloat16 and e_ours <= 1.05 * e_theirs


def test_patched_mlp_on_the_fused_swiglu_gemm_matches_transformers_within_bf16(monkeypatch):
    """With ``FUSED_MLP_GEMM`` the patched MLP runs gate/up as one GEMM with the SwiGLU in its epilogue (the two
    pre-activations are not rounded to bf16 first, so it is at least as close to fp32 as transformers' bf16 MLP);
    a hook on ``up_proj`` sends it back to the two projections, which then fire the hook."""
    from flashqla_kernels.patching import mlp as mlp_patch
    from flashqla_kernels.decoder.hopper import swiglu_gemm

    mlp, x, truth, theirs = _mlp_case()
    calls = []
    kernel = swiglu_gemm.swiglu_gemm
    monkeypatch.setattr(swiglu_gemm, "swiglu_gemm",
                        lambda a, wg, wu, **kw: calls.append(a.shape) or kernel(a, wg, wu, **kw))
    monkeypatch.setattr(mlp_patch, "FUSED_MLP_GEMM", True)
    seen = []
    with torch.no_grad(), patched_gdn_layers():
        ours = mlp(x)
        handle = mlp.up_proj.register_forward_hook(lambda m, a, o: seen.append(o.shape))
        try:
            hooked = mlp(x)
        finally:
            handle.remove()
    assert calls == [torch.Size([2, 777, 2048])], calls
    assert seen == [torch.Size([2, 777, 6144])], seen
    e_ours, e_theirs, e_hooked = _rel(ours, truth), _rel(theirs, truth), _rel(hooked, truth)
    print(f"MLP 2048 -> 6144 on the fused GEMM: rel-L2 vs fp32 ours {e_ours:.2e}, transformers bf16 {e_theirs:.2e}, "
          f"hooked (two GEMMs + silu_mul) {e_hooked:.2e}")
    assert ours.dtype == torch.bfloat16 and e_ours <= 1.05 * e_theirs and e_hooked <= 1.05 * e_theirs


ATTN_CASES = {
    # name: (B, L, H, Hkv, D, R, dtype, cos batch rows); the first is Qwen3.5-2B's attention at 8 x 4096
    "qwen35_2b_8x4096": (8, 4096, 8, 2, 256, 64, torch.bfloat16, 8),
    "tail_L77_shared_cos": (2, 77, 8, 2, 256, 64, torch.bfloat16, 1),
    "d128_full_rotary_fp16": (1, 33, 4, 4, 128, 128, torch.float16, 1),
    "d64_L1": (3, 1, 4, 1, 64, 32, torch.bfloat16, 3),
}


@pytest.mark.parametrize("name", sorted(ATTN_CASES))
def test_attention_glue_kernels_match_the_torch_formulation(name):
    from flashqla_kernels.decoder import hopper

    B, L, H, Hkv, D, R, dtype, Bc = ATTN_CASES[name]
    g = torch.Generator(device=DEV).manual_seed(4)
    qg = (3 * torch.randn(B, L, H, 2 * D, generator=g, device=DEV)).to(dtype)
    kx = (3 * torch.randn(B, L, Hkv, D, generator=g, device=DEV)).to(dtype)
    wq, wk = (0.1 * torch.randn(2, D, generator=g, device=DEV)).to(dtype)
    ang = torch.rand(Bc, L, R // 2, generator=g, device=DEV) * 6.3
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    q, k = hopper.qk_norm_rope_fwd(qg, kx, wq, wk, 1e-6, cos, sin)
    ref_q, ref_k = torch_path.qk_norm_rope(qg.float(), kx.float(), wq.float(), wk.float(), 1e-6, cos.float(),
                                           sin.float())
    theirs_q, theirs_k = torch_path.qk_norm_rope(qg, kx, wq, wk, 1e-6, cos, sin)  # transformers' ops in the dtype
    assert q.shape == (B, H, L, D) and k.shape == (B, Hkv, L, D) and q.is_contiguous() and k.is_contiguous()
    for got, ref, theirs in ((q, ref_q, theirs_q), (k, ref_k, theirs_k)):
        assert not got.isnan().any()
        assert _rel(got, ref) <= max(1.5 * _rel(theirs, ref), 4e-3), (name, _rel(got, ref), _rel(theirs, ref))
    attn = torch.randn(B, L, H * D, generator=g, device=DEV).to(dtype)
    got = hopper.gate_mul_fwd(attn, qg)
    ref = torch_path.gate_mul(attn.float(), qg.float())
    assert not got.isnan().any() and got.shape == attn.shape
    assert _rel(got, ref) <= max(1.05 * _rel(torch_path.gate_mul(attn, qg), ref), 4e-3)
    # SDPA's head-major output [B, H, L, D] into o_proj's token-major rows
    attn_hm = torch.randn(B, H, L, D, generator=g, device=DEV).to(dtype)
    got_hm = hopper.gate_mul_head_major_fwd(attn_hm, qg)
    ref_hm = torch_path.gate_mul_head_major(attn_hm.float(), qg.float())
    assert not got_hm.isnan().any() and got_hm.shape == (B, L, H * D)
    assert _rel(got_hm, ref_hm) <= max(1.05 * _rel(torch_path.gate_mul_head_major(attn_hm, qg), ref_hm), 4e-3)
    print(f"attention glue {name}: rel-L2 vs fp32 q {_rel(q, ref_q):.2e} (transformers' ops {_rel(theirs_q, ref_q):.2e}),"
          f" gate {_rel(got, ref):.2e}")


def test_patched_attention_runs_the_kernels_and_matches_transformers_within_bf16(monkeypatch):
    """A Qwen3.5-2B-shaped attention layer, fp32 transformers as the truth: the patched bf16 forward (q/k glue and
    gate on the kernels, transformers' attention interface) is as close to it as transformers' own bf16 forward."""
    from flashqla_kernels.decoder.hopper import attn_glue

    model32 = _qwen35_layer(layers=("full_attention",))
    model = _qwen35_layer(layers=("full_attention",)).to(torch.bfloat16)
    calls = []
    kernel = attn_glue.qk_norm_rope
    monkeypatch.setattr(attn_glue, "qk_norm_rope", lambda *a: calls.append(a[0].shape) or kernel(*a))
    ids = torch.randint(0, 1024, (2, 777), device=DEV)
    with torch.no_grad():
        truth = model32.model(ids, use_cache=False).last_hidden_state
        theirs = model.model(ids, use_cache=False).last_hidden_state
        with patched_gdn_layers():
            ours = model.model(ids, use_cache=False).last_hidden_state
    assert calls, "the patched attention did not run the q/k kernel"
    e_ours, e_theirs = _rel(ours, truth), _rel(theirs, truth)
    print(f"attention layer: rel-L2 vs fp32 transformers: ours {e_ours:.2e}, transformers bf16 {e_theirs:.2e}")
    assert e_ours <= max(1.2 * e_theirs, 1e-2)


def _qwen35_layer(Hk=16, Hv=16, layers=("linear_attention",), vocab=1024, n=None):
    import transformers as tf

    torch.manual_seed(0)
    types = list(layers) if n is None else (["linear_attention"] * 3 + ["full_attention"]) * (n // 4)
    config = tf.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, num_hidden_layers=len(types),
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=Hk,
        linear_num_value_heads=Hv, linear_key_head_dim=128, linear_value_head_dim=128, layer_types=types,
        max_position_embeddings=8192)
    with torch.device(DEV):
        return tf.Qwen3_5ForCausalLM(config).eval().requires_grad_(False)


@pytest.mark.parametrize("Hk,Hv", [(16, 16), (16, 32)])
def test_fused_layer_matches_transformers_within_bf16(Hk, Hv):
    from transformers import DynamicCache

    model32 = _qwen35_layer(Hk, Hv)
    layer32 = model32.model.layers[0].linear_attn
    model = _qwen35_layer(Hk, Hv).to(torch.bfloat16)
    layer = model.model.layers[0].linear_attn
    h = torch.randn(2, 777, 2048, device=DEV)
    with torch.no_grad():
        truth = layer32(h)
        theirs = layer(h.bfloat16())
        ours = gdn_layer_forward(layer, h.bfloat16(), backend="tilelang")
    e_ours, e_theirs = _rel(ours, truth), _rel(theirs, truth)
    print(f"GDN layer Hk={Hk} Hv={Hv}: rel-L2 vs fp32 transformers: ours {e_ours:.2e}, transformers bf16 "
          f"{e_theirs:.2e}")
    assert e_ours < max(2 * e_theirs, 1e-2)

    # cached: prefill 300 tokens, continue with 5, then 3 decode steps
    c_ours, c_truth = DynamicCache(config=model.config), DynamicCache(config=model32.config)
    reason = layer_unsupported_reason(layer, c_ours)
    if reason is not None:  # a cache with neither hybrid-cache API: the patch hands such calls to transformers
        with pytest.raises(ValueError, match="hybrid-cache API"):
            gdn_layer_forward(layer, h[:, :3].bfloat16(), cache=c_ours)
        pytest.skip(f"cached fused path not available here: {reason}")
    kw = "cache" if "cache" in inspect.signature(layer32.forward).parameters else "cache_params"
    errs = []
    with torch.no_grad():
        for s, e in ((0, 300), (300, 305), (305, 306), (306, 307), (307, 308)):
            o = gdn_layer_forward(layer, h[:, s:e].bfloat16(), cache=c_ours, backend="tilelang")
            errs.append(_rel(o, layer32(h[:, s:e], **{kw: c_truth})))
    print(f"  cached steps {['%.1e' % e for e in errs]}")
    assert max(errs) < 2e-2


def test_patched_greedy_generation_is_identical_for_64_tokens():
    """Greedy generation with and without the patch. Two bf16 paths that round differently can only be identical
    while no step is a near-tie: where the tokens first differ, the unpatched top-2 margin is compared with how far
    the two paths' logits are apart on that same prefix. A split at a margin above twice that distance is a bug and fails;
    a split at a near-tie is the rounding of two equally accurate paths (both are compared with an fp32 copy of the
    model there) and is reported as an expected failure, with the numbers. Before that, every one of the 64 greedy
    decisions is checked, not only those up to the first split: with the unpatched tokens fed to both paths (teacher
    forcing), the patched path must pick the unpatched token at every step whose top-2 margin exceeds twice the two
    paths' largest logit distance at that step (the most two logits can move against each other)."""
    model = _qwen35_layer(n=8, vocab=4096).to(torch.bfloat16)
    P, N = 37, 64
    ids = torch.randint(0, 4096, (2, P), device=DEV)
    kw = dict(max_new_tokens=N, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        with patched_gdn_layers():
            got = model.generate(ids, **kw)
        # teacher forcing on the unpatched sequence: the logits that decide generated tokens 0 .. N-1
        ref_all = model(want[:, :-1]).logits[:, P - 1:].float()
        with patched_gdn_layers():
            ours_all = model(want[:, :-1]).logits[:, P - 1:].float()
    top2 = ref_all.topk(2, dim=-1).values
    margins = top2[..., 0] - top2[..., 1]  # [2, N]
    gaps = (ours_all - ref_all).abs().amax(dim=-1)
    differ = ours_all.argmax(-1) != ref_all.argmax(-1)
    decisive = margins > 2 * gaps
    print(f"teacher-forced greedy decisions: {int((~differ).sum())} of {differ.numel()} identical; "
          f"{int(decisive.sum())} not near-ties, {int((differ & decisive).sum())} of those differ; "
          f"median top-2 margin {margins.median().item():.3g}, median logit distance {gaps.median().item():.3g}")
    assert not (differ & decisive).any(), "the patched path picks another token where the unpatched one is decisive"
    same = (got == want).all(dim=0)
    if same.all():
        return
    first_diff = int((~same).nonzero()[0]) - ids.shape[1]
    prefix = want[:, :ids.shape[1] + first_diff]
    with torch.no_grad():
        ref = model(prefix).logits[:, -1].float()
        with patched_gdn_layers():
            ours = model(prefix).logits[:, -1].float()
        truth = model.float()(prefix).logits[:, -1]
    top2 = ref.topk(2, dim=-1).values
    margin, gap = (top2[:, 0] - top2[:, 1]).min().item(), (ours - ref).abs().max().item()
    e_ours, e_theirs = _rel(ours, truth), _rel(ref, truth)
    detail = (f"greedy tokens differ from generated token {first_diff} on; there the unpatched top-2 logit margin is "
              f"{margin:.3g} and the two paths' logits differ by up to {gap:.3g} on the same prefix; rel-L2 of the "
              f"logits vs fp32: patched {e_ours:.2e}, unpatched {e_theirs:.2e}")
    print(detail)
    assert margin < 2 * gap, f"not a near-tie: {detail}"
    assert e_ours < 1.5 * e_theirs + 1e-3, f"the patched path is further from fp32 than transformers': {detail}"
    pytest.xfail(f"near-tie between two bf16 paths: {detail}")


def _ref_grads(fn, inputs, grads):
    """Gradients of sum(out * grad) through ``fn`` on ``inputs`` upcast to fp32 (the torch formulation's autograd)."""
    xs = [t.detach().float().requires_grad_(True) if t is not None else None for t in inputs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, grads) if g is not None)
    live = [t for t in xs if t is not None]
    got = iter(torch.autograd.grad(loss, live, allow_unused=True))
    return [next(got) if t is not None else None for t in xs]


# conv cases without a conv state (the backward kernel's contract): (B, T, Hk, Hv, D, Kc, dtype, bias)
CONV_BWD_CASES = {
    "qwen35_2b_T1000": (2, 1000, 16, 16, 128, 4, torch.bfloat16, False),
    "gva4_T64_bias_fp16": (1, 64, 1, 4, 128, 4, torch.float16, True),
    "T63_dim64_bias": (2, 63, 2, 4, 64, 4, torch.bfloat16, True),
    "T3_shorter_than_kernel_dim256": (1, 3, 2, 2, 256, 4, torch.bfloat16, False),
    "T30_width2": (1, 30, 1, 2, 128, 2, torch.bfloat16, False),
}


@pytest.mark.parametrize("name", sorted(CONV_BWD_CASES))
def test_conv_backward_kernel_matches_autograd_and_repeats_bit_for_bit(name):
    """dqkv, dweight and dbias of the conv + SiLU + l2norm backward kernel against fp32 autograd through the torch
    formulation on the same inputs (the weight rounded as the forward reads it), outputs poisoned; two runs equal."""
    from flashqla_kernels.decoder import hopper

    B, T, Hk, Hv, D, Kc, dtype, bias = CONV_BWD_CASES[name]
    x = _conv_inputs(B, T, Hk, Hv, D, Kc, dtype, False, bias, seed=3)
    g = torch.Generator(device=DEV).manual_seed(4)
    dq, dk = (torch.randn(B, T, Hk, D, generator=g, device=DEV).to(dtype) for _ in range(2))
    dv = torch.randn(B, T, Hv, D, generator=g, device=DEV).to(dtype)
    w = x["weight"].to(dtype)

    def fwd(qkv, w_, b_):
        y = torch_path.causal_conv1d_silu(qkv, w_, b_)
        q, k, v = torch.split(y, [Hk * D, Hk * D, Hv * D], -1)
        return (torch_path.l2norm_fp32(q.reshape(B, T, Hk, D)), torch_path.l2norm_fp32(k.reshape(B, T, Hk, D)),
                v.reshape(B, T, Hv, D))

    ref = _ref_grads(fwd, [x["qkv"], w, x["bias"]], [dq, dk, dv])
    with toolkit.poisoned_outputs():
        got = hopper.conv_qkv_bwd(x["qkv"], w, x["bias"], dq, dk, dv, Hk=Hk, K=D, Hv=Hv)
        again = hopper.conv_qkv_bwd(x["qkv"], w, x["bias"], dq, dk, dv, Hk=Hk, K=D, Hv=Hv)
    errs = [_rel(a, r) if r is not None else 0.0 for a, r in zip(got, ref)]
    print(f"conv backward {name}: rel-L2 dqkv {errs[0]:.1e}, dweight {errs[1]:.1e}, dbias {errs[2]:.1e}")
    assert errs[0] < 1e-2 and errs[1] < 1e-3 and errs[2] < 1e-3
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("rows,D,dtype,residual", [(4099, 2048, torch.bfloat16, True), (777, 2048, torch.bfloat16, False),
                                                   (300, 64, torch.float16, True), (513, 2048, torch.float32, True)])
def test_rms_norm_backward_kernel_matches_autograd(rows, D, dtype, residual):
    from flashqla_kernels.decoder import hopper

    g = torch.Generator(device=DEV).manual_seed(5)
    x = (2 * torch.randn(rows, D, generator=g, device=DEV)).to(dtype)
    w = 0.1 * torch.randn(D, generator=g, device=DEV)
    dy = torch.randn(rows, D, generator=g, device=DEV).to(dtype)
    ds = torch.randn(rows, D, generator=g, device=DEV).to(dtype) if residual else None
    ref = _ref_grads(lambda x_, w_: torch_path.rms_norm_zero_centred(x_, w_, 1e-6), [x, w], [dy])
    if residual:
        ref[0] = ref[0] + ds.float()
    with toolkit.poisoned_outputs():
        dx, dw = hopper.rms_norm_bwd(x, w, 1e-6, dy, ds)
        dx2, dw2 = hopper.rms_norm_bwd(x, w, 1e-6, dy, ds)
    print(f"rms_norm backward rows={rows} D={D}: rel-L2 dx {_rel(dx, ref[0]):.1e}, dw {_rel(dw, ref[1]):.1e}")
    assert _rel(dx, ref[0]) < 1e-2 and _rel(dw, ref[1]) < 1e-4
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)


@pytest.mark.parametrize("rows,V,dtype", [(8195, 128, torch.bfloat16), (100, 64, torch.float16),
                                          (33, 256, torch.bfloat16)])
def test_gated_norm_backward_kernel_matches_autograd(rows, V, dtype):
    from flashqla_kernels.decoder import hopper

    g = torch.Generator(device=DEV).manual_seed(6)
    o, z, dy = (torch.randn(rows, V, generator=g, device=DEV).to(dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(V, generator=g, device=DEV)).to(dtype)
    ref = _ref_grads(lambda o_, z_, w_: torch_path.gated_rms_norm(o_, z_, w_, 1e-6), [o, z, w], [dy])
    with toolkit.poisoned_outputs():
        got = hopper.gated_rms_norm_bwd(o, z, w, 1e-6, dy)
        again = hopper.gated_rms_norm_bwd(o, z, w, 1e-6, dy)
    errs = [_rel(a, r) for a, r in zip(got, ref)]
    print(f"gated norm backward rows={rows} V={V}: rel-L2 do {errs[0]:.1e}, dz {errs[1]:.1e}, dw {errs[2]:.1e}")
    assert errs[0] < 1e-2 and errs[1] < 1e-2 and errs[2] < 1e-4
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("rows,D,dtype", [(1000, 6144, torch.bfloat16), (37, 64, torch.float16)])
def test_silu_mul_backward_kernel_matches_autograd(rows, D, dtype):
    from flashqla_kernels.decoder import hopper

    g = torch.Generator(device=DEV).manual_seed(7)
    gate, up, dout = (torch.randn(rows, D, generator=g, device=DEV).to(dtype) for _ in range(3))
    ref = _ref_grads(torch_path.silu_mul, [gate, up], [dout])
    with toolkit.poisoned_outputs():
        got = hopper.silu_mul_bwd(gate, up, dout)
    errs = [_rel(a, r) for a, r in zip(got, ref)]
    print(f"silu_mul backward rows={rows} D={D}: rel-L2 dgate {errs[0]:.1e}, dup {errs[1]:.1e}")
    assert max(errs) < 1e-2


@pytest.mark.parametrize("weights", ["bf16", "fp32_autocast"])
def test_patched_decoder_training_gradients_match_transformers_within_bf16(monkeypatch, weights):
    """A training step's gradients on Qwen3.5-2B-shaped decoder layers (GDN then attention): bf16 weights, or fp32
    weights under bf16 autocast as ``finetune`` trains (the residual stream then stays fp32: the norms' fp32 rows).
    With the patches every glue stage with a backward kernel runs it, and every parameter's gradient is as close to
    fp32 transformers' as transformers' own step in that precision."""
    from flashqla_kernels.decoder import autograd

    types = ("linear_attention", "full_attention")
    truth_model = _qwen35_layer(layers=types).float().train().requires_grad_(True)
    model = _qwen35_layer(layers=types).train().requires_grad_(True)
    autocast = weights == "fp32_autocast"
    model = model.float() if autocast else model.to(torch.bfloat16)
    # 257 tokens: a chunk past four, short enough for transformers' fp32 reference path (FLA's kernels compile on
    # their first call in each dtype) to fit the GPU phase's limit
    ids = torch.randint(0, 1024, (2, 257), device=DEV)

    def grads(m, autocast):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}

    truth, theirs = grads(truth_model, False), grads(model, autocast)
    calls = []
    names = ("_ConvQKVGates", "_GatedNorm", "_SiluMul", "_RMSNorm", "_AddRMSNorm")
    for n in names:
        fn = getattr(autograd, n)
        monkeypatch.setattr(fn, "apply", (lambda n, apply: lambda *a: calls.append(n) or apply(*a))(n, fn.apply))
    with patched_gdn_layers():
        ours = grads(model, autocast)
    assert set(calls) == set(names), calls
    assert set(ours) == set(truth)
    worst = []
    for n in truth:
        e_ours, e_theirs = _rel(ours[n], truth[n]), _rel(theirs[n], truth[n])
        worst.append((e_ours - max(1.5 * e_theirs, 2e-2), n, e_ours, e_theirs))
    worst.sort(reverse=True)
    for _, n, e_ours, e_theirs in worst[:6]:
        print(f"{weights} grad {n}: rel-L2 vs fp32 ours {e_ours:.2e}, transformers {e_theirs:.2e}")
    assert worst[0][0] <= 0, worst[0]


def test_rms_norm_kernels_take_the_fp32_residual_stream():
    """fp32 weights under bf16 autocast keep the residual stream fp32: the RMSNorm kernel on fp32 rows against the
    torch formulation, and the add + RMSNorm kernel on an fp32 residual and a bf16 mixer output against torch's
    promoting add (the sum bit for bit) then the norm. Written in autocast's bf16 (``out_dtype``), each norm is the
    fp32 kernel's output rounded once, bit for bit, the sum still fp32; the backward kernel reads a bf16 dy as the
    fp32 kernel reads that dy widened, bit for bit; and through the autograd Functions every output and gradient
    matches fp32 torch autograd within bf16 rounding."""
    from flashqla_kernels.decoder import autograd, hopper

    bf = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(8)
    x = 3 * torch.randn(1000, 2048, generator=g, device=DEV)
    h = torch.randn(1000, 2048, generator=g, device=DEV).to(bf)
    w = 0.1 * torch.randn(2048, generator=g, device=DEV)
    with toolkit.poisoned_outputs():
        y = hopper.rms_norm_fwd(x, w, 1e-6)
        s, ys = hopper.add_rms_norm_fwd(x, h, w, 1e-6)
        y16 = hopper.rms_norm_fwd(x, w, 1e-6, out_dtype=bf)
        s16, ys16 = hopper.add_rms_norm_fwd(x, h, w, 1e-6, out_dtype=bf)
    assert y.dtype == s.dtype == ys.dtype == s16.dtype == torch.float32 and y16.dtype == ys16.dtype == bf
    assert _rel(y, torch_path.rms_norm_zero_centred(x, w, 1e-6)) < 1e-5
    assert torch.equal(s, x + h)
    assert _rel(ys, torch_path.rms_norm_zero_centred(x + h, w, 1e-6)) < 1e-5
    assert torch.equal(y16, y.to(bf)) and torch.equal(s16, s) and torch.equal(ys16, ys.to(bf))

    dy = torch.randn(1000, 2048, generator=g, device=DEV).to(bf)
    ds = torch.randn(1000, 2048, generator=g, device=DEV)
    for residual in (None, ds):
        with toolkit.poisoned_outputs():
            got = hopper.rms_norm_bwd(x, w, 1e-6, dy, residual)
            wide = hopper.rms_norm_bwd(x, w, 1e-6, dy.float(), residual)
        assert got[0].dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(got, wide))

    def run(x_, h_, w_, ours):
        if ours:
            y_ = autograd.rms_norm(x_, w_, 1e-6, out_dtype=bf)
            s_, ys_ = autograd.add_rms_norm(x_, h_, w_, 1e-6, out_dtype=bf)
        else:
            y_ = torch_path.rms_norm_zero_centred(x_, w_, 1e-6)
            s_, ys_ = x_ + h_, torch_path.rms_norm_zero_centred(x_ + h_, w_, 1e-6)
        return y_, s_, ys_

    cot = [torch.randn(1000, 2048, generator=g, device=DEV) for _ in range(3)]
    outs, grads = {}, {}
    for ours in (True, False):
        leaves = [x.clone().requires_grad_(True), (h if ours else h.float()).clone().requires_grad_(True),
                  w.clone().requires_grad_(True)]
        with toolkit.poisoned_outputs():
            outs[ours] = run(*leaves, ours)
            loss = sum((o.float() * c).sum() for o, c in zip(outs[ours], cot))
            grads[ours] = torch.autograd.grad(loss, leaves)
    assert [o.dtype for o in outs[True]] == [bf, torch.float32, bf]
    assert [d.dtype for d in grads[True]] == [torch.float32, bf, torch.float32]
    errs = [_rel(a, b) for a, b in zip(outs[True] + grads[True], outs[False] + grads[False])]
    print("fp32 rows, bf16 out: rel-L2 y, s, y(s), dx, dh, dw " + ", ".join(f"{e:.1e}" for e in errs))
    assert errs[1] == 0 and max(errs) < 1e-2
