"""Scope ties a model, a tokenizer and SAEs together and refuses or warns about ones that do not fit."""
from __future__ import annotations

import warnings

import pytest
import torch

from qwen_scope.scope import Scope
from saes import TopKSAE, get_release
from tests.factories import FAMILIES, random_sae_state, tiny_model, tiny_tokenizer, write_sae_release
from tests.qwen_scope.scope_helpers import tiny_sae, tiny_scope


@pytest.mark.parametrize("family", FAMILIES)
def test_scope_wraps_every_family(family):
    scope = tiny_scope(family, layers=(0, 3))
    assert scope.layers == [0, 3]
    assert scope.adapter.family == family
    assert scope.hook_name(3) == "resid_post.3"
    assert scope.tokenize("ab").tolist() == [[97, 98]]


def test_d_model_mismatch_is_refused_with_both_sizes():
    wide = TopKSAE.from_release_state(random_sae_state(d_model=128), k=8)
    with pytest.raises(ValueError, match="expects d_model 128.*hidden size 64"):
        Scope(tiny_model("qwen3_5"), tiny_tokenizer(), {1: wide})


def test_layer_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"layer must be an int in 0..3"):
        Scope(tiny_model("qwen3_5"), tiny_tokenizer(), {4: tiny_sae()})


def test_release_of_another_width_is_refused():
    with pytest.raises(ValueError, match="d_model 2048.*hidden size 64"):
        Scope(tiny_model("qwen3_5"), tiny_tokenizer(), release="qwen-scope-3.5-2b-base-w32k-l50")


@pytest.mark.parametrize("model_name, warns", [
    ("Qwen/Qwen3.5-Nano", True),          # instruct model, base-trained SAEs
    ("Qwen/Qwen3.5-Nano-Base", False),    # matches
    ("/tmp/some-local-dir", False),       # unknown: no claim
])
def test_base_vs_instruct_mismatch_warns(tmp_path, model_name, warns):
    release_dir = write_sae_release(tmp_path, n_layers=4)
    scope = Scope(tiny_model("qwen3_5"), tiny_tokenizer(), model_name=model_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope.load_saes(release_dir, [1])
    messages = [str(w.message) for w in caught if "trained on the base model" in str(w.message)]
    assert bool(messages) == warns
    if warns:
        assert "Qwen/Qwen3.5-Nano-Base" in messages[0] and "instruct" in messages[0]
    assert scope.sae(1).k == 8 and scope.release.trained_on == "base"


def test_from_pretrained_loads_a_local_model_and_release(tmp_path):
    model_dir = tmp_path / "tiny-qwen"
    tiny_model("qwen3_5").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    release_dir = write_sae_release(tmp_path, n_layers=4)
    scope = Scope.from_pretrained(model_dir, release_dir, layers=[0, 2])
    assert scope.layers == [0, 2]
    expected = random_sae_state(seed=2)["W_dec"]
    assert torch.equal(scope.sae(2).W_dec, expected)
    assert scope.release == get_release("SAE-Res-Qwen3.5-Nano-Base-W0K-L0_8")
    with pytest.raises(KeyError, match=r"loaded layers are \[0, 2\]"):
        scope.sae(1)


def test_missing_layer_past_the_last_block_is_not_told_to_load_it():
    scope = tiny_scope(layers=(1,))
    n = scope.adapter.n_layers
    with pytest.raises(KeyError, match=rf"no SAE at layer {n}; loaded layers are \[1\]\. .*blocks 0\.\.{n - 1} only"):
        scope.sae(n)
    with pytest.raises(KeyError, match=r"no SAE at layer 0.*load_saes\(release, \[0\]\)"):
        scope.sae(0)
