"""The one vocabulary of hook points, and the single parser that reads every accepted spelling.

Canonical names (``n`` is the 0-based decoder block; negative ``n`` counts from the end when the model is known):

==================  =====================================================================  ==============
name                what it is                                                             writable
==================  =====================================================================  ==============
``resid_pre.{n}``   residual stream entering block n (``hidden_states[n]``)                yes
``resid_mid.{n}``   residual after the mixer, before the MLP (input of post_attention_norm) capture only
``resid_post.{n}``  output of block n: the Qwen-Scope SAE site; ``hidden_states[n+1]``      yes
                    for n < last, the *pre-final-norm* output for the last block
``attn_out.{n}``    output of the token mixer (full attention or Gated DeltaNet)           yes
``mlp_out.{n}``     output of the MLP (dense or MoE)                                       yes
==================  =====================================================================  ==============

Aliases, so TransformerLens / sae-lens / Hugging Face users are at home: ``blocks.{n}.hook_resid_post``
(also ``hook_out``), ``blocks.{n}.hook_resid_pre`` (``hook_in``), ``blocks.{n}.hook_resid_mid``,
``blocks.{n}.hook_attn_out`` (``hook_linear_attn_out``, ``blocks.{n}.attn.hook_out``, ``blocks.{n}.linear_attn.hook_out``),
``blocks.{n}.hook_mlp_out`` (``blocks.{n}.mlp.hook_out``), and HF module paths ``model.layers.{n}``
(sae-lens ``hf_hook_name``), ``model.language_model.layers.{n}``, ``layers.{n}``, plus ``.self_attn`` /
``.linear_attn`` / ``.mlp`` suffixes for the mixer and MLP outputs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["HookPoint", "KINDS", "WRITABLE_KINDS", "parse_hook_name", "resid_post", "valid_hook_names"]

KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
WRITABLE_KINDS = ("resid_pre", "resid_post", "attn_out", "mlp_out")

_TL_SUFFIX = {
    "hook_resid_pre": "resid_pre", "hook_in": "resid_pre", "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post", "hook_out": "resid_post", "hook_attn_out": "attn_out",
    "hook_linear_attn_out": "attn_out", "attn.hook_out": "attn_out", "linear_attn.hook_out": "attn_out",
    "mlp.hook_out": "mlp_out", "hook_mlp_out": "mlp_out",
}
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
        """The canonical spelling, e.g. ``"resid_post.3"``."""
        return f"{self.kind}.{self.layer}"

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
        return [f"{kind}.{{n}}" for kind in KINDS]
    return [f"{kind}.0 … {kind}.{n_layers - 1}" if n_layers > 1 else f"{kind}.0" for kind in KINDS]


def _unknown(name: object, n_layers: int | None, why: str) -> ValueError:
    return ValueError(
        f"unknown hook point {name!r} ({why}). Valid names: {', '.join(valid_hook_names(n_layers))}; aliases: "
        "blocks.{n}.hook_resid_post / hook_resid_pre / hook_resid_mid / hook_attn_out / hook_mlp_out, "
        "model.layers.{n}[.self_attn|.linear_attn|.mlp]. See hooks/points.py.")


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
