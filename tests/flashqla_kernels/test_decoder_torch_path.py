"""The decoder's torch formulations (``flashqla_kernels.decoder.torch_path``) against transformers' operations: the
zero-centred RMSNorm and the MLP's ``silu(gate) * up`` bit for bit, the attention glue's q/k norm + partial RoPE and
gate by hand."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.decoder import torch_path
from tests.factories import tiny_model
from tests.flashqla_kernels.test_decoder_gdn_layer import mlp_of, text_model

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_formulation_is_transformers_bit_for_bit(dtype):
    model = tiny_model("qwen3_5").to(dtype)
    norm = text_model(model).layers[0].input_layernorm
    x = (3 * torch.randn(2, 7, norm.weight.shape[0])).to(dtype)
    with torch.no_grad():
        assert torch.equal(torch_path.rms_norm_zero_centred(x, norm.weight, norm.eps), norm(x))


def test_silu_mul_formulation_is_transformers_bit_for_bit_in_fp32_and_rounds_once_in_bf16():
    mlp = mlp_of(tiny_model("qwen3_5"))
    x = torch.randn(2, 9, mlp.hidden_size)
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        assert torch.equal(torch_path.silu_mul(gate, up), mlp.act_fn(gate) * up)
        assert torch.equal(mlp.down_proj(torch_path.silu_mul(gate, up)), mlp(x))
        got = torch_path.silu_mul(gate.bfloat16(), up.bfloat16())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (torch.nn.functional.silu(gate.bfloat16().float()) * up.bfloat16().float()).bfloat16())


def test_attention_glue_formulation_rotates_only_the_first_r_channels():
    """qk_norm_rope by hand: with cos = 1, sin = 0 it is the norm alone; with cos = 0, sin = 1 the first R channels
    are the rotated half (-x2, x1) and the rest untouched; gate_mul is attn * sigmoid(gate)."""
    torch.manual_seed(0)
    B, L, H, Hkv, D, R = 2, 5, 4, 2, 16, 8
    qg, kx = torch.randn(B, L, H, 2 * D), torch.randn(B, L, Hkv, D)
    wq, wk = torch.randn(D) * 0.1, torch.randn(D) * 0.1
    nq = torch_path.rms_norm_zero_centred(qg[..., :D], wq, 1e-6).transpose(1, 2)
    nk = torch_path.rms_norm_zero_centred(kx, wk, 1e-6).transpose(1, 2)
    q, k = torch_path.qk_norm_rope(qg, kx, wq, wk, 1e-6, torch.ones(1, L, R), torch.zeros(1, L, R))
    assert torch.equal(q, nq) and torch.equal(k, nk) and q.is_contiguous() and q.shape == (B, H, L, D)
    q, _ = torch_path.qk_norm_rope(qg, kx, wq, wk, 1e-6, torch.zeros(B, L, R), torch.ones(B, L, R))
    assert torch.equal(q[..., :R // 2], -nq[..., R // 2:R]) and torch.equal(q[..., R // 2:R], nq[..., :R // 2])
    assert torch.equal(q[..., R:], nq[..., R:])
    attn = torch.randn(B, L, H * D)
    want = attn * torch.sigmoid(qg[..., D:].reshape(B, L, H * D))
    assert torch.equal(torch_path.gate_mul(attn, qg), want)
    head_major = attn.view(B, L, H, D).transpose(1, 2).contiguous()
    assert torch.equal(torch_path.gate_mul_head_major(head_major, qg), want)
