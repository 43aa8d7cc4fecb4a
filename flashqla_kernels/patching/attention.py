"""The families' gated full-attention layers with their q/k preparation and gate fused.

The replacement computes q/k norms and the partial rotary embedding in one kernel that writes the attention kernels'
layout (``ops.qk_norm_rope``), the attention itself through transformers' own attention interface, and
``attn * sigmoid(gate)`` reading the gate in place (``ops.gate_mul``). For an unpadded prefill on SDPA it makes the
one causal ``scaled_dot_product_attention`` call transformers' SDPA interface would make, and the gate kernel reads
its head-major output, writing the token-major rows ``o_proj`` takes (``ops.gate_mul_head_major``: transformers'
transpose copy folded in). Calls with a KV cache (generation) and layers whose q/k norms carry hooks go to
transformers' forward.
"""
from __future__ import annotations

import inspect
from types import ModuleType

import torch

from flashqla_kernels.decoder import ops
from flashqla_kernels.patching import registry
from flashqla_kernels.patching.norms import is_zero_centred_norm, norm_eps

__all__ = ["ROLE", "GROUP", "make_forward", "attention_fallback_reason", "plain_causal_sdpa"]

ROLE = GROUP = "attention"
# kwargs of an attention call that change what sdpa_attention_forward does beyond the plain causal SDPA call
_SDPA_KWARGS_OFF_PATH = ("position_bias", "softcap", "output_attentions", "s_aux")


def attention_fallback_reason(attn, hidden_states, position_embeddings, cache) -> str | None:
    """Why a gated attention layer's call goes to transformers' forward instead of the fused glue, or None."""
    if cache is not None:
        return "a KV cache is passed (generation): transformers' forward updates it"
    if position_embeddings is None:
        return "no position embeddings passed"
    if attn.training and attn.attention_dropout:
        return "attention dropout in training mode"
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if norm is None or not hasattr(norm, "weight"):
            return f"no {name} with a weight"
        if norm._forward_hooks or norm._forward_pre_hooks:
            return f"{name} has hooks, which the fused q/k preparation would skip"
        if not is_zero_centred_norm(norm):
            return f"{name} is {type(norm).__name__}, not a zero-centred RMSNorm"
    if norm_eps(attn.q_norm) != norm_eps(attn.k_norm):
        return "q_norm and k_norm have different eps"
    if attn.q_proj.out_features != 2 * attn.config.num_attention_heads * attn.head_dim:
        return "q_proj does not output a gate beside the query"
    return None


def plain_causal_sdpa(attn, q: torch.Tensor, attention_mask, kwargs: dict) -> bool:
    """Whether transformers' SDPA interface would make exactly one causal, unmasked, dropout-free
    ``scaled_dot_product_attention`` call (GQA in the kernel) for this call: prefill without padding."""
    if attn.config._attn_implementation != "sdpa" or attention_mask is not None or q.shape[2] < 2:
        return False
    if attn.training and attn.attention_dropout:
        return False
    if kwargs.get("is_causal", getattr(attn, "is_causal", True)) is not True:
        return False
    if any(kwargs.get(name) for name in _SDPA_KWARGS_OFF_PATH):
        return False
    return q.shape[-1] <= 256 and q.device.type in ("cuda", "cpu")


def make_forward(original, backend: str | None, module: ModuleType):
    """The gated attention forward replacing ``original``; ``module`` is its modeling module (for its
    ``eager_attention_forward``, the interface's default)."""
    cache_name = "cache" if "cache" in inspect.signature(original).parameters else "past_key_values"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if attention_fallback_reason(self, hidden_states, position_embeddings, cache) is not None:
            return original(self, hidden_states, position_embeddings, attention_mask, **{cache_name: cache},
                            **kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        input_shape, D = hidden_states.shape[:-1], self.head_dim
        qg = self.q_proj(hidden_states).view(*input_shape, -1, 2 * D)
        kx = self.k_proj(hidden_states).view(*input_shape, -1, D)
        v = self.v_proj(hidden_states).view(*input_shape, -1, D).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = ops.qk_norm_rope(qg, kx, self.q_norm.weight, self.k_norm.weight, norm_eps(self.q_norm), cos, sin,
                                backend=backend)
        if plain_causal_sdpa(self, q, attention_mask, kwargs):
            # transformers' sdpa_attention_forward makes this very call, then copies the output token-major; the
            # gate kernel reads it head-major instead
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, scale=self.scaling, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
            return self.o_proj(ops.gate_mul_head_major(out, qg, backend=backend)), None
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          module.eager_attention_forward)
        out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training
                                 else self.attention_dropout, scaling=self.scaling, **kwargs)
        out = ops.gate_mul(out.reshape(*input_shape, -1), qg, backend=backend)
        return self.o_proj(out), weights

    forward.__doc__ = (f"flashqla_kernels gated attention (backend={backend!r}): fused q/k norm + RoPE and gate; "
                       "transformers' forward with a KV cache.")
    return registry.mark(forward, backend, original)
