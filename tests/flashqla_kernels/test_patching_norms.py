"""The RMSNorm patch (``flashqla_kernels.patching.norms``): opt-out, restorable, and off Hopper transformers' forward
exactly."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.patching import patched_gdn_layers, unpatch_gdn_layers
from tests.factories import tiny_model
from tests.flashqla_kernels.test_decoder_gdn_layer import family_module

@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    unpatch_gdn_layers()


@pytest.mark.parametrize("family,cls_name", [("qwen3_5", "Qwen3_5RMSNorm"), ("qwen3_next", "Qwen3NextRMSNorm"),
                                             ("qwen3_5_moe", "Qwen3_5MoeRMSNorm")])
def test_rms_norm_patch_is_opt_out_restorable_and_exact_off_hopper(family, cls_name):
    cls = getattr(family_module(family), cls_name)
    original = cls.__dict__["forward"]
    model = tiny_model(family)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        with patched_gdn_layers(backend="torch", rms_norms=False):
            assert cls.__dict__["forward"] is original
        with patched_gdn_layers(backend="torch") as targets:
            assert f"{cls.__module__}.{cls_name}.forward" in targets
            assert cls.__dict__["forward"] is not original
            got = model(ids, use_cache=False).logits
    assert cls.__dict__["forward"] is original
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
