"""The fused pieces of the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next decoder: the whole Gated DeltaNet layer on fused stages
(token-major conv + SiLU + split + l2norm + gates, our chunk op, gated RMSNorm) and the glue around it (the
zero-centred RMSNorms, the residual add before the post-attention norm, the dense MLP's SwiGLU, the gated attention
layers' q/k preparation and gate), each with its torch formulation and its TileLang kernel; and the GDN layer's
decode step on two fused kernels against caller-owned state (``gdn_decode_step``, the decode engine's).

This package computes; ``flashqla_kernels.patching`` puts it into transformers' classes. Importing it touches neither
CUDA nor tilelang, and patches nothing.

Example:
    >>> from flashqla_kernels.decoder import gdn_layer_forward
    >>> out = gdn_layer_forward(model.model.layers[0].linear_attn, h)
"""
from flashqla_kernels.decoder.decode import decode_step_reason, gdn_decode_step
from flashqla_kernels.decoder.gdn_layer import (
    cached_states, explain_gdn_layer, gdn_layer_forward, hooked, layer_unsupported_reason, plain_linear_reason,
)
from flashqla_kernels.decoder.ops import (
    add_rms_norm, conv_qkv_gates, gate_mul, gate_mul_head_major, gated_norm, glue_kernel_reason, qk_norm_rope,
    rms_norm, silu_mul, swiglu,
)

__all__ = [
    "gdn_layer_forward", "layer_unsupported_reason", "explain_gdn_layer", "hooked", "plain_linear_reason",
    "conv_qkv_gates", "gated_norm", "rms_norm", "add_rms_norm", "silu_mul", "swiglu", "qk_norm_rope", "gate_mul",
    "gate_mul_head_major", "glue_kernel_reason", "gdn_decode_step", "decode_step_reason", "cached_states",
]
