"""``decoder.decode``: the GDN decode step's wiring around its two kernels, on CPU.

The kernels themselves run on sm_90 only (``test_recurrent_gpu.py`` checks them against the float64 recurrence and
this step against transformers' layer). Here each kernel launcher is replaced by its contract in torch (the conv
kernel: conv + SiLU + l2norm + gates of the token with the state shifted in place; the recurrent kernel: the
recurrence from the state, the final state written into the state tensor, the gated RMSNorm of the output), so the
step's own work is what is tested: projections in either family's layout, the state layouts, the in-place updates,
the norm's weight and eps, the scale, the output projection. It must equal the decode engine's torch formulation
step after step, and refuse what the kernels cannot take with the reason.
"""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.decoder import decode, decode_step_reason, gdn_decode_step, torch_path
from flashqla_kernels.gated_delta_rule.torch_path import recurrent_gated_delta_rule_torch
from tests.factories import tiny_model


def _conv_contract(qkv, weight, bias, a, b, A_log, dt_bias, *, Hk, Hv, D, prefix, update_prefix):
    assert update_prefix and qkv.shape[1] == 1 and prefix.is_contiguous()
    out = torch_path.conv_split_l2norm_gates(qkv, weight, bias, a, b, A_log, dt_bias, Hk=Hk, K=D, Hv=Hv, V=D,
                                             prefix=prefix)
    prefix.copy_(torch.cat([prefix, qkv.to(prefix.dtype)], dim=1)[:, 1:])
    return out


def _recurrent_contract(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, final_state=None, z=None,
                        norm_weight=None, norm_eps=1e-6):
    o, s = recurrent_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, True, use_qk_l2norm_in_kernel)
    final_state.copy_(s)
    return torch_path.gated_rms_norm(o, z, norm_weight, norm_eps), final_state


@pytest.fixture
def contracts(monkeypatch):
    from flashqla_kernels.decoder.hopper import conv_gates
    from flashqla_kernels.gated_delta_rule.hopper import recurrent

    monkeypatch.setattr(conv_gates, "conv_qkv_gates", _conv_contract)
    monkeypatch.setattr(recurrent, "fused_recurrent", _recurrent_contract)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_the_step_equals_the_engine_torch_formulation_with_states_carried(family, contracts, monkeypatch):
    from qwen_scope.engine import layers

    gdn = next(layer.linear_attn for layer in tiny_model(family).model.layers if hasattr(layer, "linear_attn"))
    torch.manual_seed(0)
    B, C, Kc = 3, gdn.key_dim * 2 + gdn.value_dim, gdn.conv_kernel_size
    conv = torch.randn(B, Kc - 1, C)
    rec = torch.randn(B, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim) * 0.1
    conv_t, rec_t = conv.clone(), rec.clone()
    monkeypatch.setattr(layers, "decode_step_reason", lambda *a: "the torch formulation")
    for step in range(4):
        x = torch.randn(B, 1, gdn.hidden_size)
        with torch.no_grad():
            out = gdn_decode_step(gdn, x, conv, rec)
            ref = layers.gdn_decode(gdn, x, conv_t, rec_t)
        assert out.shape == (B, 1, gdn.hidden_size)
        torch.testing.assert_close(conv, conv_t, atol=0, rtol=0, msg=f"conv state, step {step}")
        torch.testing.assert_close(rec, rec_t, atol=1e-6, rtol=1e-5, msg=f"recurrent state, step {step}")
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5, msg=f"output, step {step}")


def test_the_reason_names_what_the_kernels_cannot_take():
    gdn = tiny_model("qwen3_5").model.layers[0].linear_attn
    x = torch.randn(2, 1, gdn.hidden_size)
    assert "cpu" in decode_step_reason(gdn, x)
    # past the device check, the tiny model's 16-wide heads are the conv kernel's obstacle
    reason = decode.hopper.conv_shape_reason(gdn.num_k_heads, gdn.head_k_dim, gdn.num_v_heads, gdn.head_v_dim,
                                             gdn.conv_kernel_size)
    assert reason == "head dim 16 unsupported by the conv kernel (supported: (64, 128, 256))"
