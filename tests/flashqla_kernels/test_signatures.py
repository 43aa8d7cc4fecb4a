"""One signature for the op: reference, torch path, public function, Hopper launcher and transformers' fallbacks."""
from __future__ import annotations

import importlib
import inspect

import pytest

import flashqla_kernels
from flashqla_kernels.gated_delta_rule import reference, torch_path

FLA_PARAMS = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
              "cu_seqlens"]
FLA_DEFAULTS = {"scale": None, "initial_state": None, "output_final_state": False,
                "use_qk_l2norm_in_kernel": False, "cu_seqlens": None}


def _params(fn):
    return inspect.signature(fn).parameters


@pytest.mark.parametrize("fn", [
    reference.recurrent_gated_delta_rule_ref, reference.chunk_gated_delta_rule_ref,
    torch_path.chunk_gated_delta_rule_torch, torch_path.recurrent_gated_delta_rule_torch,
], ids=lambda f: f.__name__)
def test_reference_and_torch_path_share_the_fla_signature(fn):
    params = _params(fn)
    assert list(params) == FLA_PARAMS
    assert {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty} == FLA_DEFAULTS


@pytest.mark.parametrize("fn", [flashqla_kernels.chunk_gated_delta_rule, flashqla_kernels.recurrent_gated_delta_rule,
                                flashqla_kernels.explain_backend], ids=lambda f: f.__name__)
def test_public_functions_add_only_keyword_only_options(fn):
    params = _params(fn)
    assert list(params)[:len(FLA_PARAMS)] == FLA_PARAMS
    extra = list(params.values())[len(FLA_PARAMS):]
    assert extra and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)
    assert params["backend"].default is None
    ref = _params(reference.chunk_gated_delta_rule_ref)
    assert all(params[n].default == ref[n].default for n in FLA_PARAMS)


def test_hopper_launcher_takes_the_op_arguments_and_only_keyword_only_options():
    from flashqla_kernels.gated_delta_rule.hopper import forward

    params = _params(forward.chunk_gated_delta_rule_fwd)
    assert list(params)[:5] == FLA_PARAMS[:5]
    ref = _params(reference.chunk_gated_delta_rule_ref)
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY and params[n].default == ref[n].default
               for n in FLA_PARAMS[5:])
    # the internal options tests and benchmarks force, the custom op's saving of the states and the dispatcher's
    # skipping of checks it has run, off by default
    assert {n: p.default for n, p in params.items() if n not in FLA_PARAMS} == {
        "segment_chunks": None, "block_v": None, "save_states": False, "checked": False}
    assert list(_params(forward.unsupported_reason)) == ["q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_patch_replacements_are_call_compatible_with_transformers_fallbacks(family):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    originals = [getattr(mod, n) for n in names]
    with flashqla_kernels.patched_transformers():
        replacements = [getattr(mod, n) for n in names]
    assert all(ours is not theirs for ours, theirs in zip(replacements, originals))
    for ours, theirs in zip(replacements, originals):
        theirs = getattr(theirs, "__wrapped__", theirs)
        positional = [n for n, p in _params(theirs).items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert list(_params(ours))[:len(positional)] == positional
        assert any(p.kind is p.VAR_KEYWORD for p in _params(ours).values())
