"""The families' decoder layers with their residual adds fused.

The replacement makes the same sequence of module calls as transformers' forward (input norm, token mixer,
post-attention norm, MLP; the mixers' cache argument spelled as this transformers version spells it) with two
fusions on CUDA sm_90 bf16/fp16 tensors: the mid-layer residual add with the post-attention RMSNorm in one kernel
(``ops.add_rms_norm``, when ``fuse_norm``), and, for the dense MLP classes (when ``fuse_mlp``), the end-of-layer
residual add as ``down_proj``'s GEMM accumulating into the mid-layer sum (``addmm_`` with beta = 1; on the H200
cuBLAS's result is bit for bit transformers' add, GPU test). A part observed by hooks, or not plain (a quantised
``down_proj``, a projection with a bias, an MoE block), is called as a module, as transformers does. Under grad
the first fusion runs with its backward kernel; the second stays an add (the in-place GEMM would overwrite a
tensor autograd keeps for the norm's backward). Under autocast the fused norm writes autocast's dtype
(``ops.autocast_out_dtype``) for the MLP's projections, the sum staying in the residual stream's fp32.
"""
from __future__ import annotations

import inspect

import flashqla_kernels.patching.mlp as mlp_patch
from flashqla_kernels.decoder import hopper, ops
from flashqla_kernels.decoder.gdn_layer import hooked, plain_linear_reason
from flashqla_kernels.patching import registry
from flashqla_kernels.patching.norms import is_zero_centred_norm, norm_eps

__all__ = ["ROLE", "GROUP", "make_forward", "checkpointable", "decoder_fallback_reason", "add_norm_reason",
           "down_residual_reason"]

ROLE = GROUP = "decoder"
# block_type -> the token mixer's attribute: the GDN layer or the gated attention layer
_MIXERS = {"linear_attention": "linear_attn", "full_attention": "self_attn"}


def decoder_fallback_reason(layer) -> str | None:
    """Why a decoder layer's call goes to transformers' forward instead of the fused decoder wiring, or None."""
    mixer = _MIXERS.get(getattr(layer, "block_type", None))
    if mixer is None:
        return f"block_type {getattr(layer, 'block_type', None)!r} is neither of {sorted(_MIXERS)}"
    for name in (mixer, "input_layernorm", "post_attention_layernorm", "mlp"):
        if not hasattr(layer, name):
            return f"the layer has no {name}"
    return None


def add_norm_reason(norm, residual, h) -> str | None:
    """Why the mid-layer residual add and ``post_attention_layernorm`` stay two steps, or None."""
    if hooked(norm):
        return "post_attention_layernorm has hooks, which see the sum as its input"
    if not is_zero_centred_norm(norm):
        return f"post_attention_layernorm is {type(norm).__name__}, not a zero-centred RMSNorm"
    if hopper.add_operands_reason(residual, h) is not None:
        return f"the mixer returns {tuple(h.shape)} {h.dtype} for a {tuple(residual.shape)} {residual.dtype} residual"
    return ops.glue_kernel_reason(residual, h, grad_ok=True, dtypes=ops.ROW_DTYPES) or (
        None if residual.shape[-1] % 64 == 0 else f"hidden size {residual.shape[-1]} is not a multiple of 64")


def down_residual_reason(mlp, h, s) -> str | None:
    """Why the end-of-layer residual add stays an add after the MLP's module call (not ``down_proj``'s GEMM
    accumulating into the mid-layer sum ``s``), or None."""
    if type(mlp).__name__ not in mlp_patch.MLP_NAMES:
        return f"the MLP is a {type(mlp).__name__}, not a dense gate/up/down MLP"
    if hooked(mlp):
        return "the MLP has hooks, which see its output"
    reason = plain_linear_reason("down_proj", mlp.down_proj) or mlp_patch.kernel_reason(mlp, h)
    if reason is not None:
        return reason
    w = mlp.down_proj.weight
    if w.dtype != s.dtype or h.dtype != s.dtype or not s.is_contiguous() or s.shape[:-1] != h.shape[:-1]:
        return (f"down_proj weight {w.dtype}, the MLP input {h.dtype} and the sum {tuple(s.shape)} {s.dtype} do not "
                "fit an in-place GEMM")
    return ops.glue_kernel_reason(h, s, w)


def checkpointable(forward):
    """``forward`` as transformers installs a decoder layer's own: where its gradient checkpointing lives in the class's
    ``forward`` (``GradientCheckpointingLayer.__init_subclass__`` wraps it as each layer class is created, as in 5.25),
    the same wrapper around ``forward``, so a patched layer is still recomputed under the backward when checkpointing
    is on; where it lives in ``__call__`` (older releases), which the patch keeps, ``forward`` itself."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # no such base: no checkpointing wrapper to keep
        return forward
    if "__init_subclass__" not in vars(GradientCheckpointingLayer):
        return forward
    # a throwaway subclass receives transformers' own wrapper; installed as the layer class's forward, the wrapper's
    # "outermost" check (``type(self).forward is`` the wrapper) holds there
    return type("CheckpointedForward", (GradientCheckpointingLayer,), {"forward": forward}).forward


def make_forward(original, backend: str | None, fuse_norm: bool, fuse_mlp: bool):
    """The decoder-layer forward replacing ``original``; ``fuse_norm`` / ``fuse_mlp``: whether the residual adds
    may be fused into the post-attention norm / ``down_proj`` (the RMSNorm / MLP patches are on)."""
    new_api = "cache" in inspect.signature(original).parameters  # 5.24: cache=; up to 5.23: past_key_values=
    cache_name = "cache" if new_api else "past_key_values"
    mixer_cache = {"linear_attn": "cache" if new_api else "cache_params", "self_attn": cache_name}

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if decoder_fallback_reason(self) is not None:
            return original(self, hidden_states, position_embeddings, attention_mask, position_ids,
                            **{cache_name: cache}, **kwargs)
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        mixer = _MIXERS[self.block_type]
        if mixer == "linear_attn":
            h = self.linear_attn(hidden_states=h, attention_mask=attention_mask, **{mixer_cache[mixer]: cache},
                                 **kwargs)
        else:
            h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                  position_embeddings=position_embeddings, **{mixer_cache[mixer]: cache}, **kwargs)
        norm = self.post_attention_layernorm
        if fuse_norm and backend != "torch" and add_norm_reason(norm, residual, h) is None:
            s, h = ops.add_rms_norm(residual, h, norm.weight, norm_eps(norm),
                                    out_dtype=ops.autocast_out_dtype(residual), backend=backend)
        else:
            s = residual + h
            h = norm(s)
        if fuse_mlp and backend != "torch" and not hooked(norm) and down_residual_reason(self.mlp, h, s) is None:
            # s is this call's own tensor (no hook on the norm saw it): down_proj's GEMM accumulates into it
            act = mlp_patch.activation(self.mlp, h, backend)
            s.view(-1, s.shape[-1]).addmm_(act.view(-1, act.shape[-1]), self.mlp.down_proj.weight.t())
            return s
        out = self.mlp(h)
        if isinstance(out, tuple):  # the MoE blocks return (hidden_states, router_logits)
            out = out[0]
        return s + out

    forward.__doc__ = (f"flashqla_kernels decoder layer (backend={backend!r}): transformers' module calls with the "
                       "residual adds fused into the post-attention norm and down_proj on sm_90.")
    return registry.mark(checkpointable(forward), backend, original)
