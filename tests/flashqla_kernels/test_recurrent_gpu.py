"""The fused recurrent kernel (``hopper/recurrent.py``) through the public ``recurrent_gated_delta_rule``, and the GDN
decode step on it (``decoder/decode.py``), against the float64 reference and transformers' own layer, on sm_90.

Every case: outputs poisoned before the kernel runs, relative L2 <= 0.5% for o and the final state against the
float64 recurrence, no NaN, bit-identical on a second run; the decode step equals the engine's torch formulation
(HF modules) step after step with the states carried, and makes no host sync.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from flashqla_kernels import explain_backend, recurrent_gated_delta_rule, toolkit
from flashqla_kernels.gated_delta_rule.reference import recurrent_gated_delta_rule_ref

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

RTOL_L2 = 5e-3


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def _inputs(B, T, Hk, Hv, K, V, dtype, *, lens=None, seed=0):
    torch.manual_seed(seed)
    dev = "cuda"
    if lens is not None:
        B, T = 1, sum(lens) + 3  # a padded tail after the last sequence
    N = len(lens) if lens is not None else B
    q, k = torch.randn(B, T, Hk, K, device=dev), torch.randn(B, T, Hk, K, device=dev)
    v = torch.randn(B, T, Hv, V, device=dev)
    A = torch.linspace(0, 16, Hv, device=dev)  # a g == 0 head up to very strong decay
    g = -A * torch.nn.functional.softplus(0.5 * torch.randn(B, T, Hv, device=dev) + 1)
    beta = torch.sigmoid(torch.randn(B, T, Hv, device=dev))
    h0 = torch.randn(N, Hv, K, V, device=dev)
    cu = None if lens is None else torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, h0, cu


CASES = {
    # name: (B, T, Hk, Hv, K, V, dtype, lens)
    "decode_2b_bf16": (8, 1, 16, 16, 128, 128, torch.bfloat16, None),
    "decode_gva2_bf16": (3, 1, 2, 4, 128, 128, torch.bfloat16, None),
    "short_gva4_fp16": (2, 37, 1, 4, 128, 128, torch.float16, None),
    "fp32_dim64": (2, 9, 2, 2, 64, 64, torch.float32, None),
    "dim256_bf16": (2, 5, 2, 2, 256, 256, torch.bfloat16, None),
    "small_dims_16": (2, 6, 2, 4, 16, 16, torch.float32, None),
    "varlen_padded_bf16": (1, 1, 2, 4, 128, 128, torch.bfloat16, [1, 17, 5, 1]),
}


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_recurrent_kernel_matches_the_float64_recurrence(name, l2norm):
    B, T, Hk, Hv, K, V, dtype, lens = CASES[name]
    q, k, v, g, beta, h0, cu = _inputs(B, T, Hk, Hv, K, V, dtype, lens=lens)
    if not l2norm:
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(dtype) for x in (q, k))
    assert explain_backend(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, op="recurrent").startswith(
        "recurrent_gated_delta_rule: backend tilelang")
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    with toolkit.poisoned_outputs():
        o, s = recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
        o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    ref_o, ref_s = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                  initial_state=h0.double(), output_final_state=True,
                                                  use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert _rel(o, ref_o) <= RTOL_L2 and _rel(s, ref_s) <= RTOL_L2
    assert torch.equal(o, o2) and torch.equal(s, s2)
    if lens is not None:
        assert o[:, sum(lens):].abs().max() == 0


def test_the_decode_state_can_be_updated_in_place_and_no_host_sync_happens():
    from flashqla_kernels.gated_delta_rule.hopper import recurrent

    q, k, v, g, beta, h0, _ = _inputs(4, 1, 16, 16, 128, 128, torch.bfloat16)
    expect_o, expect_s = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    state = h0.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, s = recurrent.fused_recurrent(q, k, v, g, beta, 128 ** -0.5, initial_state=state, final_state=state,
                                         use_qk_l2norm_in_kernel=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert s is state and torch.equal(state, expect_s) and torch.equal(o, expect_o)


def _decode_model(family: str):
    """A small random model whose GDN heads the kernels take (K = V = 128), in bf16 on the GPU."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    if family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=64)
        model = tf.Qwen3NextForCausalLM(cfg)
    else:
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**common))
    return model.to("cuda", torch.bfloat16).eval()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_decode_step_equals_the_torch_formulation_over_many_steps(family, monkeypatch):
    from flashqla_kernels.decoder import decode_step_reason, gdn_decode_step
    from qwen_scope.engine import layers

    gdn = _decode_model(family).model.layers[0].linear_attn
    B, C, Kc = 5, gdn.key_dim * 2 + gdn.value_dim, gdn.conv_kernel_size
    torch.manual_seed(1)
    conv = torch.randn(B, Kc - 1, C, device="cuda", dtype=torch.bfloat16)
    rec = torch.randn(B, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, device="cuda") * 0.1
    conv_t, rec_t = conv.clone(), rec.clone()
    monkeypatch.setattr(layers, "decode_step_reason", lambda *a: "forced torch formulation")
    for step in range(6):
        x = torch.randn(B, 1, gdn.hidden_size, device="cuda", dtype=torch.bfloat16)
        assert decode_step_reason(gdn, x) is None
        with torch.no_grad():
            out = gdn_decode_step(gdn, x, conv, rec)
            ref = layers.gdn_decode(gdn, x, conv_t, rec_t)
        assert torch.equal(conv, conv_t), step  # the shift is a copy of the same values
        # the kernels l2-normalise q / k in fp32 and store them in bf16; the torch formulation normalises the bf16
        # conv outputs in fp32 inside the op: a bf16 rounding apart
        assert _rel(rec, rec_t.double()) <= RTOL_L2, step
        assert _rel(out, ref.double()) <= 2e-2, step  # bf16 rounding inside transformers' gated norm
        conv_t.copy_(conv)
        rec_t.copy_(rec)


def test_decode_engine_runs_the_kernels_inside_its_graph_and_agrees_with_generate():
    from qwen_scope.engine import DecodeEngine

    model = _decode_model("qwen3_5")
    prompts = [torch.tensor([5, 17, 99, 3, 42, 7, 201], device="cuda"), torch.tensor([11, 250, 64], device="cuda")]
    graph = DecodeEngine(model).generate(prompts, max_new_tokens=10, keep_logits=True, stop_tokens=[])
    eager = DecodeEngine(model, use_graph=False).generate(prompts, max_new_tokens=10, keep_logits=True,
                                                          stop_tokens=[])
    assert graph.graph
    for g_row, e_row, prompt in zip(graph.rows, eager.rows, prompts):
        assert torch.equal(g_row.token_ids, e_row.token_ids) and torch.equal(g_row.logits, e_row.logits)
        with torch.no_grad():
            out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=10,
                                 do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        ref = torch.stack([lg[0] for lg in out.logits]).float().cpu()
        # teacher-forced agreement: the first differing token must be a near tie of the reference's logits
        hf = out.sequences[0, prompt.shape[0]:].cpu()
        same = (hf == g_row.token_ids).long().cumprod(0).sum().item()
        if same < len(hf):
            top2 = ref[same].topk(2).values
            assert (top2[0] - top2[1]).item() <= (g_row.logits[same] - ref[same]).abs().max().item() * 2
        assert _rel(g_row.logits[:same + 1], ref[:same + 1].double()) <= 3e-2
