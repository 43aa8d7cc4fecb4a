"""The patching verbs and their one registry (``flashqla_kernels.patching``, ``patching.registry``): every swap is
recorded once with what was there, unpatching restores exactly that, and the context managers restore exactly the
state found on entry, whatever it was (every patched attribute compared by identity before and after nested
context managers of every kind)."""
from __future__ import annotations

import contextlib
import itertools
import types

import pytest
import torch

from flashqla_kernels import patching
from flashqla_kernels.patching import (
    families, gdn_layers_patched, op, patch_gdn_layers, patched_gdn_layers, registry, unpatch_gdn_layers,
)
from tests.factories import tiny_model


@pytest.fixture(autouse=True)
def _always_unpatched():
    patching.unpatch_transformers()
    yield
    patching.unpatch_transformers()


def gdn_backend():
    """The backend the Qwen3.5 GDN class's forward runs (ABSENT: transformers' own forward)."""
    return registry.backend_of(family_class("qwen3_5", "gdn").forward)


def family_class(name: str, role: str):
    family = next(f for f in families.FAMILIES if f.name == name)
    return getattr(family.module(), family.class_name(role))


def patched_state() -> dict:
    """Every attribute a patch may replace (the op globals of each modeling module, ``forward`` of each role's class)
    mapped to the object it holds now (None: the owner holds nothing of its own)."""
    state = {}
    for family, module in families.modules():
        for attr in op.GLOBALS:
            state[(family.name, attr)] = vars(module).get(attr)
        for role in families.ROLES:
            cls = getattr(module, family.class_name(role), None)
            if cls is not None:
                state[(family.name, role)] = vars(cls).get("forward")
    return state


def _changed(before: dict, after: dict) -> list:
    return [key for key in before if before[key] is not after[key]]


def test_nested_context_restores_outer_backend():
    with patched_gdn_layers(backend="torch"):
        with patched_gdn_layers(backend=None):
            assert gdn_backend() is None
        assert gdn_backend() == "torch"
    assert not gdn_layers_patched()


def test_patch_transformers_fused_layer_composes_with_the_op_patch():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    original_forward = m.Qwen3_5GatedDeltaNet.__dict__["forward"]
    original_chunk = m.torch_chunk_gated_delta_rule
    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (1, 70))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        try:
            with patching.patched_transformers(backend="torch"):
                with patching.patched_transformers(backend="torch", fused_layer=True) as targets:
                    assert any(t.endswith("GatedDeltaNet.forward") for t in targets)
                    got = model(ids, use_cache=False).logits
                # the outer op-only patch is back, the layer forward is transformers' again
                assert m.torch_chunk_gated_delta_rule is not original_chunk
                assert m.Qwen3_5GatedDeltaNet.__dict__["forward"] is original_forward
            assert m.torch_chunk_gated_delta_rule is original_chunk
            patching.patch_transformers(fused_layer=True)
            assert patching.is_patched() and gdn_layers_patched()
            restored = patching.unpatch_transformers()
            assert any(t.endswith("Qwen3_5GatedDeltaNet.forward") for t in restored)
        finally:
            patching.unpatch_transformers()
    assert m.Qwen3_5GatedDeltaNet.__dict__["forward"] is original_forward and not patching.is_patched()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mlp_patch_restores_the_state_found_on_entry():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5MLP, Qwen3_5RMSNorm

    originals = [c.__dict__["forward"] for c in (Qwen3_5GatedDeltaNet, Qwen3_5MLP, Qwen3_5RMSNorm)]
    patch_gdn_layers(backend="torch", mlp=False)
    outer = Qwen3_5GatedDeltaNet.__dict__["forward"]
    with patched_gdn_layers():
        assert Qwen3_5MLP.__dict__["forward"] is not originals[1]
    assert Qwen3_5MLP.__dict__["forward"] is originals[1], "mlp=False state not restored"
    assert registry.backend_of(Qwen3_5GatedDeltaNet.forward) == "torch" and outer is not originals[0]
    assert Qwen3_5RMSNorm.__dict__["forward"] is not originals[2]
    patch_gdn_layers()  # idempotent: the originals saved first stay saved
    patch_gdn_layers()
    restored = unpatch_gdn_layers()
    assert "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5MLP.forward" in restored
    assert [c.__dict__["forward"] for c in (Qwen3_5GatedDeltaNet, Qwen3_5MLP, Qwen3_5RMSNorm)] == originals


def test_decoder_false_survives_a_nested_fused_patch():
    """The inner ``patched_transformers(fused_layer=True)`` patches the decoder layers too; on its exit the outer
    ``decoder=False`` state is back: the decoder classes on transformers' forward, the rest as the outer patch left
    them (the same replacement objects)."""
    decoder_cls = family_class("qwen3_5", "decoder")
    original = vars(decoder_cls)["forward"]
    with patched_gdn_layers(decoder=False):
        outer = patched_state()
        assert vars(decoder_cls)["forward"] is original
        with patching.patched_transformers(fused_layer=True):
            assert vars(decoder_cls)["forward"] is not original
        assert vars(decoder_cls)["forward"] is original, "decoder=False state not restored"
        assert not _changed(outer, patched_state())
        assert gdn_layers_patched() and not registry.swaps(op.GROUP)
    assert vars(decoder_cls)["forward"] is original and not patching.is_patched()


def _outer_states():
    """Ways a process may already be patched when a context manager is entered: a context manager (entered, left
    later) or a plain patch call (undone by the fixture)."""
    return {
        "unpatched": contextlib.nullcontext,
        "layers decoder=False": lambda: patched_gdn_layers(decoder=False),
        "layers without norms and mlp": lambda: patched_gdn_layers(backend="torch", rms_norms=False, mlp=False),
        "layers without attention": lambda: patched_gdn_layers(attention=False),
        "op": lambda: patching.patched_transformers(),
        "op torch + fused layer": lambda: patching.patched_transformers(backend="torch", fused_layer=True),
        "plain patch calls": _plain_patch_calls,
    }


@contextlib.contextmanager
def _plain_patch_calls():
    patch_gdn_layers(backend="torch", decoder=False, mlp=False)
    patching.patch_transformers(backend="tilelang")
    yield


_INNER = {
    "transformers fused": lambda: patching.patched_transformers(fused_layer=True),
    "transformers op torch": lambda: patching.patched_transformers(backend="torch"),
    "layers": lambda: patched_gdn_layers(),
    "layers decoder=False mlp=False": lambda: patched_gdn_layers(backend="torch", decoder=False, mlp=False),
    "layers torch no norms": lambda: patched_gdn_layers(backend="torch", rms_norms=False),
}


@pytest.mark.parametrize("outer,inner", list(itertools.product(_outer_states(), _INNER)))
def test_nested_context_managers_restore_every_patched_attribute(outer, inner):
    pristine = patched_state()
    with _outer_states()[outer]():
        before = patched_state()
        records = registry.swaps()
        with _INNER[inner]():
            during = patched_state()
            # the same context manager once more inside, left by an exception
            with pytest.raises(RuntimeError, match="body failed"), _INNER[inner]():
                raise RuntimeError("body failed")
            assert not _changed(during, patched_state())
        assert not _changed(before, patched_state()), f"{outer} / {inner}: {_changed(before, patched_state())}"
        assert registry.swaps() == records
    if outer != "plain patch calls":
        assert not _changed(pristine, patched_state()) and not patching.is_patched()
    patching.unpatch_transformers()
    assert not _changed(pristine, patched_state())


def test_registry_restores_newest_first_and_keeps_the_first_original():
    owner = types.SimpleNamespace(f="original")
    seen = []

    class Spy(types.SimpleNamespace):
        def __setattr__(self, name, value):
            seen.append((name, value))
            super().__setattr__(name, value)

    spy = Spy(a=1, b=2)
    registry.swap(owner, "f", "first", group="test", target="owner.f")
    registry.swap(owner, "f", "second", group="test", target="owner.f")  # re-pointed: the original stays saved
    registry.swap(spy, "a", 10, group="test", target="spy.a")
    registry.swap(spy, "b", 20, group="other", target="spy.b")
    assert registry.original(owner, "f") == "original" and owner.f == "second"
    assert [s.target for s in registry.swaps("test")] == ["owner.f", "spy.a"]
    seen.clear()
    assert registry.restore() == ["spy.b", "spy.a", "owner.f"]
    assert seen == [("b", 2), ("a", 1)] and owner.f == "original" and registry.swaps() == []


def test_registry_deletes_an_attribute_the_owner_did_not_hold_itself():
    class Base:
        def forward(self):
            return "base"

    class Child(Base):
        pass

    registry.swap(Child, "forward", lambda self: "ours", group="test", target="Child.forward")
    assert Child().forward() == "ours" and registry.swaps()[0].original is registry.ABSENT
    saved = registry.snapshot()
    registry.restore()
    assert "forward" not in vars(Child) and Child().forward() == "base"
    registry.restore_snapshot(saved)
    assert Child().forward() == "ours"
    registry.restore()
    assert Child().forward() == "base"
