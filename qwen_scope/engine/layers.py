"""One decoder layer's decode step (T = 1 per row) against the engine's static state, written from the HF modules.

Each function reads the weights of one transformers module and reproduces that module's math for one new token per
row, but against preallocated buffers: the attention layer writes its key and value at the row's own position of a
static KV cache and attends over the valid prefix through a mask built from device-side positions; the Gated DeltaNet
layer updates its conv state and recurrent state in place (on an sm_90 GPU in bf16 / fp16 through
``flashqla_kernels.decoder.gdn_decode_step``'s two fused kernels; elsewhere in torch). Norms, rotary tables, the dense
MLP and, on the torch path, the GDN gated norm are the HF modules' own calls (pure tensor ops), so their numerics are
the model's by construction. Nothing here reads a tensor value on the host, branches on data or changes a shape
between steps, so the whole step can be captured as one CUDA graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashqla_kernels import recurrent_gated_delta_rule
from flashqla_kernels.decoder import decode_step_reason, gdn_decode_step
from flashqla_kernels.decoder import ops as fused
from flashqla_kernels.patching import mlp as fused_mlp
from flashqla_kernels.patching.norms import is_zero_centred_norm, norm_eps

__all__ = ["rotate_half", "apply_rotary", "norm", "attention_decode", "gdn_decode", "mlp_decode", "is_moe_block",
           "unsupported_mlp_reason"]


def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an RMSNorm module; Qwen3.5 / Qwen3-Next's zero-centred ones on the fused norm op (one kernel
    on sm_90 where transformers' module launches about eight; elsewhere its torch form, bit for bit the module's)."""
    if is_zero_centred_norm(module):
        return fused.rms_norm(x, module.weight, norm_eps(module))
    return module(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` over the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first ``cos.shape[-1]`` dims of q [B, H, T, D] and k [B, Hkv, T, D] (cos, sin: [B, T, R]).

    The partial form of Qwen3.5 / Qwen3-Next; with R = D it is Qwen3's full rotation (the pass-through part is
    empty), element for element the same arithmetic.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    q_rot, q_pass = q[..., :rot], q[..., rot:]
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def attention_decode(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """Full attention for one new token per row, KV cache written in place.

    Args:
        attn: the HF attention module (``Qwen3Attention``, or the gated ``Qwen3_5Attention`` / ``Qwen3NextAttention``
            whose ``q_proj`` also yields the output gate).
        x: [B, 1, d_model] normed input.
        cos, sin: [B, 1, R] rotary tables at ``positions``.
        k_cache, v_cache: [B, Hkv, S, D] static cache; position p of row b is slot p.
        positions: [B] int64 device tensor, where this token sits in each row.
        valid: [B, 1, 1, S] bool, key slots each row may attend to (slots <= its position).

    Returns:
        [B, 1, d_model] the attention block's output (after ``o_proj``).
    """
    B = x.shape[0]
    D = attn.head_dim
    gated = attn.q_proj.out_features == 2 * attn.config.num_attention_heads * D
    if gated:
        q, gate = torch.chunk(attn.q_proj(x).view(B, 1, -1, D * 2), 2, dim=-1)
        gate = gate.reshape(B, 1, -1)
    else:
        q, gate = attn.q_proj(x), None
    q = norm(attn.q_norm, q.view(B, 1, -1, D)).transpose(1, 2)
    k = norm(attn.k_norm, attn.k_proj(x).view(B, 1, -1, D)).transpose(1, 2)
    v = attn.v_proj(x).view(B, 1, -1, D).transpose(1, 2)
    q, k = apply_rotary(q, k, cos, sin)
    # One slot per row at its own position: a scatter with a device index, no host-side slicing.
    slot = positions.view(B, 1, 1, 1).expand(B, k.shape[1], 1, D)
    k_cache.scatter_(2, slot, k.to(k_cache.dtype))
    v_cache.scatter_(2, slot, v.to(v_cache.dtype))
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=valid, scale=attn.scaling,
                                         enable_gqa=q.shape[1] != k_cache.shape[1])
    out = out.transpose(1, 2).reshape(B, 1, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return attn.o_proj(out)


def _gdn_projections(gdn: nn.Module, x: torch.Tensor):
    """(mixed_qkv [B, C, 1], z [B, 1, Hv, Dv], b [B, 1, Hv], a [B, 1, Hv]) in either family's weight layout."""
    B = x.shape[0]
    if hasattr(gdn, "in_proj_qkvz"):
        # Qwen3-Next groups q, k, v, z (and b, a) per key head; the module's own reordering undoes that.
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        mixed = torch.cat([t.reshape(B, 1, -1) for t in (q, k, v)], dim=-1)
        return mixed.transpose(1, 2), z, b, a
    mixed = gdn.in_proj_qkv(x).transpose(1, 2)
    z = gdn.in_proj_z(x).reshape(B, 1, -1, gdn.head_v_dim)
    return mixed, z, gdn.in_proj_b(x), gdn.in_proj_a(x)


def _conv_update(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``causal_conv1d_update`` + SiLU for one token: shift the state in place, convolve, activate.

    mixed: [B, C, 1]; conv_state: [B, Kc-1, C] token-major (the fused kernel's layout). Returns [B, C, 1].
    """
    C = mixed.shape[1]
    window = torch.cat([conv_state.transpose(1, 2), mixed.to(conv_state.dtype)], dim=-1)  # [B, C, Kc]
    conv_state.copy_(window[:, :, 1:].transpose(1, 2))
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, padding=0, groups=C)
    return F.silu(out).to(mixed.dtype)


def gdn_decode(gdn: nn.Module, x: torch.Tensor, conv_state: torch.Tensor,
               recurrent_state: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet for one new token per row, conv and recurrent state updated in place.

    Args:
        gdn: the HF ``Qwen3_5GatedDeltaNet`` / ``Qwen3NextGatedDeltaNet`` module.
        x: [B, 1, d_model] normed input.
        conv_state: [B, Kc-1, C] (C = 2 Hk Dk + Hv Dv), the last Kc - 1 conv inputs, token-major.
        recurrent_state: [B, Hv, Dk, Dv] float32.

    Returns:
        [B, 1, d_model] the mixer's output (after ``out_proj``).
    """
    if decode_step_reason(gdn, x) is None:
        return gdn_decode_step(gdn, x, conv_state, recurrent_state)
    B = x.shape[0]
    mixed, z, b, a = _gdn_projections(gdn, x)
    mixed = _conv_update(mixed, conv_state, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias).transpose(1, 2)
    q, k, v = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    q = q.reshape(B, 1, -1, gdn.head_k_dim)
    k = k.reshape(B, 1, -1, gdn.head_k_dim)
    v = v.reshape(B, 1, -1, gdn.head_v_dim)
    beta = b.sigmoid()
    g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=recurrent_state,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    recurrent_state.copy_(state)
    out = gdn.norm(out.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim)).reshape(B, 1, -1)
    return gdn.out_proj(out)


def is_moe_block(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is a sparse MoE block (router ``gate`` + 3-D ``experts``) rather than a dense SwiGLU."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def unsupported_mlp_reason(mlp: nn.Module) -> str | None:
    """Why the engine cannot run this MLP inside a captured step, or None when it can."""
    if not is_moe_block(mlp):
        return None if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) else (
            f"{type(mlp).__name__} is neither a SwiGLU MLP nor a sparse MoE block")
    experts = mlp.experts
    if not hasattr(experts, "gate_up_proj") or getattr(experts, "gate_up_proj").dim() != 3:
        return f"{type(experts).__name__} keeps no fused 3-D gate_up_proj (per-expert modules)"
    if not hasattr(experts, "has_gate") or getattr(experts, "_is_expert_parallel", False):
        return f"{type(experts).__name__} has no transformers experts interface (or runs expert-parallel)"
    return None


def _dense_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP: ``silu(gate) * up`` in one kernel on sm_90 (transformers launches two) between the module's own
    projections; the module's call where the kernel cannot take it (CPU, fp32, another activation)."""
    if fused_mlp.kernel_reason(mlp, x) is None:
        return mlp.down_proj(fused.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    return mlp(x)


def mlp_decode(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP for [B, 1, d_model]: the dense module itself, or a sparse MoE block with its experts gathered.

    transformers' default experts loop picks the hit experts with ``nonzero`` (a host sync and a data-dependent
    shape); its ``batched_mm`` form gathers each token's k experts' weights by device indices instead, the same
    math in a fixed shape, so the step uses that.
    """
    if not is_moe_block(mlp):
        return _dense_mlp(mlp, x)
    from transformers.integrations.moe import batched_mm_experts_forward

    B, T, d = x.shape
    flat = x.view(-1, d)
    _, weights, chosen = mlp.gate(flat)
    out = batched_mm_experts_forward(mlp.experts, flat, chosen, weights)
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        out = out + F.sigmoid(mlp.shared_expert_gate(flat)) * _dense_mlp(shared, flat)
    return out.reshape(B, T, d)
