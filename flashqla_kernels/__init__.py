"""The Gated DeltaNet op: float64 reference, fused TileLang Hopper kernels, FLA/FlashQLA-compatible API; the fused
Qwen3.5 / Qwen3-Next decoder pieces (``decoder``) and the restorable transformers patches (``patching``).

Importing this package touches neither CUDA nor tilelang, and patches nothing: call ``patch_transformers()``.

Example:
    >>> from flashqla_kernels import chunk_gated_delta_rule, patched_transformers
    >>> o, state = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
    >>> with patched_transformers():
    ...     out = model.generate(ids)
    >>> with patched_transformers(fused_layer=True):   # the whole GDN layer on the fused path
    ...     logits = model(ids, use_cache=False).logits
"""
from flashqla_kernels.decoder import gdn_layer_forward
from flashqla_kernels.gated_delta_rule import (
    chunk_gated_delta_rule, chunk_gated_delta_rule_ref, explain_backend, recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_ref,
)
from flashqla_kernels.patching import (
    is_patched, patch_gdn_layers, patch_transformers, patched_gdn_layers, patched_transformers, unpatch_gdn_layers,
    unpatch_transformers,
)

__all__ = [
    "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "explain_backend",
    "chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref",
    "patch_transformers", "unpatch_transformers", "patched_transformers", "is_patched",
    "gdn_layer_forward", "patch_gdn_layers", "unpatch_gdn_layers", "patched_gdn_layers",
]
