"""The whole Gated DeltaNet layer of transformers' Qwen3.5 / Qwen3.5-MoE / Qwen3-Next on the fused path.

``gdn_layer_forward(layer, hidden_states, cache, attention_mask)`` computes what the layer's own ``forward`` does
(transformers 5.17-5.24, §2 of the transformers-gdn reference) with the token-major glue stages of ``ops`` and our
public chunk / recurrent op, reading and writing the model's hybrid cache through its public API
(``get/update_conv_state``, ``get/update_recurrent_state`` from 5.23; on 5.17-5.22, which lack the getters, the
states the cache layers hold once ``has_previous_state``, as transformers' own GDN forward reads them there) so the
cache stays interchangeable with transformers' own path (conv state [B, C, Kc] in the model dtype, recurrent state
[B, Hv, K, V] fp32).

``layer_unsupported_reason`` says when the fused path must not run; the patch (``flashqla_kernels.patching.gdn``) then
calls transformers' forward.
Cases handled: prefill with or without a cache, prefill continuation (a multi-token step after a cached prefix),
the T = 1 decode step, 2-D padding masks (zeroed inputs, as transformers does). Not handled (fallback):
packed sequences (``cu_seq_lens_q`` kwargs), caches recording the past for ``crop`` (speculative decoding),
accelerate offload hooks on ``conv1d``, activations other than SiLU, and unknown GDN module layouts.
"""
from __future__ import annotations

from typing import Any

import torch

from flashqla_kernels.decoder import ops
from flashqla_kernels.gated_delta_rule import chunk_gated_delta_rule, explain_backend, recurrent_gated_delta_rule

__all__ = ["gdn_layer_forward", "layer_unsupported_reason", "project", "explain_gdn_layer", "hooked",
           "plain_linear_reason", "cached_states"]

_CACHE_API = ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state")
# transformers 5.17-5.22: the same DynamicCache / StaticCache layers without the getters; their GDN forward reads
# cache.layers[i].conv_states[0] / .recurrent_states[0] once cache.has_previous_state(i, state_idx=0)
_CACHE_API_5_17 = ("has_previous_state", "update_conv_state", "update_recurrent_state", "layers")


def _cache_missing(cache: Any) -> list[str]:
    """The hybrid-cache methods this cache lacks (empty when it has the 5.23+ API or the 5.17-5.22 one)."""
    missing = [m for m in _CACHE_API if not hasattr(cache, m)]
    if missing and all(hasattr(cache, m) for m in _CACHE_API_5_17):
        return []
    return missing


def cached_states(cache: Any, idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Layer ``idx``'s (conv state [B, C, >=Kc], recurrent state [B, Hv, K, V]), or (None, None) before its first
    update, through either cache API."""
    if hasattr(cache, "get_conv_state"):
        return cache.get_conv_state(idx, state_idx=0), cache.get_recurrent_state(idx, state_idx=0)
    if not cache.has_previous_state(idx, state_idx=0):
        return None, None
    layer = cache.layers[idx]
    return layer.conv_states[0], layer.recurrent_states[0]


def _recording_past(cache: Any, idx: int) -> bool:
    """Whether the cache keeps layer ``idx``'s full conv history for ``crop()`` (speculative decoding)."""
    if hasattr(cache, "is_recording_past"):
        return bool(cache.is_recording_past(idx))
    layers = getattr(cache, "layers", None)
    return bool(layers is not None and idx < len(layers) and getattr(layers[idx], "record_past", False))


def layer_unsupported_reason(layer: torch.nn.Module, cache: Any = None, kwargs: dict | None = None) -> str | None:
    """Why ``gdn_layer_forward`` cannot run this call of ``layer``, or None.

    Args:
        layer: a transformers GDN module. cache: the call's cache (or None). kwargs: the call's extra kwargs.

    Returns:
        A sentence naming the unsupported feature, or None.
    """
    kwargs = kwargs or {}
    if not (hasattr(layer, "in_proj_qkv") or hasattr(layer, "in_proj_qkvz")):
        return f"{type(layer).__name__} has neither in_proj_qkv (Qwen3.5) nor in_proj_qkvz (Qwen3-Next)"
    if getattr(layer, "activation", "silu") not in ("silu", "swish"):
        return f"conv activation {layer.activation!r} is not SiLU"
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seqlens") is not None:
        return "packed sequences (cu_seq_lens_q) are not handled by the fused layer"
    if getattr(layer.conv1d, "_hf_hook", None) is not None:
        return "conv1d carries an accelerate hook (offloading); transformers' forward fires it"
    missing = _cache_missing(cache) if cache is not None else []
    if missing:
        return f"the cache ({type(cache).__name__}) lacks {', '.join(missing)}"
    if cache is not None and _recording_past(cache, layer.layer_idx):
        return "the cache records the past for crop(); transformers' forward keeps the full conv history"
    return None


def hooked(module: torch.nn.Module) -> bool:
    """Whether hooks observe ``module``'s call: torch forward (pre-)hooks, or an accelerate hook (offloading,
    device placement) that its replaced ``forward`` fires."""
    return bool(module._forward_hooks or module._forward_pre_hooks or getattr(module, "_hf_hook", None) is not None)


def plain_linear_reason(name: str, proj: Any) -> str | None:
    """Why ``F.linear(h, proj.weight)`` in a GEMM of our own would not be what calling ``proj`` (named ``name``)
    computes, or None: it must be a bias-free ``nn.Linear`` that no hook observes."""
    if type(proj) is not torch.nn.Linear:  # quantised / LoRA / offloaded projections run their own forward
        return f"{name} is a {type(proj).__name__}, not a plain nn.Linear"
    if proj.bias is not None:
        return f"{name} has a bias"
    if hooked(proj):
        return f"{name} has hooks, which the fused GEMM would skip"
    return None


def _project_b_a(layer: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(in_proj_b(h), in_proj_a(h))``. Two plain projections of one dtype run as one GEMM over their stacked
    weights (stacked per call, so an edit of either weight, even through ``.data``, is seen): the two outputs of
    Hv channels each are too narrow for a GEMM to do more than read h, and this reads it once."""
    pb, pa = layer.in_proj_b, layer.in_proj_a
    if (plain_linear_reason("in_proj_b", pb) or plain_linear_reason("in_proj_a", pa)
            or pb.weight.dtype != pa.weight.dtype):
        return pb(h), pa(h)
    ba = torch.nn.functional.linear(h, torch.cat((pb.weight, pa.weight)))
    return ba.split((pb.out_features, pa.out_features), dim=-1)


def project(layer: torch.nn.Module, h: torch.Tensor):
    """The input projections in token-major layout.

    Args:
        layer: the GDN module. h: [B, T, d_model].

    Returns:
        (qkv [B, T, 2*Hk*K + Hv*V] in [q | k | v] order, z [B, T, Hv*V], b [B, T, Hv], a [B, T, Hv]).
        Qwen3.5 projections come out in this order already; Qwen3-Next's per-key-head grouped ones are regrouped
        (one copy of qkv, as transformers does).
    """
    B, T, _ = h.shape
    if hasattr(layer, "in_proj_qkv"):
        return (layer.in_proj_qkv(h), layer.in_proj_z(h)) + tuple(_project_b_a(layer, h))
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(h), layer.in_proj_ba(h))
    qkv = torch.cat([x.reshape(B, T, -1) for x in (q, k, v)], dim=-1)
    return qkv, z.reshape(B, T, -1), b, a


def _conv_prefix(conv_state: torch.Tensor | None, Kc: int) -> torch.Tensor | None:
    """The Kc-1 tokens before this step, token-major [B, Kc-1, C], from the cache's [B, C, >=Kc] conv state."""
    if conv_state is None or Kc == 1:
        return None
    return conv_state[..., -(Kc - 1):].transpose(1, 2)


def _write_conv_state(cache: Any, tail: torch.Tensor, idx: int, Kc: int) -> None:
    """Hand the newest <= Kc tokens [B, C, <=Kc] to the cache; it appends them to its state (or left-pads a fresh
    one) and keeps the last Kc, as for transformers' own forward."""
    try:
        cache.update_conv_state(tail, idx, conv_kernel_size=Kc)
    except TypeError:  # caches whose update_conv_state takes no conv_kernel_size (older 5.x)
        cache.update_conv_state(tail, idx)


def gdn_layer_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                      attention_mask: torch.Tensor | None = None, *, backend: str | None = None) -> torch.Tensor:
    """The GDN layer's forward on the fused path (same result as the layer's own forward).

    Args:
        layer: a ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet`` / ``Qwen3NextGatedDeltaNet``.
        hidden_states: [B, T, d_model] (the input norm's output).
        cache: the model's hybrid cache (``DynamicCache`` / ``StaticCache``) or None (no state kept).
        attention_mask: 2-D [B, T] padding mask (1 = token) or None.
        backend: None (kernels where they run, else torch), "torch" or "tilelang" (raise where they cannot run);
            for the glue stages and the chunk op (the recurrent op for the T = 1 decode step).

    Returns:
        [B, T, d_model] in hidden_states' dtype. With a cache, its conv and recurrent states are updated.

    Example:
        >>> out = gdn_layer_forward(model.model.layers[0].linear_attn, h, cache=None)
    """
    if attention_mask is not None and attention_mask.dim() == 2:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    B, T, _ = hidden_states.shape
    Hk, K, Hv, V = layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim
    Kc, idx = layer.conv_kernel_size, layer.layer_idx
    conv_state = recurrent_state = None
    if cache is not None:
        missing = _cache_missing(cache)
        if missing:
            import transformers

            raise ValueError(
                f"gdn_layer_forward keeps the layer's states through the hybrid-cache API of transformers' "
                f"DynamicCache / StaticCache (5.17+), and this {type(cache).__name__} (transformers "
                f"{transformers.__version__}) lacks {', '.join(missing)}. Call the layer module itself "
                f"(patch_gdn_layers() hands such calls to transformers' forward) or pass cache=None.")
        conv_state, recurrent_state = cached_states(cache, idx)

    qkv, z, b, a = project(layer, hidden_states)
    q, k, v, g, beta = ops.conv_qkv_gates(qkv, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, a, b,
                                          layer.A_log, layer.dt_bias, Hk=Hk, K=K, Hv=Hv, V=V,
                                          prefix=_conv_prefix(conv_state, Kc), backend=backend)
    if cache is not None:
        # The cache appends the newest tokens to its state (or left-pads a fresh one) and keeps the last Kc.
        _write_conv_state(cache, qkv[:, -Kc:].transpose(1, 2), idx, Kc)

    op = recurrent_gated_delta_rule if recurrent_state is not None and T == 1 else chunk_gated_delta_rule
    o, final_state = op(q, k, v, g, beta, initial_state=recurrent_state, output_final_state=cache is not None,
                        use_qk_l2norm_in_kernel=False, backend=backend)
    if cache is not None:
        cache.update_recurrent_state(final_state, idx)

    if layer.norm._forward_hooks or layer.norm._forward_pre_hooks:
        # Someone observes the norm: call the module so their hooks see transformers' [B*T*Hv, V] tensors.
        y = layer.norm(o.reshape(-1, V), z.reshape(-1, V))
    else:
        y = ops.gated_norm(o, z, layer.norm.weight, layer.norm.variance_epsilon, backend=backend)
    return layer.out_proj(y.reshape(B, T, Hv * V))


def _stage_line(stage: str, decide) -> str:
    """One line of ``explain_gdn_layer``: the backend ``decide()`` picks, and why when it is not the kernel."""
    try:
        decision = decide()
    except ValueError as err:  # backend="tilelang" where the kernel cannot run: the call would raise this
        return f"  {stage}: error ({err})"
    if decision.kernel:
        return f"  {stage}: tilelang"
    return f"  {stage}: torch ({decision.reasons[0].removeprefix('tilelang: not used: ').removeprefix('torch: ')})"


def explain_gdn_layer(layer: torch.nn.Module, hidden_states: torch.Tensor, cache: Any = None, *,
                      backend: str | None = None, **kwargs) -> str:
    """How the patched forward would run this call of ``layer``, stage by stage, and why: the dispatcher's decisions
    for the glue stages and the chunk op's ``explain_backend``. Runs nothing.

    Args:
        layer: the GDN module. hidden_states: [B, T, d_model] (only its shape, dtype, device and whether it
            requires grad are read). cache: the call's cache or None. backend: as for ``gdn_layer_forward``.
        kwargs: the call's extra kwargs.

    Returns:
        Multi-line text, e.g. ``"layer: fused\n  conv_qkv_gates: torch (tensors are on cpu; ...)\n  chunk op: ..."``.

    Example:
        >>> print(explain_gdn_layer(model.model.layers[0].linear_attn, h))
    """
    reason = layer_unsupported_reason(layer, cache, kwargs)
    if reason is not None:
        return f"layer: transformers' forward ({reason})"
    B, T, _ = hidden_states.shape
    Hk, K, Hv, V = layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim
    dev, dt = hidden_states.device, hidden_states.dtype
    # the projections' outputs require grad where the input or a weight does (and grad mode is on)
    grad = torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters()))

    def like(*shape, dtype=dt):  # zero-memory stand-ins with the right shape, dtype, device and grad
        return torch.empty((), dtype=dtype, device=dev, requires_grad=grad).expand(*shape)

    acts = like(B, T, 1)
    decode = cache is not None and T == 1 and cached_states(cache, layer.layer_idx)[1] is not None
    op = "recurrent" if decode else "chunk"
    g = like(B, T, Hv, dtype=torch.float32)
    op_text = explain_backend(like(B, T, Hk, K), like(B, T, Hk, K), like(B, T, Hv, V), g, g, op=op,
                              backend=backend)
    return "\n".join([
        "layer: fused",
        _stage_line("conv_qkv_gates", lambda: ops.conv_qkv_gates_decision(
            acts, acts, acts, Hk=Hk, K=K, Hv=Hv, V=V, Kc=layer.conv_kernel_size, backend=backend)),
        f"  {op} op: " + op_text.replace("\n", "\n    "),
        _stage_line("gated_norm", lambda: ops.gated_norm_decision(like(B, T, Hv, V), acts, backend=backend)),
    ])
