"""checks.py: the op's input validation, shared by the reference, the torch path and the public API. Errors name the
argument, what was expected and what was passed."""
from __future__ import annotations

import re

import pytest
import torch

from flashqla_kernels.gated_delta_rule.api import chunk_gated_delta_rule
from flashqla_kernels.gated_delta_rule.checks import check_inputs, host_offsets, resolve_scale, sequence_spans

# check_inputs itself and the public op, which must surface the same error
ENTRY_POINTS = [check_inputs, chunk_gated_delta_rule]


def _inputs(T: int = 6):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, 1, 4, generator=g) for _ in range(2))
    v = torch.randn(1, T, 2, 4, generator=g)
    return q, k, v, -torch.rand(1, T, 2, generator=g), torch.rand(1, T, 2, generator=g)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("state, got", [
    (torch.zeros(1, 2, 4, 4, dtype=torch.int64), "got a torch.int64 tensor [1,2,4,4]"),
    ([[0.0]], "got a list"),
])
def test_bad_initial_state_type_names_what_was_passed(entry, state, got):
    with pytest.raises(TypeError, match=r"initial_state must be a floating-point tensor .*" + re.escape(got)):
        entry(*_inputs(), initial_state=state)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("cu, got", [(torch.tensor([0.0, 6.0]), "got a torch.float32 tensor [2]"),
                                     ([0, 6], "got a list"),
                                     (torch.tensor([[0, 6]]), "got a torch.int64 tensor [1,2]")])
def test_bad_cu_seqlens_type_names_what_was_passed(entry, cu, got):
    with pytest.raises(TypeError, match=r"cu_seqlens must be a 1-D integer tensor.*" + re.escape(got)):
        entry(*_inputs(), cu_seqlens=cu)


def test_valid_inputs_return_the_number_of_sequences():
    q, k, v, g, beta = _inputs()
    assert check_inputs(q, k, v, g, beta) == 1
    assert check_inputs(q, k, v, g, beta, torch.zeros(3, 2, 4, 4), torch.tensor([0, 1, 1, 6])) == 3


def test_shape_errors_name_the_expected_and_the_actual_shape():
    q, k, v, g, beta = _inputs()
    with pytest.raises(ValueError, match=r"value heads Hv=3 must be a multiple of q/k heads Hk=2"):
        check_inputs(q.expand(1, 6, 2, 4), k.expand(1, 6, 2, 4), torch.zeros(1, 6, 3, 4), g[..., :1].expand(1, 6, 3),
                     beta[..., :1].expand(1, 6, 3))
    with pytest.raises(ValueError, match=r"initial_state must be \[N, Hv, K, V\] = \[1,2,4,4\] \(N = B\); "
                                         r"got \[2,2,4,4\]"):
        check_inputs(q, k, v, g, beta, torch.zeros(2, 2, 4, 4))
    with pytest.raises(ValueError, match=r"B must be 1; got B=2"):
        check_inputs(*(torch.cat([x, x]) for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at most at T=6"):
        check_inputs(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match=r"non-decreasing"):
        check_inputs(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 2, 6]))


def test_sequence_spans_and_scale():
    assert sequence_spans(2, 5, None) == [(0, 0, 5), (1, 0, 5)]
    assert sequence_spans(1, 6, torch.tensor([0, 1, 6])) == [(0, 0, 1), (0, 1, 6)]
    assert resolve_scale(None, 16) == 0.25 and resolve_scale(0.0, 16) == 0.0


def test_cu_seqlens_checks_are_kept_with_the_tensor_and_redone_after_an_in_place_edit():
    """The offsets and their order are read once per tensor version (no sync on the next call), and an in-place edit
    that breaks them is still refused."""
    q, k, v, g, beta = _inputs()
    cu = torch.tensor([0, 2, 6])
    assert check_inputs(q, k, v, g, beta, cu_seqlens=cu) == 2
    assert host_offsets(cu) == (0, 2, 6) and host_offsets(cu) is host_offsets(cu)
    cu[1] = 5
    assert check_inputs(q, k, v, g, beta, cu_seqlens=cu) == 2 and host_offsets(cu) == (0, 5, 6)
    cu[2] = 3
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing; got \[0, 5, 3\]"):
        check_inputs(q, k, v, g, beta, cu_seqlens=cu)
