"""Put transformers' Qwen3-Next / Qwen3.5 / Qwen3.5-MoE Gated DeltaNet layers on our op, and take them off again.

transformers 5.15-5.24 look the kernel functions up as module globals of each modeling file on every call
(``torch_chunk_gated_delta_rule`` for prefill, ``torch_recurrent_gated_delta_rule`` for the T = 1 decode step), so
patching those globals switches every model of the family at once, including models built later. Older versions
(4.57-5.14) keep the functions as instance attributes of each GDN layer: pass ``model=`` to patch those.

q/k reach the kernel with Hv heads up to 5.22 (the layer repeats them) and with Hk heads from 5.23: both are valid
GVA inputs for our op (ratio 1, or Hv/Hk), so no version switch is needed. Extra kwargs the layer passes
(``use_cache``, ``chunk_size``...) are accepted and ignored; ``cu_seqlens`` is honoured (transformers' own torch
fallback rejects it).

``fused_layer=True`` also replaces the GDN layers' whole forward with the fused layer path
(``flashqla_kernels.gdn_layer``: token-major conv + gates + l2norm, our op, gated RMSNorm); its fallback for calls it
does not handle is transformers' forward, which then runs the patched op.

Patching is explicit, idempotent and restorable: importing this module changes nothing.
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from flashqla_kernels.gated_delta_rule.api import chunk_gated_delta_rule, recurrent_gated_delta_rule
from flashqla_kernels.gdn_layer import patch as _layer_patch

__all__ = ["patch_transformers", "unpatch_transformers", "patched_transformers", "is_patched", "MODULES"]

MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)
# module global (5.15+) / instance attribute (<5.15) -> which of our ops replaces it
_GLOBALS = {"torch_chunk_gated_delta_rule": "chunk", "torch_recurrent_gated_delta_rule": "recurrent"}
_ATTRS = {"chunk_gated_delta_rule": "chunk", "recurrent_gated_delta_rule": "recurrent"}
_MARK = "_flashqla_backend"

_saved_globals: dict[tuple[str, str], Any] = {}
_saved_attrs: list[tuple[torch.nn.Module, str, Any]] = []


def _make_chunk(backend: str | None):
    def chunk_gated_delta_rule_for_transformers(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                                output_final_state=False, use_qk_l2norm_in_kernel=False,
                                                cu_seqlens=None, scale=None, **kwargs):
        return chunk_gated_delta_rule(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                      backend=backend)

    setattr(chunk_gated_delta_rule_for_transformers, _MARK, backend)
    return chunk_gated_delta_rule_for_transformers


def _make_recurrent(backend: str | None):
    def recurrent_gated_delta_rule_for_transformers(query, key, value, g, beta, initial_state=None,
                                                    output_final_state=False, use_qk_l2norm_in_kernel=False,
                                                    cu_seqlens=None, scale=None, **kwargs):
        return recurrent_gated_delta_rule(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                          backend=backend)

    setattr(recurrent_gated_delta_rule_for_transformers, _MARK, backend)
    return recurrent_gated_delta_rule_for_transformers


def _replacement(kind: str, backend: str | None):
    return _make_chunk(backend) if kind == "chunk" else _make_recurrent(backend)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:  # this transformers version lacks the family
        return None


def patch_transformers(backend: str | None = None, model: torch.nn.Module | None = None,
                       fused_layer: bool = False) -> list[str]:
    """Route the GDN layers of transformers' Qwen3-Next / Qwen3.5 / Qwen3.5-MoE onto ``chunk_gated_delta_rule`` and
    ``recurrent_gated_delta_rule``.

    Args:
        backend: passed to our op on every call: None (automatic: TileLang kernels on sm_90 CUDA tensors without
            grad, else torch), "torch" or "tilelang".
        model: optional model whose GDN layers hold the functions as instance attributes (transformers < 5.15).
        fused_layer: also run the GDN layers' whole forward on the fused layer path (``patch_gdn_layers``, with its
            RMSNorm and MLP patches); False leaves a fused-layer patch made earlier in place
            (``unpatch_transformers`` removes both).

    Returns:
        The patched targets, e.g. ``["transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule",
        ...]``. Calling again (e.g. with another backend) re-points them; the originals saved first stay saved.

    Example:
        >>> patch_transformers()
        >>> model.generate(ids)          # GDN layers run our op
        >>> unpatch_transformers()
    """
    if backend not in (None, "torch", "tilelang"):
        raise ValueError(f"backend must be one of None, 'torch', 'tilelang'; got {backend!r}")
    patched = []
    for name in MODULES:
        module = _import(name)
        for attr, kind in _GLOBALS.items():
            if module is None or not hasattr(module, attr):
                continue
            current = getattr(module, attr)
            if not hasattr(current, _MARK):
                _saved_globals[(name, attr)] = current
            setattr(module, attr, _replacement(kind, backend))
            patched.append(f"{name}.{attr}")
    if model is not None:
        patched += _patch_instances(model, backend)
    if fused_layer:
        patched += _layer_patch.patch_gdn_layers(backend)
    if not patched:
        raise RuntimeError("patch_transformers found nothing to patch: this transformers version has no "
                           f"{'/'.join(_GLOBALS)} globals in {', '.join(MODULES)}; for transformers < 5.15 pass "
                           "model=<your Qwen3-Next / Qwen3.5 model> to patch its layers' instance attributes")
    return patched


def _patch_instances(model: torch.nn.Module, backend: str | None) -> list[str]:
    patched = []
    for mod_name, module in model.named_modules():
        for attr, kind in _ATTRS.items():
            current = module.__dict__.get(attr)
            if current is None or not callable(current):
                continue
            if not hasattr(current, _MARK):
                _saved_attrs.append((module, attr, current))
            setattr(module, attr, _replacement(kind, backend))
            patched.append(f"{mod_name}.{attr}")
    return patched


def unpatch_transformers() -> list[str]:
    """Restore every function ``patch_transformers`` replaced. Safe to call when nothing is patched.

    Returns:
        The restored targets.
    """
    restored = []
    for (name, attr), original in _saved_globals.items():
        setattr(importlib.import_module(name), attr, original)
        restored.append(f"{name}.{attr}")
    for module, attr, original in _saved_attrs:
        setattr(module, attr, original)
        restored.append(f"{type(module).__name__}.{attr}")
    _saved_globals.clear()
    _saved_attrs.clear()
    return restored + _layer_patch.unpatch_gdn_layers()


def is_patched() -> bool:
    """Whether any transformers function currently points at our op (or a GDN forward at the fused layer)."""
    return bool(_saved_globals or _saved_attrs) or _layer_patch.gdn_layers_patched()


def _current_backend() -> str | None:
    for name, attr in _saved_globals:
        return getattr(getattr(importlib.import_module(name), attr), _MARK, None)
    for module, attr, _ in _saved_attrs:
        return getattr(getattr(module, attr), _MARK, None)
    return None


@contextlib.contextmanager
def patched_transformers(backend: str | None = None, model: torch.nn.Module | None = None,
                         fused_layer: bool = False) -> Iterator[list[str]]:
    """Context manager form of ``patch_transformers``; on exit restores exactly the state found on entry
    (unpatched, or patched with the backend in force before, with or without the fused layer).

    Example:
        >>> with patched_transformers(backend="torch"):
        ...     logits = model(ids).logits
    """
    ops_were_patched, previous = bool(_saved_globals or _saved_attrs), _current_backend()
    layer_was_patched, previous_layer = _layer_patch.gdn_layers_patched(), _layer_patch._current_backend()
    previous_norms, previous_mlps = _layer_patch._norms_patched(), _layer_patch._mlps_patched()
    previous_attention = _layer_patch._attention_patched()
    try:
        yield patch_transformers(backend, model, fused_layer)
    finally:
        unpatch_transformers()
        if ops_were_patched:
            patch_transformers(previous, model)
        if layer_was_patched:
            _layer_patch.patch_gdn_layers(previous_layer, previous_norms, previous_mlps, previous_attention)
