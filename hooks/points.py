"""The one vocabulary of hook points, and the single parser that reads every accepted spelling.

Canonical names (``n`` is the 0-based decoder block; negative ``n`` counts from the end when the model is known):

===================  =====================================================================  ==============
name                 what it is                                                             writable
===================  =====================================================================  ==============
``embed``            token embeddings [B, T, d_model] (= ``resid_pre.0``)                    yes
``resid_pre.{n}``    residual stream entering block n (``hidden_states[n]``)                yes
``resid_mid.{n}``    residual after the mixer, before the MLP (input of post_attention_norm) capture only
``resid_post.{n}``   output of block n: the Qwen-Scope SAE site; ``hidden_states[n+1]``      yes
                     for n < last, the *pre-final-norm* output for the last block
``attn_out.{n}``     output of the token mixer (full attention or Gated DeltaNet)           yes
``mlp_out.{n}``      output of the MLP (dense or MoE)                                       yes
``mlp_post.{n}``     dense MLP's activation ``act(gate) * up`` [B, T, d_mlp] (down_proj in)  yes
``attn_q.{n}``       full attention: query / key / value projections [B, T, H, head_dim],   capture only
``attn_k.{n}``       before q/k norm and RoPE (Qwen3.5's query half, its gate left out)
``attn_v.{n}``
``attn_z.{n}``       full attention: per-head output entering o_proj [B, T, H, head_dim]     capture only
                     (for Qwen3.5 after its output gate)
``attn_pattern.{n}`` full attention: softmax weights [B, T, H, T_k] (query position first,   capture only
                     as every point here); needs ``attn_implementation="eager"``
``gdn_beta.{n}``     Gated DeltaNet: write strength ``sigmoid(b)`` [B, T, Hv]                capture only
``gdn_decay.{n}``    Gated DeltaNet: log decay ``g = -exp(A_log) softplus(a + dt_bias)``     capture only
                     [B, T, Hv] (the state is multiplied by ``exp(g)`` each token)
``gdn_core.{n}``     Gated DeltaNet: the recurrence's output before the gated norm          capture only
                     [B, T, Hv, Dv]
===================  =====================================================================  ==============

The attention and GDN internals are read from the projection and norm modules transformers runs; a forward that
fuses them away (``flashqla_kernels``' fused GDN layer merges ``in_proj_b`` / ``in_proj_a``) records nothing there,
which ``Capture`` reports when the point is read.

Aliases, so TransformerLens / sae-lens / Hugging Face users are at home: ``hook_embed``, ``blocks.{n}.hook_resid_post``
(also ``hook_out``), ``blocks.{n}.hook_resid_pre`` (``hook_in``), ``blocks.{n}.hook_resid_mid``,
``blocks.{n}.hook_attn_out`` (``hook_linear_attn_out``, ``blocks.{n}.attn.hook_out``, ``blocks.{n}.linear_attn.hook_out``),
``blocks.{n}.hook_mlp_out`` (``blocks.{n}.mlp.hook_out``), ``blocks.{n}.mlp.hook_post``, ``blocks.{n}.attn.hook_q`` /
``hook_k`` / ``hook_v`` / ``hook_z`` / ``hook_pattern``, ``blocks.{n}.linear_attn.hook_beta`` / ``hook_decay`` /
``hook_core``, and HF module paths ``model.embed_tokens``, ``model.layers.{n}`` (sae-lens ``hf_hook_name``),
``model.language_model.layers.{n}``, ``layers.{n}``, plus ``.self_attn`` / ``.linear_attn`` / ``.mlp`` suffixes for
the mixer and MLP outputs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GLOBAL_KINDS", "HookPoint", "KINDS", "WRITABLE_KINDS", "parse_hook_name", "resid_post", "valid_hook_names"]

KINDS = ("embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_post", "attn_q", "attn_k",
         "attn_v", "attn_z", "attn_pattern", "gdn_beta", "gdn_decay", "gdn_core")
WRITABLE_KINDS = ("embed", "resid_pre", "resid_post", "attn_out", "mlp_out", "mlp_post")
# Kinds of the whole model rather than of one block: their name carries no layer (HookPoint.layer is 0).
GLOBAL_KINDS = ("embed",)

_TL_SUFFIX = {
    "hook_resid_pre": "resid_pre", "hook_in": "resid_pre", "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post", "hook_out": "resid_post", "hook_attn_out": "attn_out",
    "hook_linear_attn_out": "attn_out", "attn.hook_out": "attn_out", "linear_attn.hook_out": "attn_out",
    "mlp.hook_out": "mlp_out", "hook_mlp_out": "mlp_out", "mlp.hook_post": "mlp_post",
    "attn.hook_q": "attn_q", "attn.hook_k": "attn_k", "attn.hook_v": "attn_v", "attn.hook_z": "attn_z",
    "attn.hook_pattern": "attn_pattern", "linear_attn.hook_beta": "gdn_beta", "linear_attn.hook_decay": "gdn_decay",
    "linear_attn.hook_core": "gdn_core",
}
_GLOBAL_NAMES = {"embed": "embed", "hook_embed": "embed", "model.embed_tokens": "embed", "embed_tokens": "embed",
                 "model.language_model.embed_tokens": "embed"}
_HF_SUFFIX = {None: "resid_post", "self_attn": "attn_out", "linear_attn": "attn_out", "mlp": "mlp_out"}

_CANONICAL = re.compile(r"^(?P<kind>" + "|".join(KINDS) + r")\.(?P<n>-?\d+)$")
_TL = re.compile(r"^blocks\.(?P<n>-?\d+)\.(?P<suffix>" + "|".join(re.escape(s) for s in _TL_SUFFIX) + r")$")
_HF = re.compile(r"^(?:model\.)?(?:model\.)?(?:language_model\.)?layers\.(?P<n>-?\d+)"
                 r"(?:\.(?P<suffix>self_attn|linear_attn|mlp))?$")


@dataclass(frozen=True, order=True)
class HookPoint:
    """A parsed hook point: ``kind`` (one of ``KINDS``) at decoder block ``layer`` (0-based, non-negative once
    the model's depth is known)."""

    kind: str
    layer: int

    @property
    def name(self) -> str:
        """The canonical spelling, e.g. ``"resid_post.3"`` (``"embed"`` for a model-wide point)."""
        return self.kind if self.kind in GLOBAL_KINDS else f"{self.kind}.{self.layer}"

    @property
    def writable(self) -> bool:
        return self.kind in WRITABLE_KINDS

    def __str__(self) -> str:
        return self.name


def resid_post(layer: int) -> str:
    """The canonical name of block ``layer``'s output, the site every Qwen-Scope SAE reads; the one place the rest of
    the project gets that name from.

    Args:
        layer: decoder block (0-based; negative counts from the end once ``parse_hook_name`` knows the depth).

    Returns:
        ``HookPoint("resid_post", layer).name``.

    Example:
        >>> resid_post(12)
        'resid_post.12'
    """
    return HookPoint("resid_post", int(layer)).name


def valid_hook_names(n_layers: int | None = None) -> list[str]:
    """Canonical names, with ranges when ``n_layers`` is known (``"resid_post.0 … resid_post.23"``)."""
    if n_layers is None:
        return [kind if kind in GLOBAL_KINDS else f"{kind}.{{n}}" for kind in KINDS]
    return [kind if kind in GLOBAL_KINDS else f"{kind}.0 … {kind}.{n_layers - 1}" if n_layers > 1 else f"{kind}.0"
            for kind in KINDS]


def _unknown(name: object, n_layers: int | None, why: str) -> ValueError:
    return ValueError(
        f"unknown hook point {name!r} ({why}). Valid names: {', '.join(valid_hook_names(n_layers))}; aliases: "
        "hook_embed, blocks.{n}.hook_resid_post / hook_resid_pre / hook_resid_mid / hook_attn_out / hook_mlp_out, "
        "blocks.{n}.mlp.hook_post, blocks.{n}.attn.hook_q / hook_k / hook_v / hook_z / hook_pattern, "
        "blocks.{n}.linear_attn.hook_beta / hook_decay / hook_core, model.layers.{n}[.self_attn|.linear_attn|.mlp]. "
        "See hooks/points.py.")


def parse_hook_name(name: str | HookPoint, n_layers: int | None = None) -> HookPoint:
    """Parse any accepted spelling of a hook point into its canonical ``HookPoint``.

    Args:
        name: e.g. ``"resid_post.3"``, ``"blocks.3.hook_resid_post"``, ``"model.layers.3"``, ``"resid_post.-1"``,
            or a ``HookPoint``.
        n_layers: the model's number of decoder blocks; when given, the layer is range-checked and a negative
            layer counts from the end.

    Returns:
        ``HookPoint(kind, layer)``; ``.name`` is the canonical spelling.

    Raises:
        ValueError: for an unknown spelling or a layer out of range, listing the valid names.

    Example:
        >>> parse_hook_name("blocks.3.hook_resid_post").name
        'resid_post.3'
    """
    if isinstance(name, HookPoint):
        kind, layer = name.kind, name.layer
    elif not isinstance(name, str):
        raise _unknown(name, n_layers, f"expected a str, got {type(name).__name__}")
    elif name.strip() in _GLOBAL_NAMES:
        return HookPoint(_GLOBAL_NAMES[name.strip()], 0)
    elif m := _CANONICAL.match(name.strip()):
        kind, layer = m["kind"], int(m["n"])
    elif m := _TL.match(name.strip()):
        kind, layer = _TL_SUFFIX[m["suffix"]], int(m["n"])
    elif m := _HF.match(name.strip()):
        kind, layer = _HF_SUFFIX[m["suffix"]], int(m["n"])
    else:
        raise _unknown(name, n_layers, "not a recognised spelling")
    if n_layers is not None:
        if not -n_layers <= layer < n_layers:
            raise _unknown(name, n_layers, f"layer {layer} out of range for a model with {n_layers} blocks")
        layer %= n_layers
    elif layer < 0:
        raise _unknown(name, n_layers, "a negative layer needs the model's depth; pass n_layers")
    return HookPoint(kind, layer)
