"""The whole Gated DeltaNet layer on fused stages: token-major conv + SiLU + split + l2norm + gates, our chunk op,
gated RMSNorm; a restorable patch of transformers' Qwen3-Next / Qwen3.5 / Qwen3.5-MoE GDN layer forward (and of
their zero-centred RMSNorms, dense SiLU MLPs and gated attention layers' q/k preparation and gate).

Importing this package touches neither CUDA nor tilelang, and patches nothing.

Example:
    >>> from flashqla_kernels.gdn_layer import patched_gdn_layers
    >>> with patched_gdn_layers():
    ...     logits = model(ids, use_cache=False).logits
"""
from flashqla_kernels.gdn_layer.layer import explain_gdn_layer, gdn_layer_forward, layer_unsupported_reason
from flashqla_kernels.gdn_layer.ops import (
    conv_qkv_gates, gate_mul, gate_mul_head_major, gated_norm, glue_kernel_reason, qk_norm_rope, rms_norm, silu_mul,
)
from flashqla_kernels.gdn_layer.patch import (
    attention_fallback_reason, gdn_layers_patched, patch_gdn_layers, patched_gdn_layers, unpatch_gdn_layers,
)

__all__ = [
    "gdn_layer_forward", "layer_unsupported_reason", "explain_gdn_layer",
    "conv_qkv_gates", "gated_norm", "rms_norm", "silu_mul", "qk_norm_rope", "gate_mul",
    "gate_mul_head_major", "glue_kernel_reason",
    "patch_gdn_layers", "unpatch_gdn_layers", "patched_gdn_layers", "gdn_layers_patched", "attention_fallback_reason",
]
