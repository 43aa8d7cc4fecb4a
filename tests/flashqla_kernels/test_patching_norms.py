"""The RMSNorm patch (``flashqla_kernels.patching.norms``): opt-out, restorable, off Hopper transformers' forward
exactly, and under autocast the decoder and final norms' output in autocast's dtype."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.decoder import ops
from flashqla_kernels.patching import norms as norms_patch
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


class _NormOpsOnHopper:
    """``ops`` as the RMSNorm patch sees it on an H200 (the device check passed); ``rms_norm`` itself dispatches on
    the real device, so on CPU it runs the torch formulation with the patch's arguments."""

    def __getattr__(self, name):
        return getattr(ops, name)

    @staticmethod
    def glue_kernel_reason(*tensors, **kwargs):
        return None


def test_under_autocast_the_patched_norms_write_autocasts_dtype_and_the_logits_stay_bit_for_bit(monkeypatch):
    """fp32 weights under bf16 autocast: the decoder and final norms take the fp32 residual stream and write bf16,
    which their projections would have cast it to (the logits equal the unpatched norms' bit for bit); the q/k norms
    read q_proj / k_proj's bf16 output and write bf16, as transformers' do."""
    model = tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (2, 9))
    inner = model.model
    watched = {"input_layernorm": inner.layers[0].input_layernorm,
               "post_attention_layernorm": inner.layers[0].post_attention_layernorm, "norm": inner.norm}
    attn = next(layer.self_attn for layer in inner.layers if hasattr(layer, "self_attn"))
    watched.update(q_norm=attn.q_norm, k_norm=attn.k_norm)

    def run(rms_norms: bool):
        seen = {}
        handles = [m.register_forward_hook(lambda m_, a, o, n=n: seen.setdefault(n, o.dtype) and None)
                   for n, m in watched.items()]
        try:
            # the decoder patch off: the post-attention norm is the module's call, which the RMSNorm patch serves
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), patched_gdn_layers(
                    backend=None, rms_norms=rms_norms, mlp=False, attention=False, decoder=False):
                logits = model(ids, use_cache=False).logits
        finally:
            for h in handles:
                h.remove()
        return logits, seen

    want, theirs = run(False)
    monkeypatch.setattr(norms_patch, "ops", _NormOpsOnHopper())
    got, ours = run(True)
    f32, bf = torch.float32, torch.bfloat16
    assert theirs == {"input_layernorm": f32, "post_attention_layernorm": f32, "norm": f32, "q_norm": bf,
                      "k_norm": bf}
    assert ours == dict.fromkeys(watched, bf)
    assert torch.equal(got, want)
