"""Put the GDN layers' whole forward on the fused path, and take it off again.

``patch_gdn_layers()`` replaces ``forward`` on the GDN classes of transformers' Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
(every model of those families, including models built later). The replacement accepts the layer's call in
every 5.17-5.24 spelling (``cache_params=`` up to 5.23, ``cache=`` from 5.24) and hands the call back to
transformers' own forward whenever ``layer_unsupported_reason`` names a reason (see ``layer``), so it composes with
the op patch of ``flashqla_kernels.patch``: the fallback runs whatever chunk / recurrent functions are patched in.
With ``rms_norms=True`` (default) it also replaces ``forward`` of the families' zero-centred RMSNorm classes (decoder,
final and q/k norms): the one-pass kernel on CUDA sm_90 bf16/fp16 tensors, transformers' own forward otherwise.
With ``mlp=True`` (default) it replaces ``forward`` of the families' dense gate/up/down MLP classes (the decoder MLP,
and the MoE blocks' shared expert; the routed experts are another module, left alone):
``down_proj(swiglu(x, gate_proj.weight, up_proj.weight))`` on CUDA sm_90 bf16/fp16 tensors when ``act_fn`` is SiLU:
one GEMM for both projections with ``silu(gate) * up`` in its epilogue (``FUSED_MLP_GEMM``), or, where the
projections are not plain hook-free bias-free ``nn.Linear`` modules, the projections' own calls and the one-pass
``silu(gate) * up`` kernel; transformers' own forward otherwise.
With ``attention=True`` (default) it replaces ``forward`` of the families' gated full-attention classes: q/k norms
and the partial rotary embedding in one kernel that writes the attention kernels' layout (``ops.qk_norm_rope``), the
attention itself through transformers' own attention interface, and ``attn * sigmoid(gate)`` reading the gate in place
(``ops.gate_mul``). For an unpadded prefill on SDPA it makes the one causal ``scaled_dot_product_attention`` call
transformers' SDPA interface would make, and the gate kernel reads its head-major output, writing the token-major rows
``o_proj`` takes (``ops.gate_mul_head_major``: transformers' transpose copy folded in). Calls with a KV cache (generation) and layers whose q/k norms carry hooks go to transformers'
forward.
With ``decoder=True`` (default) it replaces ``forward`` of the families' decoder layers (``DECODER_CLASSES``) with the
same sequence of module calls (input norm, token mixer, post-attention norm, MLP; the mixers' cache argument spelled
as this transformers version spells it) and two fusions on CUDA sm_90 bf16/fp16 tensors: the mid-layer residual add
with the post-attention RMSNorm in one kernel (``ops.add_rms_norm``, when ``rms_norms``), and, for the dense MLP
classes (when ``mlp``), the end-of-layer residual add as ``down_proj``'s GEMM accumulating into the mid-layer sum
(``addmm_`` with beta = 1; on the H200 cuBLAS's result is bit for bit transformers' add, GPU test). A part observed by hooks, or not plain (a quantised
``down_proj``, a projection with a bias, an MoE block), is called as a module, as transformers does.

Explicit, idempotent and restorable: importing this module changes nothing.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from flashqla_kernels.gdn_layer import hopper, ops  # hopper imports no tilelang until a kernel runs
from flashqla_kernels.gdn_layer.layer import gdn_layer_forward, layer_unsupported_reason
from flashqla_kernels.gdn_layer.layer import hooked as _hooked
from flashqla_kernels.gdn_layer.layer import plain_linear_reason as _plain_linear_reason

__all__ = ["patch_gdn_layers", "unpatch_gdn_layers", "patched_gdn_layers", "gdn_layers_patched", "GDN_CLASSES",
           "NORM_CLASSES", "MLP_CLASSES", "ATTENTION_CLASSES", "DECODER_CLASSES", "attention_fallback_reason",
           "decoder_fallback_reason"]

GDN_CLASSES = (
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
)
NORM_CLASSES = (
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNorm"),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNorm"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeRMSNorm"),
)
# ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Qwen3-Next's dense layers and shared expert, Qwen3.5's decoder MLP,
# Qwen3.5-MoE's shared expert (the vision towers' MLPs are fc1/fc2 GELU, another layout)
MLP_CLASSES = (
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextMLP"),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5MLP"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeMLP"),
)
# the gated full-attention layers: q_proj -> (query, gate) per head, q/k zero-centred norms, partial RoPE
ATTENTION_CLASSES = (
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextAttention"),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5Attention"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeAttention"),
)
# the decoder layers: input norm -> token mixer (GDN or gated attention by ``block_type``) -> residual add ->
# post-attention norm -> MLP (dense, or an MoE block returning a tuple in Next / 3.5-MoE) -> residual add
DECODER_CLASSES = (
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextDecoderLayer"),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5DecoderLayer"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeDecoderLayer"),
)
_MIXERS = {"linear_attention": "linear_attn", "full_attention": "self_attn"}
_NORM_NAMES = frozenset(c for _, c in NORM_CLASSES)  # checked on every layer call: built once
_MLP_NAMES = frozenset(c for _, c in MLP_CLASSES)
_SILU_TYPES = ("SiLU", "SiLUActivation")  # torch.nn.SiLU, transformers' ACT2FN["silu"]
# The MLP's gate and up projections as one GEMM with the SwiGLU in its epilogue (``ops.swiglu``) where the kernel
# runs and the projections are plain, hook-free, bias-free nn.Linear; off: two cuBLAS GEMMs and the silu_mul kernel.
# On the H200 (seventh session) 2.46 ms against 2.67 for the 2B MLP's 32768 x 2048 -> 6144 (benchmarks/swiglu_gemm.py),
# and the whole 2B forward 192.9 K -> 198.8 K tokens/s (gdn_layer.py, ours+silu_mul against ours+swiglu).
FUSED_MLP_GEMM = True
_MARK = "_flashqla_fused_backend"
_saved: dict[tuple[str, str], Any] = {}


def _cache_kwarg(original) -> str:
    """The cache argument's name in transformers' forward: "cache" (5.24+) or "cache_params" (<= 5.23)."""
    return "cache" if "cache" in inspect.signature(original).parameters else "cache_params"


def _make_forward(original, backend: str | None):
    cache_name = _cache_kwarg(original)

    def forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
        cache = cache if cache is not None else cache_params
        if layer_unsupported_reason(self, cache, kwargs) is not None:
            return original(self, hidden_states, attention_mask=attention_mask, **{cache_name: cache}, **kwargs)
        return gdn_layer_forward(self, hidden_states, cache, attention_mask, backend=backend)

    forward.__doc__ = f"flashqla_kernels fused GDN layer (backend={backend!r}); falls back to transformers' forward."
    forward.__wrapped__ = original
    setattr(forward, _MARK, backend)
    return forward


def _make_norm_forward(original, backend: str | None):
    def forward(self, hidden_states):
        if backend != "torch" and ops.glue_kernel_reason(hidden_states) is None and hidden_states.shape[-1] % 64 == 0:
            return ops.rms_norm(hidden_states, self.weight, self.eps, backend=backend)
        return original(self, hidden_states)

    forward.__doc__ = f"flashqla_kernels RMSNorm (backend={backend!r}): the kernel on sm_90, else transformers'."
    forward.__wrapped__ = original
    setattr(forward, _MARK, backend)
    return forward


def _mlp_kernel_reason(mlp, x) -> str | None:
    """Why the MLP takes transformers' forward before any projection runs, or None."""
    act = mlp.act_fn
    if type(act).__name__ not in _SILU_TYPES:
        return f"act_fn {type(act).__name__} is not SiLU"
    if act._forward_hooks or act._forward_pre_hooks:
        return "act_fn has hooks, which the fused activation would skip"
    if mlp.gate_proj.out_features % 64:
        return f"intermediate size {mlp.gate_proj.out_features} is not a multiple of 64"
    return ops.glue_kernel_reason(x)


def _fused_gemm_reason(mlp, x=None) -> str | None:
    """Why the MLP's gate and up projections stay two ``nn.Linear`` calls (not the fused SwiGLU GEMM), or None.
    With ``x``, also whatever keeps the kernel off these tensors (trainable weights with grad on, weights in another
    dtype than x as under autocast, an intermediate size the kernel does not tile): the module calls then run as
    without the fused GEMM."""
    if not FUSED_MLP_GEMM:
        return "FUSED_MLP_GEMM is off"
    for name in ("gate_proj", "up_proj"):
        reason = _plain_linear_reason(name, getattr(mlp, name))
        if reason is not None:
            return reason
    if x is None:
        return None
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight)
    if any(w.dtype != x.dtype for w in weights):
        return f"weights in {weights[0].dtype} for {x.dtype} activations"
    return ops.glue_kernel_reason(x, *weights) or hopper.swiglu_shape_reason(*weights[0].shape, x.dtype)


def _mlp_activation(mlp, x, backend: str | None) -> torch.Tensor:
    """``act_fn(gate_proj(x)) * up_proj(x)``, the input of ``down_proj``, for an MLP whose ``_mlp_kernel_reason`` is
    None: the SwiGLU GEMM, else the projections' module calls and the silu_mul kernel."""
    if _fused_gemm_reason(mlp, x) is None:
        return ops.swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, backend=backend)
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    # the projections' outputs decide too (autocast dtype, trainable weights): transformers' expression then
    if ops.glue_kernel_reason(gate, up) is not None:
        return mlp.act_fn(gate) * up
    return ops.silu_mul(gate, up, backend=backend)


def _make_mlp_forward(original, backend: str | None):
    def forward(self, x):
        if backend == "torch" or _mlp_kernel_reason(self, x) is not None:
            return original(self, x)
        return self.down_proj(_mlp_activation(self, x, backend))

    forward.__doc__ = f"flashqla_kernels MLP (backend={backend!r}): fused silu(gate) * up on sm_90, else transformers'."
    forward.__wrapped__ = original
    setattr(forward, _MARK, backend)
    return forward


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
        if type(norm).__name__ not in _NORM_NAMES:
            return f"{name} is {type(norm).__name__}, not a zero-centred RMSNorm"
    if _norm_eps(attn.q_norm) != _norm_eps(attn.k_norm):
        return "q_norm and k_norm have different eps"
    if attn.q_proj.out_features != 2 * attn.config.num_attention_heads * attn.head_dim:
        return "q_proj does not output a gate beside the query"
    return None


# kwargs of an attention call that change what sdpa_attention_forward does beyond the plain causal SDPA call
_SDPA_KWARGS_OFF_PATH = ("position_bias", "softcap", "output_attentions", "s_aux")


def _plain_causal_sdpa(attn, q: torch.Tensor, attention_mask, kwargs: dict) -> bool:
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


def _norm_eps(norm) -> float:
    return float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))


def _make_attention_forward(original, backend: str | None):
    cache_name = "cache" if "cache" in inspect.signature(original).parameters else "past_key_values"
    module = importlib.import_module(original.__module__)

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
        q, k = ops.qk_norm_rope(qg, kx, self.q_norm.weight, self.k_norm.weight, _norm_eps(self.q_norm), cos, sin,
                                backend=backend)
        if _plain_causal_sdpa(self, q, attention_mask, kwargs):
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
    forward.__wrapped__ = original
    setattr(forward, _MARK, backend)
    return forward


def decoder_fallback_reason(layer) -> str | None:
    """Why a decoder layer's call goes to transformers' forward instead of the fused decoder wiring, or None."""
    mixer = _MIXERS.get(getattr(layer, "block_type", None))
    if mixer is None:
        return f"block_type {getattr(layer, 'block_type', None)!r} is neither of {sorted(_MIXERS)}"
    for name in (mixer, "input_layernorm", "post_attention_layernorm", "mlp"):
        if not hasattr(layer, name):
            return f"the layer has no {name}"
    return None


def _add_norm_reason(norm, residual, h) -> str | None:
    """Why the mid-layer residual add and ``post_attention_layernorm`` stay two steps, or None."""
    if _hooked(norm):
        return "post_attention_layernorm has hooks, which see the sum as its input"
    if type(norm).__name__ not in _NORM_NAMES:
        return f"post_attention_layernorm is {type(norm).__name__}, not a zero-centred RMSNorm"
    if h.shape != residual.shape or h.dtype != residual.dtype:
        return f"the mixer returns {tuple(h.shape)} {h.dtype} for a {tuple(residual.shape)} {residual.dtype} residual"
    return ops.glue_kernel_reason(residual, h) or (
        None if residual.shape[-1] % 64 == 0 else f"hidden size {residual.shape[-1]} is not a multiple of 64")


def _down_residual_reason(mlp, h, s) -> str | None:
    """Why the end-of-layer residual add stays an add after the MLP's module call (not ``down_proj``'s GEMM
    accumulating into the mid-layer sum ``s``), or None."""
    if type(mlp).__name__ not in _MLP_NAMES:
        return f"the MLP is a {type(mlp).__name__}, not a dense gate/up/down MLP"
    if _hooked(mlp):
        return "the MLP has hooks, which see its output"
    reason = _plain_linear_reason("down_proj", mlp.down_proj) or _mlp_kernel_reason(mlp, h)
    if reason is not None:
        return reason
    w = mlp.down_proj.weight
    if w.dtype != s.dtype or not s.is_contiguous() or s.shape[:-1] != h.shape[:-1]:
        return f"down_proj weight {w.dtype} and the sum {tuple(s.shape)} {s.dtype} do not fit an in-place GEMM"
    return ops.glue_kernel_reason(h, s, w)


def _make_decoder_forward(original, backend: str | None, fuse_norm: bool, fuse_mlp: bool):
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
        if fuse_norm and backend != "torch" and _add_norm_reason(norm, residual, h) is None:
            s, h = ops.add_rms_norm(residual, h, norm.weight, _norm_eps(norm), backend=backend)
        else:
            s = residual + h
            h = norm(s)
        if fuse_mlp and backend != "torch" and not _hooked(norm) and _down_residual_reason(self.mlp, h, s) is None:
            # s is this call's own tensor (no hook on the norm saw it): down_proj's GEMM accumulates into it
            act = _mlp_activation(self.mlp, h, backend)
            s.view(-1, s.shape[-1]).addmm_(act.view(-1, act.shape[-1]), self.mlp.down_proj.weight.t())
            return s
        out = self.mlp(h)
        if isinstance(out, tuple):  # the MoE blocks return (hidden_states, router_logits)
            out = out[0]
        return s + out

    forward.__doc__ = (f"flashqla_kernels decoder layer (backend={backend!r}): transformers' module calls with the "
                       "residual adds fused into the post-attention norm and down_proj on sm_90.")
    forward.__wrapped__ = original
    setattr(forward, _MARK, backend)
    return forward


def _load(module_name: str, class_name: str):
    try:
        return getattr(importlib.import_module(module_name), class_name, None)
    except ImportError:  # this transformers version lacks the family
        return None


def patch_gdn_layers(backend: str | None = None, rms_norms: bool = True, mlp: bool = True,
                     attention: bool = True, decoder: bool = True) -> list[str]:
    """Run the GDN layers of Qwen3-Next / Qwen3.5 / Qwen3.5-MoE on the fused layer path.

    Args:
        backend: None (TileLang kernels for CUDA sm_90 tensors, torch elsewhere), "torch" or "tilelang";
            used for the glue stages and the chunk op.
        rms_norms: also put the zero-centred RMSNorm classes on the RMSNorm kernel (a no-op off Hopper).
        mlp: also put the dense SiLU MLP classes (``MLP_CLASSES``) on the fused ``silu(gate) * up`` kernel (a no-op
            off Hopper).
        attention: also put the gated full-attention classes (``ATTENTION_CLASSES``) on the fused q/k norm + RoPE
            and gate kernels (off Hopper: the same wiring with transformers' operations, equal to its forward).
        decoder: also put the decoder layers (``DECODER_CLASSES``) on the wiring that fuses the residual adds into
            the post-attention norm (with ``rms_norms``) and the dense MLP's ``down_proj`` (with ``mlp``); off
            Hopper it makes transformers' own calls in transformers' order.

    Returns:
        The patched targets, e.g. ``["transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet.forward"]``.
        Calling again replaces the previous patch (the originals saved first stay saved).

    Example:
        >>> patch_gdn_layers()
        >>> logits = model(ids, use_cache=False).logits
        >>> unpatch_gdn_layers()
    """
    if backend not in (None, "torch", "tilelang"):
        raise ValueError(f"backend must be one of None, 'torch', 'tilelang'; got {backend!r}")
    unpatch_gdn_layers()
    patched = []
    targets = ([(c, _make_forward) for c in GDN_CLASSES] + [(c, _make_norm_forward) for c in NORM_CLASSES if rms_norms]
               + [(c, _make_mlp_forward) for c in MLP_CLASSES if mlp]
               + [(c, _make_attention_forward) for c in ATTENTION_CLASSES if attention]
               + [(c, lambda f, b: _make_decoder_forward(f, b, rms_norms, mlp)) for c in DECODER_CLASSES if decoder])
    for (module_name, class_name), make in targets:
        cls = _load(module_name, class_name)
        if cls is None:
            continue
        _saved[(module_name, class_name)] = cls.__dict__["forward"]
        cls.forward = make(_saved[(module_name, class_name)], backend)
        patched.append(f"{module_name}.{class_name}.forward")
    if not any(name.endswith("GatedDeltaNet.forward") for name in patched):
        raise RuntimeError("patch_gdn_layers found no GDN class to patch in "
                           f"{', '.join(m for m, _ in GDN_CLASSES)}; transformers >= 5.17 is needed")
    return patched


def unpatch_gdn_layers() -> list[str]:
    """Restore transformers' own GDN forwards. Safe to call when nothing is patched.

    Returns:
        The restored targets.
    """
    restored = []
    for (module_name, class_name), original in _saved.items():
        _load(module_name, class_name).forward = original
        restored.append(f"{module_name}.{class_name}.forward")
    _saved.clear()
    return restored


def gdn_layers_patched() -> bool:
    """Whether any GDN class currently runs the fused forward."""
    return bool(_saved)


def _current_backend() -> str | None:
    for module_name, class_name in _saved:
        return getattr(_load(module_name, class_name).forward, _MARK, None)
    return None


def _norms_patched() -> bool:
    return any(key in _saved for key in NORM_CLASSES)


def _mlps_patched() -> bool:
    return any(key in _saved for key in MLP_CLASSES)


def _attention_patched() -> bool:
    return any(key in _saved for key in ATTENTION_CLASSES)


def _decoders_patched() -> bool:
    return any(key in _saved for key in DECODER_CLASSES)


@contextlib.contextmanager
def patched_gdn_layers(backend: str | None = None, rms_norms: bool = True, mlp: bool = True,
                       attention: bool = True, decoder: bool = True) -> Iterator[list[str]]:
    """Context manager form of ``patch_gdn_layers``; on exit restores the state found on entry.

    Example:
        >>> with patched_gdn_layers(backend="torch"):
        ...     out = model.generate(ids, max_new_tokens=8)
    """
    was, previous, norms, mlps = gdn_layers_patched(), _current_backend(), _norms_patched(), _mlps_patched()
    attn, decoders = _attention_patched(), _decoders_patched()
    try:
        yield patch_gdn_layers(backend, rms_norms, mlp, attention, decoder)
    finally:
        unpatch_gdn_layers()
        if was:
            patch_gdn_layers(previous, norms, mlps, attn, decoders)
