"""causal_lm_loss against transformers' own loss on tiny random Qwen models: the same value and the same gradient of
every parameter in fp32 (any block size, tied or untied head), within bf16 rounding under autocast, and
transformers' loss where the head is not a plain Linear."""
from __future__ import annotations

import pytest
import torch

from hooks import get_adapter
from qwen_scope.applications.lm_loss import causal_lm_loss, fused_head
from tests.factories import tiny_model


def _grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model, x):
    return model(input_ids=x, labels=x, use_cache=False).loss


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("family,tied", [("qwen3_5", False), ("qwen3", True), ("qwen3_moe", False),
                                         ("qwen3_5_vl", False)])
def test_value_and_every_gradient_match_transformers_in_fp32(family, tied):
    model = tiny_model(family).train()
    if tied:  # the embedding and the head one parameter: both gradients land in it
        model.lm_head.weight = model.get_input_embeddings().weight
    adapter = get_adapter(model)
    assert fused_head(adapter) is adapter.unembed
    x = torch.randint(0, model.config.get_text_config().vocab_size, (2, 17))
    ref_loss, ref = _grads(model, lambda: _reference(model, x))
    for block in (5, 1024):  # blocks that split the 32 rows unevenly, and one block
        loss, got = _grads(model, lambda: causal_lm_loss(adapter, x, block_rows=block))
        assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
        assert got.keys() == ref.keys()
        worst = max(_rel(got[n], ref[n]) for n in ref)
        assert worst < 5e-5, worst  # fp32 sums in another order


def test_under_bf16_autocast_it_is_transformers_loss_to_bf16_rounding():
    model = tiny_model("qwen3_5", seed=1).train()
    adapter = get_adapter(model)
    x = torch.randint(0, model.config.get_text_config().vocab_size, (2, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = _grads(model, lambda: _reference(model, x))
        loss, got = _grads(model, lambda: causal_lm_loss(adapter, x, block_rows=7))
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-3)
    head = "lm_head.weight"
    assert got[head].dtype == torch.float32 and _rel(got[head], ref[head]) < 2e-2
    assert max(_rel(got[n], ref[n]) for n in ref) < 5e-2


def test_a_head_with_a_soft_cap_or_a_bias_takes_transformers_loss():
    model = tiny_model("qwen3", seed=2)
    adapter = get_adapter(model)
    x = torch.randint(0, model.config.get_text_config().vocab_size, (1, 9))
    model.config.final_logit_softcapping = 30.0
    assert fused_head(adapter) is None
    assert causal_lm_loss(adapter, x).item() == _reference(model, x).item()
    model.config.final_logit_softcapping = None
    assert fused_head(adapter) is adapter.unembed
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, tokens\] with at least 2 tokens a row, got "
                                         r"shape \(1, 1\)"):
        causal_lm_loss(adapter, x[:, :1])


def test_a_second_backward_is_refused_with_the_fix():
    model = tiny_model("qwen3", seed=3).train()
    adapter = get_adapter(model)
    x = torch.randint(0, model.config.vocab_size, (1, 9))
    loss = causal_lm_loss(adapter, x)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice: .* compute the loss again instead of retain_graph"):
        loss.backward()


def test_without_grad_the_head_sees_one_block_of_rows_at_a_time_and_the_value_is_the_same():
    model = tiny_model("qwen3_5", seed=4)
    adapter = get_adapter(model)
    x = torch.randint(0, model.config.vocab_size, (3, 21))
    seen = []
    hook = adapter.unembed.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[0]))
    try:
        with torch.no_grad():
            ref = _reference(model, x)
            seen.clear()
            got = causal_lm_loss(adapter, x, block_rows=8)
    finally:
        hook.remove()
    assert seen == [8] * 7 + [4]  # 3 x 20 predictions in blocks of 8
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_mask_builder_is_not_asked_about_packed_rows_where_the_masks_are_known(impl, monkeypatch):
    """The loss passes the adapter's unpadded masks: transformers' packed-rows check, which reads its answer back to
    the host, does not run (sdpa); eager attention, which needs transformers' own causal mask, still gets it. The
    value and every gradient are transformers' either way."""
    from transformers import masking_utils

    calls = []
    check = masking_utils.find_packed_sequence_indices

    def spy(position_ids):
        calls.append(position_ids.shape)
        return check(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    model = tiny_model("qwen3", seed=6).train()
    model.config._attn_implementation = impl
    adapter = get_adapter(model)
    x = torch.randint(0, model.config.vocab_size, (2, 17))
    ref_loss, ref = _grads(model, lambda: _reference(model, x))
    assert calls, "transformers' own loss path no longer asks: nothing for the masks to spare"
    calls.clear()
    loss, got = _grads(model, lambda: causal_lm_loss(adapter, x))
    assert (calls == []) == (impl == "sdpa")
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert max(_rel(got[n], ref[n]) for n in ref) < 5e-5


@pytest.mark.gpu
def test_on_cuda_under_bf16_autocast_no_host_sync_and_transformers_values():
    """The CUDA path (on Hopper the cross-entropy kernel and the in-place scale) against transformers' loss; the
    whole loss, the model's forward and backward included, with every host synchronisation an error. A Qwen3 model:
    the loss is the same for every family, and a fresh GPU machine would compile FLA's Triton kernels for minutes
    for a Qwen3.5 one."""
    model = tiny_model("qwen3", seed=5).cuda().train()
    adapter = get_adapter(model)
    x = torch.randint(0, model.config.vocab_size, (2, 65), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss, ref = _grads(model, lambda: _reference(model, x))
        loss, got = _grads(model, lambda: causal_lm_loss(adapter, x, block_rows=48))
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-3)
    assert got.keys() == ref.keys()
    assert max(_rel(got[n], ref[n]) for n in ref) < 5e-2

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss(adapter, x)
        (loss / 3).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
