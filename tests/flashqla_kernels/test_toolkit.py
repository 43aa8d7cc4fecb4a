"""flashqla_kernels.toolkit: kernel outputs poisoned on request, and the kept arguments no kernel reads."""
from __future__ import annotations

import torch

from flashqla_kernels import toolkit


def test_outputs_are_nan_or_minus_one_only_inside_poisoned_outputs():
    with toolkit.poisoned_outputs():
        assert torch.isnan(toolkit.empty((2, 3), torch.float32, "cpu")).all()
        assert (toolkit.empty_like(torch.zeros(4, dtype=torch.int32)) == -1).all()
        with toolkit.poisoned_outputs():
            pass
        assert torch.isnan(toolkit.empty((1,), torch.bfloat16, "cpu")).all()  # the nested exit restored "on"
    assert toolkit.empty((2,), torch.float32, "cpu").shape == (2,)


def test_unread_arguments_are_one_kept_tensor_per_shape_dtype_and_device():
    a = toolkit.unread((1, 4, 2), torch.float32, torch.device("cpu"))
    assert a is toolkit.unread((1, 4, 2), torch.float32, torch.device("cpu"))
    assert a is not toolkit.unread((1, 4, 2), torch.bfloat16, torch.device("cpu"))
    assert a.shape == (1, 4, 2) and a.dtype == torch.float32
