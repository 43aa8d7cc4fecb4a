"""The op patch: transformers' Gated DeltaNet kernel functions pointed at our ``chunk_gated_delta_rule`` /
``recurrent_gated_delta_rule``.

transformers 5.15+ look the kernel functions up as module globals of each modeling file on every call
(``torch_chunk_gated_delta_rule`` for prefill, ``torch_recurrent_gated_delta_rule`` for the T = 1 decode step), so
replacing those globals switches every model of the family at once, including models built later (from 5.25 the
global is a ``kernels`` function module; the forward still calls the global, so the swap is the same). Older versions
(4.57-5.14) keep the functions as instance attributes of each GDN layer (``chunk_gated_delta_rule``,
``recurrent_gated_delta_rule``): :func:`patch_instances` replaces those on a given model.

q/k reach the kernel with Hv heads up to 5.22 (the layer repeats them) and with Hk heads from 5.23: both are valid
GVA inputs for our op (ratio 1, or Hv/Hk), so no version switch is needed. Extra kwargs the layer passes
(``use_cache``, ``chunk_size``...) are accepted and ignored; ``cu_seqlens`` is honoured (transformers' own torch
fallback rejects it).
"""
from __future__ import annotations

import torch

from flashqla_kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from flashqla_kernels.patching import families, registry

__all__ = ["GROUP", "GLOBALS", "ATTRS", "chunk_replacement", "recurrent_replacement", "patch_globals",
           "patch_instances", "transformers_op_parts"]

GROUP = "op"
# module global (5.15+) / instance attribute (<5.15) -> which of our ops replaces it
GLOBALS = {"torch_chunk_gated_delta_rule": "chunk", "torch_recurrent_gated_delta_rule": "recurrent"}
ATTRS = {"chunk_gated_delta_rule": "chunk", "recurrent_gated_delta_rule": "recurrent"}


def chunk_replacement(backend: str | None):
    """transformers' ``torch_chunk_gated_delta_rule`` call convention on our ``chunk_gated_delta_rule``."""
    def chunk_gated_delta_rule_for_transformers(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                                output_final_state=False, use_qk_l2norm_in_kernel=False,
                                                cu_seqlens=None, scale=None, **kwargs):
        return chunk_gated_delta_rule(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                      backend=backend)

    return registry.mark(chunk_gated_delta_rule_for_transformers, backend)


def recurrent_replacement(backend: str | None):
    """transformers' ``torch_recurrent_gated_delta_rule`` call convention on our ``recurrent_gated_delta_rule``."""
    def recurrent_gated_delta_rule_for_transformers(query, key, value, g, beta, initial_state=None,
                                                    output_final_state=False, use_qk_l2norm_in_kernel=False,
                                                    cu_seqlens=None, scale=None, **kwargs):
        return recurrent_gated_delta_rule(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                          backend=backend)

    return registry.mark(recurrent_gated_delta_rule_for_transformers, backend)


def _replacement(kind: str, backend: str | None):
    return chunk_replacement(backend) if kind == "chunk" else recurrent_replacement(backend)


def patch_globals(backend: str | None) -> list[str]:
    """Point the kernel-function globals of every family's modeling module at our ops.

    Returns:
        The patched targets, e.g. ``"transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule"``.
    """
    patched = []
    for family, module in families.modules():
        for attr, kind in GLOBALS.items():
            if hasattr(module, attr):
                target = f"{family.module_name}.{attr}"
                registry.swap(module, attr, _replacement(kind, backend), group=GROUP, target=target)
                patched.append(target)
    return patched


def patch_instances(model: torch.nn.Module, backend: str | None) -> list[str]:
    """Point the kernel-function instance attributes of ``model``'s layers (transformers < 5.15) at our ops.

    Returns:
        The patched targets, e.g. ``"model.layers.0.linear_attn.chunk_gated_delta_rule"``.
    """
    patched = []
    for mod_name, module in model.named_modules():
        for attr, kind in ATTRS.items():
            if callable(vars(module).get(attr)):
                target = f"{mod_name}.{attr}"
                registry.swap(module, attr, _replacement(kind, backend), group=GROUP, target=target)
                patched.append(target)
    return patched


def transformers_op_parts(fn) -> tuple:
    """What one of transformers' kernel-function globals runs: ``(implementation, torch_function)``.

    The global is a wrapper closing over both (the implementation is FLA's function where FLA is importable, else
    the torch function itself); from transformers 5.25 that wrapper sits inside a ``kernels`` ``Func`` module whose
    forward closes over it. Anything else (one of our replacements, a plain function) is its own implementation.

    Example:
        >>> impl, pure = transformers_op_parts(modeling_qwen3_5.torch_chunk_gated_delta_rule)
        >>> impl.__module__.startswith("fla")  # transformers would run FLA's kernel
    """
    if isinstance(fn, torch.nn.Module):
        # the kernels package names it ``func``; any callable the forward closes over is the wrapper
        free = _free_vars(type(fn).forward)
        fn = free.get("func") or next((v for v in free.values() if callable(v)), fn)
    free = _free_vars(fn)
    pure = free.get("torch_function", getattr(fn, "__wrapped__", fn))
    return free.get("implementation", pure), pure


def _free_vars(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}
