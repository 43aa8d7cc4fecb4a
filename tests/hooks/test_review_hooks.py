"""Defects found in review of hooks/: each test failed before its fix."""
from __future__ import annotations

import pytest
import torch

from hooks import capture, collect
from tests.factories import tiny_model


def test_collect_accepts_use_cache_among_the_forward_kwargs():
    # Callers forward their usual model kwargs; collect forces use_cache=False and must not raise
    # "got multiple values for keyword argument 'use_cache'".
    model = tiny_model("qwen3")
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture(model, ["resid_post.1"]) as ref:
        model(input_ids=ids, use_cache=False)
    for use_cache in (False, True):
        cap = collect(model, ["resid_post.1"], input_ids=ids, use_cache=use_cache)
        assert torch.equal(cap["resid_post.1"], ref["resid_post.1"])
    assert not model.model.layers[1]._forward_hooks and not model.model._forward_pre_hooks


def test_capture_accessors_name_the_recorded_points_for_a_missing_one():
    model = tiny_model("qwen3")
    with capture(model, ["resid_post.1"]) as cap:
        pass  # the model never ran
    assert cap.calls("resid_post.1") == []
    # positions() used to die in torch.cat with "expected a non-empty list of Tensors".
    with pytest.raises(KeyError, match=r"nothing captured at resid_post.1"):
        cap.positions("resid_post.1")
    for accessor in (cap.calls, cap.positions, cap.__getitem__):
        with pytest.raises(KeyError, match=r"nothing captured at resid_post.2.*\['resid_post.1'\]"):
            accessor("blocks.2.hook_resid_post")


def test_positions_accept_numpy_integers_and_refuse_floats_instead_of_truncating():
    import numpy as np

    from hooks import parse_positions

    assert parse_positions(np.int64(3)) == (3,)  # e.g. a position from np.argmax
    assert parse_positions([np.int32(4), -1]) == (-1, 4)
    assert parse_positions(np.array([5, 2])) == (2, 5)
    for bad in ([1.5], 2.0, torch.tensor([1.0, 2.0])):
        with pytest.raises(TypeError, match="positions must be"):
            parse_positions(bad)
