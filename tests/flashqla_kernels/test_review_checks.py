"""Review of flashqla_kernels input checks: type errors say what they got, not only what they wanted."""
from __future__ import annotations

import re

import pytest
import torch

from flashqla_kernels.gated_delta_rule.api import chunk_gated_delta_rule


def _inputs(T: int = 6):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, 1, 4, generator=g) for _ in range(2))
    v = torch.randn(1, T, 2, 4, generator=g)
    return q, k, v, -torch.rand(1, T, 2, generator=g), torch.rand(1, T, 2, generator=g)


@pytest.mark.parametrize("state, got", [
    (torch.zeros(1, 2, 4, 4, dtype=torch.int64), "got a torch.int64 tensor [1,2,4,4]"),
    ([[0.0]], "got a list"),
])
def test_bad_initial_state_type_names_what_was_passed(state, got):
    with pytest.raises(TypeError, match=r"initial_state must be a floating-point tensor .*" + re.escape(got)):
        chunk_gated_delta_rule(*_inputs(), initial_state=state)


@pytest.mark.parametrize("cu, got", [(torch.tensor([0.0, 6.0]), "got a torch.float32 tensor [2]"),
                                     ([0, 6], "got a list"),
                                     (torch.tensor([[0, 6]]), "got a torch.int64 tensor [1,2]")])
def test_bad_cu_seqlens_type_names_what_was_passed(cu, got):
    with pytest.raises(TypeError, match=r"cu_seqlens must be a 1-D integer tensor.*" + re.escape(got)):
        chunk_gated_delta_rule(*_inputs(), cu_seqlens=cu)
