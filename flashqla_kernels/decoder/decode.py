"""The Gated DeltaNet layer's decode step (one token per row) on two fused kernels, against caller-owned state.

    out = gdn_decode_step(layer, x, conv_state, recurrent_state)     # states updated in place

After the layer's input projections (the module's own ``nn.Linear`` weights, as ``gdn_layer.project`` reads them):

1. ``conv_gates`` with ``update_prefix``: the conv state shifted in place by the new token, the causal conv + SiLU,
   the q / k l2norm and the gates ``g``, ``beta``, one pass over the token's channels;
2. ``recurrent`` with the gated norm: the delta-rule update of the fp32 state in place (read once, written once)
   and the output through the gated RMSNorm of ``layer.norm``;

then ``out_proj``. The state layout is the decode engine's: conv state token-major [B, Kc-1, C] in the model dtype
(the last Kc - 1 conv inputs, oldest first), recurrent state [B, Hv, K, V] fp32. Nothing reads a device value on
the host and every shape is fixed, so a caller can capture the step in a CUDA graph. ``decode_step_reason`` says
when the kernels cannot take a layer or its activations (the caller then runs its torch formulation).
"""
from __future__ import annotations

import torch

from flashqla_kernels.decoder import hopper
from flashqla_kernels.decoder.gdn_layer import hooked, layer_unsupported_reason, project
from flashqla_kernels.decoder.ops import glue_kernel_reason

__all__ = ["gdn_decode_step", "decode_step_reason"]


def decode_step_reason(layer: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Why ``gdn_decode_step`` cannot run ``layer`` on x [B, 1, d_model], or None."""
    reason = layer_unsupported_reason(layer) or glue_kernel_reason(x)
    if reason:
        return reason
    if x.dim() != 3 or x.shape[1] != 1:
        return f"the decode step takes one token per row, x [B, 1, d_model]; got {tuple(x.shape)}"
    Hk, K, Hv, V = layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim
    reason = hopper.conv_shape_reason(Hk, K, Hv, V, layer.conv_kernel_size)
    if reason:
        return reason
    from flashqla_kernels.gated_delta_rule.hopper import recurrent

    reason = recurrent.shape_reason(K, V, gated_norm=True)
    if reason:
        return reason
    if hooked(layer.norm):
        return "layer.norm has hooks, which the fused norm would skip"
    return None


def gdn_decode_step(layer: torch.nn.Module, x: torch.Tensor, conv_state: torch.Tensor,
                    recurrent_state: torch.Tensor) -> torch.Tensor:
    """One decode step of a GDN layer on the kernels (check ``decode_step_reason`` first).

    Args:
        layer: a ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet`` / ``Qwen3NextGatedDeltaNet``.
        x: [B, 1, d_model] the input norm's output (bf16 / fp16).
        conv_state: [B, Kc-1, C] contiguous, x's dtype; updated in place.
        recurrent_state: [B, Hv, K, V] fp32 contiguous; updated in place.

    Returns:
        [B, 1, d_model]: the layer's output (after ``out_proj``).
    """
    from flashqla_kernels.decoder.hopper import conv_gates
    from flashqla_kernels.gated_delta_rule.hopper import recurrent

    B = x.shape[0]
    Hk, K, Hv, V = layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim
    qkv, z, b, a = project(layer, x)
    q, k, v, g, beta = conv_gates.conv_qkv_gates(qkv, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, a, b,
                                                 layer.A_log, layer.dt_bias, Hk=Hk, Hv=Hv, D=K, prefix=conv_state,
                                                 update_prefix=True)
    o, _ = recurrent.fused_recurrent(q, k, v, g, beta, K ** -0.5, initial_state=recurrent_state,
                                     final_state=recurrent_state, z=z.reshape(B, 1, Hv, V).contiguous(),
                                     norm_weight=layer.norm.weight, norm_eps=layer.norm.variance_epsilon)
    return layer.out_proj(o.reshape(B, 1, Hv * V))
