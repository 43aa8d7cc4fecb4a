"""On an sm_90 GPU: the public op dispatches to the TileLang kernels and matches the float64 reference, grad inputs
keep the kernels (the Hopper backward), and a patched bf16 Qwen3.5-shaped model (head dim 128) matches the unpatched one."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels import (
    chunk_gated_delta_rule, explain_backend, patched_transformers, recurrent_gated_delta_rule,
)
from flashqla_kernels.gated_delta_rule.reference import recurrent_gated_delta_rule_ref
from tests.flashqla_kernels.test_reference import make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

# (Hk, Hv, K, dtype, N, l2norm) of the kernel calls below, for benchmarks/gdn_forward.py's precompile list: the
# public-op test's varlen batch and the tiny model's GDN layers (2 rows, 8 / 16 heads) under the op patch
KERNEL_LAYOUTS = [(2, 4, 128, "bfloat16", 5, True), (8, 16, 128, "bfloat16", 2, True)]


def rel_l2(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _cuda_inputs(lengths, Hk=2, Hv=4, K=128, V=128):
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), Hk, Hv, K=K, V=V, n_states=len(lengths))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    bf = [x.cuda().to(torch.bfloat16) for x in (q, k, v)]
    return (*bf, g.cuda().float(), beta.cuda().float(), h0.cuda().float(), offsets)


def test_public_op_runs_the_kernels_and_matches_the_reference():
    q, k, v, g, beta, h0, cu = _cuda_inputs([1, 47, 64, 200, 65])
    assert explain_backend(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu).startswith(
        "chunk_gated_delta_rule: backend tilelang")
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o_t, s_t = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend="torch")
    d = [x.double() for x in (q, k, v, g, beta, h0)]
    o_ref, s_ref = recurrent_gated_delta_rule_ref(*d[:5], initial_state=d[5], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_l2(o, o_ref) <= 5e-3 and rel_l2(s, s_ref) <= 5e-3
    assert rel_l2(o_t, o_ref) <= 5e-3 and rel_l2(s_t, s_ref) <= 1e-4
    o_dec, _ = recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1],
                                          initial_state=h0[:1], use_qk_l2norm_in_kernel=True)
    assert rel_l2(o_dec, o_ref[:, :1]) <= 5e-3


def test_grad_inputs_keep_the_kernels_and_the_gradient_matches_the_reference():
    q, k, v, g, beta, h0, cu = _cuda_inputs([70, 1])
    v = v.detach().requires_grad_()  # bf16 inputs the kernels support, one requiring grad
    assert explain_backend(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu).startswith(
        "chunk_gated_delta_rule: backend tilelang")
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True)
    (dv,) = torch.autograd.grad(o.float().sum() + s.sum(), v)
    vd = v.detach().double().requires_grad_()
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q.double(), k.double(), vd, g.double(), beta.double(),
                                                  initial_state=h0.double(), output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm_in_kernel=True)
    (dv_ref,) = torch.autograd.grad(o_ref.sum() + s_ref.sum(), vd)
    assert dv.dtype == torch.bfloat16 and rel_l2(dv, dv_ref) <= 1e-2


def _tiny_qwen35_head128():
    import transformers as tf

    config = tf.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, linear_num_key_heads=8,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    return tf.Qwen3_5ForCausalLM(config).to("cuda", torch.bfloat16).eval()


def test_patched_bf16_model_on_the_kernels_matches_unpatched():
    model = _tiny_qwen35_head128()
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.float()
        with patched_transformers():
            logits_p = model(ids, use_cache=False).logits.float()
            gen = model.generate(ids[:, :70], max_new_tokens=8, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        # Teacher-forced unpatched logits on the patched generation: every decode step must agree.
        ref = model(gen.sequences, use_cache=False).logits.float()[:, 69:-1]
    assert rel_l2(logits_p, logits) <= 1e-2
    step_logits = torch.stack(gen.logits, 1).float()
    assert rel_l2(step_logits, ref) <= 2e-2
