"""One declarative adapter per Qwen family: where the decoder blocks, norms, embedding and unembedding live.

An adapter is found from the loaded model's config (``model_type``) and checked against its module tree, never
from a hub id, so a renamed local checkpoint works. Every family shares Qwen3's layout; the others only override
the attributes that differ (Qwen3.5 derives from Qwen3, the VL wrappers from Qwen3.5)::

    adapter = get_adapter(model)
    adapter.layers[3]          # decoder block 3 (its output is resid_post.3, the Qwen-Scope SAE site)
    adapter.layer_types[3]     # "linear_attention" or "full_attention"
"""
from __future__ import annotations

import inspect
from typing import ClassVar

from torch import nn

__all__ = ["QwenAdapter", "Qwen3Adapter", "Qwen3MoeAdapter", "Qwen3NextAdapter", "Qwen3_5Adapter",
           "Qwen3_5MoeAdapter", "Qwen3_5VLAdapter", "Qwen3_5MoeVLAdapter", "ADAPTERS", "HYBRID_FAMILIES",
           "get_adapter", "supported_families"]


# text model forward -> whether it takes a {layer type: mask} mapping as attention_mask (read once from its source)
_TAKES_MASK_MAPPING: dict = {}
# attention implementations whose mask for an unpadded causal batch is None in transformers (the kernel's own causal
# flag does the masking); every other one gets a real mask from transformers' mask builder
_CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


def _resolve(root: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted ``path`` ("" is ``root``), or None when any part is missing."""
    module = root
    for part in filter(None, path.split(".")):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


class QwenAdapter:
    """Where things live in one family of Qwen models. Subclasses only declare class attributes.

    Attributes (per instance):
        model: the wrapped model (causal LM, VL wrapper or bare text model).
        text_model: the module that owns ``layers``, ``norm`` and ``embed_tokens``.
        layers: ``nn.ModuleList`` of decoder blocks.
        n_layers, d_model: number of blocks and residual width.
        layer_types: per block, ``"linear_attention"`` (Gated DeltaNet) or ``"full_attention"``.
        final_norm, embed, unembed: the final RMSNorm, token embedding and ``lm_head`` (None for a bare text model).
        family: short family name, e.g. ``"qwen3_5"``.

    Class attributes a family declares: ``family``, ``label``, ``model_types``, the module paths, and ``hybrid``:
    whether its decoder mixes Gated DeltaNet (``linear_attention``) layers with full attention (the layers the
    fused GDN kernels of ``flashqla_kernels`` serve).
    """

    family: ClassVar[str] = ""
    label: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    text_model_paths: ClassVar[tuple[str, ...]] = ("model", "")
    layers_attr: ClassVar[str] = "layers"
    norm_attr: ClassVar[str] = "norm"
    embed_attr: ClassVar[str] = "embed_tokens"
    unembed_path: ClassVar[str] = "lm_head"
    mixer_attrs: ClassVar[dict[str, str]] = {"full_attention": "self_attn"}
    mlp_attr: ClassVar[str] = "mlp"
    hybrid: ClassVar[bool] = False

    def __init__(self, model: nn.Module):
        text_model = self.find_text_model(model)
        if text_model is None:
            raise TypeError(
                f"{type(model).__name__} has model_type {_model_type(model)!r} but no decoder blocks at any of "
                f"{[p + '.layers' if p else 'layers' for p in self.text_model_paths]}; expected a {self.label} model")
        self.model = model
        self.text_model = text_model
        self.layers: nn.ModuleList = getattr(text_model, self.layers_attr)
        self.config = text_model.config.get_text_config() if hasattr(text_model, "config") else model.config
        self.n_layers = len(self.layers)
        self.d_model = int(self.config.hidden_size)
        self.layer_types = self._layer_types()
        self.final_norm: nn.Module = getattr(text_model, self.norm_attr)
        self.embed: nn.Module = getattr(text_model, self.embed_attr)
        self.unembed: nn.Module | None = _resolve(model, self.unembed_path) if text_model is not model else None

    @classmethod
    def find_text_model(cls, model: nn.Module) -> nn.Module | None:
        for path in cls.text_model_paths:
            module = _resolve(model, path)
            if module is not None and isinstance(getattr(module, cls.layers_attr, None), nn.ModuleList):
                return module
        return None

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return _model_type(model) in cls.model_types and cls.find_text_model(model) is not None

    def _layer_types(self) -> list[str]:
        types = []
        for block in self.layers:
            block_type = getattr(block, "block_type", None) or getattr(block, "layer_type", None)
            if block_type is None:
                block_type = "linear_attention" if hasattr(block, "linear_attn") else "full_attention"
            types.append(block_type)
        return types

    def mixer(self, n: int) -> nn.Module:
        """The token mixer of block ``n``: ``self_attn`` (full attention) or ``linear_attn`` (Gated DeltaNet)."""
        block = self.layers[n]
        for attr in self.mixer_attrs.values():
            if hasattr(block, attr):
                return getattr(block, attr)
        raise TypeError(f"block {n} ({type(block).__name__}) has none of {sorted(self.mixer_attrs.values())}")

    def mlp(self, n: int) -> nn.Module:
        """The MLP (dense SwiGLU or sparse MoE block) of block ``n``."""
        return getattr(self.layers[n], self.mlp_attr)

    def post_attention_norm(self, n: int) -> nn.Module:
        """The RMSNorm between the mixer and the MLP of block ``n`` (its input is the mid-block residual)."""
        return self.layers[n].post_attention_layernorm

    def unpadded_masks(self) -> dict[str, None] | None:
        """The per-layer-type attention masks of a batch without left padding or packing, for the text model's
        ``attention_mask=`` argument: ``None`` for every type (causal attention, no recurrent mask), which is what
        transformers works out itself, but without the GPU sync of its packed-sequence check (one per forward,
        which drains the device queue). Right padding needs no mask either: causal tokens never see later pads.

        Returns None (pass no mask) where the text model's forward takes no such mapping (Qwen3-MoE), a layer
        type needs a real mask (sliding-window attention), or the attention implementation builds one even for an
        unpadded causal batch (``eager``'s additive 4-D mask, ``flex_attention``'s block mask: a None there would
        let every token see the future).

        Example:
            >>> adapter.text_model(input_ids=ids, attention_mask=adapter.unpadded_masks(), use_cache=False)
        """
        types = set(getattr(self.config, "layer_types", None) or ())
        if not types or not types <= {"full_attention", "linear_attention"}:
            return None
        attention = getattr(self.config, "_attn_implementation", None)
        if "full_attention" in types and attention not in _CAUSAL_WITHOUT_MASK:
            return None
        forward = type(self.text_model).forward
        if forward not in _TAKES_MASK_MAPPING:
            try:
                source = inspect.getsource(forward)
            except (OSError, TypeError):
                source = ""
            _TAKES_MASK_MAPPING[forward] = "isinstance(causal_mask_mapping := attention_mask, dict)" in source
        return dict.fromkeys(types) if _TAKES_MASK_MAPPING[forward] else None

    def __repr__(self) -> str:
        n_lin = self.layer_types.count("linear_attention")
        return (f"{type(self).__name__}(family={self.family!r}, n_layers={self.n_layers}, d_model={self.d_model}, "
                f"linear_attention_layers={n_lin})")


class Qwen3Adapter(QwenAdapter):
    family = "qwen3"
    label = "Qwen3 (dense)"
    model_types = ("qwen3",)


class Qwen3MoeAdapter(Qwen3Adapter):
    family = "qwen3_moe"
    label = "Qwen3-MoE"
    model_types = ("qwen3_moe",)


class Qwen3NextAdapter(Qwen3Adapter):
    family = "qwen3_next"
    label = "Qwen3-Next"
    model_types = ("qwen3_next",)
    mixer_attrs = {"full_attention": "self_attn", "linear_attention": "linear_attn"}
    hybrid = True


class Qwen3_5Adapter(Qwen3Adapter):
    family = "qwen3_5"
    label = "Qwen3.5 (dense)"
    # "qwen3_5" too: AutoModelForCausalLM.from_config(Qwen3_5Config) builds a text-only model.
    model_types = ("qwen3_5_text", "qwen3_5")
    mixer_attrs = {"full_attention": "self_attn", "linear_attention": "linear_attn"}
    hybrid = True


class Qwen3_5MoeAdapter(Qwen3_5Adapter):
    family = "qwen3_5_moe"
    label = "Qwen3.5-MoE"
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")


class Qwen3_5VLAdapter(Qwen3_5Adapter):
    family = "qwen3_5_vl"
    label = "Qwen3.5 VL wrapper (...ForConditionalGeneration)"
    model_types = ("qwen3_5",)
    text_model_paths = ("model.language_model", "language_model")


class Qwen3_5MoeVLAdapter(Qwen3_5MoeAdapter):
    family = "qwen3_5_moe_vl"
    label = "Qwen3.5-MoE VL wrapper (...ForConditionalGeneration)"
    model_types = ("qwen3_5_moe",)
    text_model_paths = ("model.language_model", "language_model")


# VL wrappers first: their model_type also names the text-only model built from a VL config.
ADAPTERS: tuple[type[QwenAdapter], ...] = (
    Qwen3_5VLAdapter, Qwen3_5MoeVLAdapter, Qwen3Adapter, Qwen3MoeAdapter, Qwen3NextAdapter, Qwen3_5Adapter,
    Qwen3_5MoeAdapter)


# The families with Gated DeltaNet layers, from the adapters' own declarations.
HYBRID_FAMILIES: tuple[str, ...] = tuple(a.family for a in ADAPTERS if a.hybrid)


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def supported_families() -> list[str]:
    """Human-readable names of the supported families, e.g. ``["Qwen3 (dense)", ...]``."""
    return [a.label for a in ADAPTERS]


def get_adapter(model: nn.Module) -> QwenAdapter:
    """The adapter for a loaded Qwen model, chosen from its config's ``model_type`` and module tree.

    Args:
        model: a transformers Qwen3 / Qwen3-MoE / Qwen3-Next / Qwen3.5 / Qwen3.5-MoE causal LM, a Qwen3.5 VL
            ``...ForConditionalGeneration`` wrapper, or their bare text model.

    Returns:
        a ``QwenAdapter`` exposing ``layers``, ``n_layers``, ``d_model``, ``layer_types``, ``final_norm``,
        ``embed``, ``unembed`` and ``family``.

    Raises:
        TypeError: for a model of any other family, naming the supported ones.

    Example:
        >>> get_adapter(model).layers[-1]   # the last decoder block (pre-final-norm output)
    """
    if isinstance(model, QwenAdapter):
        return model
    for adapter_cls in ADAPTERS:
        if adapter_cls.matches(model):
            return adapter_cls(model)
    known = sorted({t for a in ADAPTERS for t in a.model_types})
    raise TypeError(
        f"{type(model).__name__} (model_type {_model_type(model)!r}) is not a supported model family. "
        f"Supported: {', '.join(supported_families())} (config.model_type one of {known}). "
        "Load a Qwen3 / Qwen3.5 checkpoint, e.g. AutoModelForCausalLM.from_pretrained('Qwen/Qwen3.5-2B-Base').")
