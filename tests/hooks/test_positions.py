"""parse_positions normalises every accepted spelling of a token selection and refuses what it would have to guess."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hooks import Positions, parse_positions, position_mask


def test_positions_accept_numpy_integers_and_refuse_floats_instead_of_truncating():
    assert parse_positions(np.int64(3)) == Positions(((3, 3),))  # e.g. a position from np.argmax
    assert parse_positions([np.int32(4), -1]) == Positions(((4, 4),), (-1,))
    assert parse_positions(np.array([5, 2])) == Positions(((2, 2), (5, 5)))
    for bad in ([1.5], 2.0, torch.tensor([1.0, 2.0])):
        with pytest.raises(TypeError, match="positions must be"):
            parse_positions(bad)


def test_specs_are_kept_as_merged_ranges_and_masks_match_the_expanded_set():
    spec = parse_positions("7-9,0,2,3-4,5,-2,-1")
    assert spec == Positions(((0, 0), (2, 5), (7, 9)), (-2, -1))
    where = torch.arange(12)
    expected = torch.tensor([p in {0, 2, 3, 4, 5, 7, 8, 9, 10, 11} for p in range(12)])
    assert torch.equal(position_mask(spec, where), expected)
    # Decode steps see one token at a large absolute position: -1 keeps it, the ranges do not reach it.
    assert position_mask(spec, torch.tensor([40])).tolist() == [True]
    assert position_mask(parse_positions("0-3"), torch.tensor([40])).tolist() == [False]


def test_huge_ranges_stay_bounded_and_absurd_positions_are_refused():
    spec = parse_positions("0-99999999999")
    assert spec.ranges == ((0, 99999999999),)
    assert position_mask(spec, torch.arange(5) + 10**10).all()
    assert parse_positions(torch.arange(10**5)).ranges == ((0, 10**5 - 1),)
    with pytest.raises(ValueError, match=r"beyond any sequence"):
        parse_positions("0-" + "9" * 30)
    with pytest.raises(ValueError, match=r"bad position range '5-2'"):
        parse_positions("5-2")
