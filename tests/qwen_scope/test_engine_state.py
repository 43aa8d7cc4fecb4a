"""The engine's state is sized before it is allocated, and a batch that cannot fit is refused naming one that can."""
from __future__ import annotations

import pytest
import torch

from hooks import get_adapter
from qwen_scope.engine.state import DecodeState, EngineMemoryError, StateLayout, check_fits
from tests.factories import tiny_model


def _layout(B, keep_logits=False):
    return StateLayout.of(get_adapter(tiny_model("qwen3_5")), B, 20, 8, top_n=5, readout_k={1: 4}, keep_logits=keep_logits)


def test_layout_covers_every_layer_and_the_allocated_buffers():
    layout = _layout(3, keep_logits=True)
    assert sorted(layout.attention) == [1, 3] and sorted(layout.gdn) == [0, 2]
    assert layout.attention[1] == (2, 16) and layout.gdn[0] == (2 * 32 + 64, 4, 4, 16, 16)
    state = DecodeState(layout, torch.device("cpu"), pad_id=0, stop_ids=[0])
    assert state.k_cache[1].shape == (3, 2, 20, 16) and state.recurrent[2].dtype == torch.float32
    assert state.logits.shape == (3, 9, 256) and state.readout_indices[1].shape == (3, 8, 4)
    # the estimate holds every buffer and adds the step's working set
    assert 0 < state.nbytes() <= layout.nbytes()
    assert layout.nbytes() == 3 * layout.per_row_bytes()


def test_a_batch_too_big_for_free_gpu_memory_is_refused_naming_the_batch_that_fits(monkeypatch):
    layout = _layout(64)
    per_row = layout.per_row_bytes()
    free = int(10.5 * per_row / 0.9)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    with pytest.raises(EngineMemoryError, match=r"batch 64 needs .* GiB free .*; batch 10 fits"):
        check_fits(layout, torch.device("cuda"))
    check_fits(_layout(10), torch.device("cuda"))
    check_fits(layout, torch.device("cpu"))
