"""Steering buffers apply exactly the edits ``qwen_scope.steering`` defines, bit for bit, per row of a batch."""
from __future__ import annotations

import pytest
import torch

from hooks import InterventionContext
from qwen_scope.engine.steer_buffers import build_steer_buffers, structure_of
from qwen_scope.steering import _LayerSteer, ablate, add, clamp
from tests.qwen_scope.scope_helpers import tiny_sae

KINDS = {
    "raw": lambda pos: add(1, 11, 7.5, positions=pos),
    "unit": lambda pos: add(1, 4, -3.0, scale="unit", positions=pos),
    "norm": lambda pos: add(1, 9, 0.4, scale="norm", positions=pos),
    "clamp": lambda pos: clamp(1, 17, 6.0, positions=pos),
    "ablate": lambda pos: ablate(1, 23, positions=pos),
}
POSITIONS = ("all", "prompt", "generated", "1,4-6,generated")


def _reference(sae, edits, h, positions, prompt_length):
    ctx = InterventionContext("resid_post.1", 1, 0, int(positions[0]), positions)
    return _LayerSteer(sae, edits, prompt_length)(h, ctx)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("where", POSITIONS)
def test_each_edit_kind_at_each_position_kind_is_the_reference_bit_for_bit(kind, where):
    sae = tiny_sae(seed=1)
    g = torch.Generator().manual_seed(3)
    h = 3 * torch.randn(1, 9, sae.d_model, generator=g)
    edits = [KINDS[kind](where)]
    P, S = 5, 12
    bufs = build_steer_buffers([edits], {1: sae}, [P], S, sae.d_model, torch.device("cpu"))
    # a prefill pass (positions 0..8) and a decode pass (one token at position 9)
    got = bufs[1].apply(h, torch.arange(9)[None])
    assert torch.equal(got, _reference(sae, edits, h, torch.arange(9), P))
    one = h[:, -1:]
    assert torch.equal(bufs[1].apply(one, torch.tensor([[9]])), _reference(sae, edits, one, torch.tensor([9]), P))


def test_rows_with_different_edits_and_prompt_lengths_each_get_their_own_reference():
    sae = tiny_sae(seed=1)
    h = torch.randn(3, 1, sae.d_model, generator=torch.Generator().manual_seed(5))
    rows = [[add(1, 11, 7.5), clamp(1, 17, 6.0, positions="generated")], [], [add(1, 4, 0.3, scale="norm")]]
    lengths, pos = [4, 6, 2], torch.tensor([[5], [6], [3]])
    bufs = build_steer_buffers(rows, {1: sae}, lengths, 10, sae.d_model, torch.device("cpu"))
    got = bufs[1].apply(h, pos)
    for b, edits in enumerate(rows):
        want = _reference(sae, edits, h[b:b + 1], pos[b], lengths[b]) if edits else h[b:b + 1]
        assert torch.equal(got[b:b + 1], want)


def test_a_new_strength_is_a_buffer_write_and_equals_rebuilt_buffers():
    sae = tiny_sae(seed=2)
    h = torch.randn(1, 1, sae.d_model)
    bufs = build_steer_buffers([[add(1, 11, 7.5)]], {1: sae}, [3], 8, sae.d_model, torch.device("cpu"))
    before = bufs[1].values.data_ptr()
    bufs[1].set_value(0, 0, -20.0)
    assert bufs[1].values.data_ptr() == before
    rebuilt = build_steer_buffers([[add(1, 11, -20.0)]], {1: sae}, [3], 8, sae.d_model, torch.device("cpu"))
    assert torch.equal(bufs[1].apply(h, torch.tensor([[4]])), rebuilt[1].apply(h, torch.tensor([[4]])))
    assert structure_of([[add(1, 11, 7.5)]]) == structure_of([[add(1, 3, -1.0, positions="prompt")]])
    assert structure_of([[add(1, 11, 7.5)]]) != structure_of([[clamp(1, 11, 7.5)]])


def test_an_edit_at_a_layer_without_an_sae_is_refused():
    with pytest.raises(KeyError, match=r"no SAE at layer 1.*layers \[2\]"):
        build_steer_buffers([[add(1, 0, 1.0)]], {2: tiny_sae()}, [3], 8, 64, torch.device("cpu"))
