"""parse_positions normalises every accepted spelling of a token selection and refuses what it would have to guess."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hooks import parse_positions


def test_positions_accept_numpy_integers_and_refuse_floats_instead_of_truncating():
    assert parse_positions(np.int64(3)) == (3,)  # e.g. a position from np.argmax
    assert parse_positions([np.int32(4), -1]) == (-1, 4)
    assert parse_positions(np.array([5, 2])) == (2, 5)
    for bad in ([1.5], 2.0, torch.tensor([1.0, 2.0])):
        with pytest.raises(TypeError, match="positions must be"):
            parse_positions(bad)
