"""The op patch (``flashqla_kernels.patching.op``): tiny Qwen3-Next / Qwen3.5 / Qwen3.5-MoE models give the same
logits and greedy generations patched and unpatched, our op is really called (prefill and decode), and unpatching
restores."""
from __future__ import annotations

import pytest
import torch

import flashqla_kernels.patching.op as patch_mod
from flashqla_kernels import is_patched, patch_transformers, patched_transformers, unpatch_transformers
from flashqla_kernels.gated_delta_rule.reference import recurrent_gated_delta_rule_ref
from flashqla_kernels.patching import families, registry
from tests.factories import tiny_model
from tests.flashqla_kernels.test_reference import make_inputs

FAMILIES = [f.name for f in families.FAMILIES]


def _module(family):
    return next(f for f in families.FAMILIES if f.name == family).module()


@pytest.fixture(autouse=True)
def _always_unpatched():
    unpatch_transformers()
    yield
    unpatch_transformers()


@pytest.fixture
def counted(monkeypatch):
    """Count calls that reach our public ops through the patch."""
    counts = {"chunk": 0, "recurrent": 0}
    for kind, name in (("chunk", "chunk_gated_delta_rule"), ("recurrent", "recurrent_gated_delta_rule")):
        original = getattr(patch_mod, name)

        def spy(*args, _original=original, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(patch_mod, name, spy)
    return counts


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_gives_same_logits_and_generations(family, counted):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids[:1], use_cache=False).logits
        generated = model.generate(ids[:, :5], max_new_tokens=5, do_sample=False)
        with patched_transformers():
            logits_p = model(ids[:1], use_cache=False).logits
            generated_p = model.generate(ids[:, :5], max_new_tokens=5, do_sample=False)
    # 2 GDN layers: 1 forward + 1 prefill through the chunk op, then 4 decode steps through the recurrent op.
    assert counted["chunk"] == 2 * 2 and counted["recurrent"] == 2 * 4
    torch.testing.assert_close(logits_p, logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(generated_p, generated)
    assert generated.shape == (2, 10)


def test_unpatch_restores_the_originals_and_patch_is_idempotent():
    originals = {(f, name): getattr(_module(f), name) for f in FAMILIES for name in patch_mod.GLOBALS}
    targets = patch_transformers()
    assert len(targets) == 6 and is_patched()
    patch_transformers(backend="torch")  # twice, another backend: originals must not be overwritten by ours
    for (f, name), fn in originals.items():
        assert getattr(_module(f), name) is not fn
        assert registry.backend_of(getattr(_module(f), name)) == "torch"
    assert len(unpatch_transformers()) == 6 and not is_patched()
    for (f, name), fn in originals.items():
        assert getattr(_module(f), name) is fn
    assert unpatch_transformers() == []


def test_context_manager_restores_the_state_found_on_entry():
    original = _module("qwen3_5").torch_chunk_gated_delta_rule
    with patched_transformers(backend="torch"):
        assert _module("qwen3_5").torch_chunk_gated_delta_rule is not original
    assert _module("qwen3_5").torch_chunk_gated_delta_rule is original
    patch_transformers(backend="torch")
    with patched_transformers(backend=None):
        assert registry.backend_of(_module("qwen3_5").torch_chunk_gated_delta_rule) is None
    assert registry.backend_of(_module("qwen3_5").torch_chunk_gated_delta_rule) == "torch"


def test_patched_globals_accept_model_kwargs_and_honour_cu_seqlens():
    q, k, v, g, beta, h0 = make_inputs(1, 80, 2, 4, dtype=torch.float32, n_states=2)
    offsets = torch.tensor([0, 17, 80], dtype=torch.int32)
    with patched_transformers():
        fn = _module("qwen3_5").torch_chunk_gated_delta_rule
        o, s = fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=offsets, use_cache=True, position_ids=None)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                  initial_state=h0.double(), output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), s_ref, atol=1e-5, rtol=1e-5)


def test_instance_attributes_of_old_transformers_layers_are_patched_and_restored():
    def old_chunk(*args, **kwargs):
        raise AssertionError("the original must not run while patched")

    class OldGatedDeltaNet(torch.nn.Module):  # transformers < 5.15 stores the kernels on the instance
        def __init__(self):
            super().__init__()
            self.chunk_gated_delta_rule = old_chunk
            self.recurrent_gated_delta_rule = old_chunk

    model = torch.nn.Sequential(OldGatedDeltaNet())
    targets = patch_transformers(backend="torch", model=model)
    assert "0.chunk_gated_delta_rule" in targets and "0.recurrent_gated_delta_rule" in targets
    q, k, v, g, beta, _ = make_inputs(1, 5, 1, 2, dtype=torch.float32)
    o, _ = model[0].chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                           use_qk_l2norm_in_kernel=True)
    assert o.shape == (1, 5, 2, 8)
    unpatch_transformers()
    assert model[0].chunk_gated_delta_rule is old_chunk and model[0].recurrent_gated_delta_rule is old_chunk


def test_patch_rejects_unknown_backend():
    with pytest.raises(ValueError, match="got 'cuda'"):
        patch_transformers(backend="cuda")
    assert not is_patched()


def test_transformers_op_parts_finds_the_implementation_and_the_torch_function():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    implementation, pure = patch_mod.transformers_op_parts(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    # no FLA on this machine: transformers' wrapper runs its own torch function
    assert implementation is pure and pure.__module__ == modeling_qwen3_5.__name__
    assert "chunk_size" in __import__("inspect").signature(pure).parameters

    def torch_fn(x):
        return x

    def fla_fn(x):
        return -x

    def wrapper(implementation, torch_function):
        def wrapped(*args):
            return implementation(*args) if torch_function else None
        return wrapped

    wrapped = wrapper(fla_fn, torch_fn)

    class Func(torch.nn.Module):  # the kernels package's function module: its forward closes over the wrapper
        def forward(self, *args):
            return wrapped(*args)

    assert patch_mod.transformers_op_parts(wrapped) == (fla_fn, torch_fn)
    assert patch_mod.transformers_op_parts(Func()) == (fla_fn, torch_fn)
    assert patch_mod.transformers_op_parts(torch_fn) == (torch_fn, torch_fn)
