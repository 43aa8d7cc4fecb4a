"""Put transformers' Qwen3-Next / Qwen3.5 / Qwen3.5-MoE models on our kernels, and take them off again.

Two patches, each explicit, idempotent and restorable (importing this package changes nothing):

- ``patch_transformers()``: the op patch (``op``): the Gated DeltaNet kernel functions transformers' GDN layers call
  point at our ``chunk_gated_delta_rule`` / ``recurrent_gated_delta_rule``; ``fused_layer=True`` adds the layer patch.
- ``patch_gdn_layers()``: the layer patch: the ``forward`` of the families' classes (``families``) replaced, each by
  its module: the GDN layers' whole forward on the fused path (``gdn``), the zero-centred RMSNorms (``norms``), the
  dense SiLU MLPs (``mlp``), the gated full-attention layers (``attention``) and the decoder layers' residual adds
  (``decoder``); every replacement hands calls it does not handle to transformers' own forward.

Every swap is recorded in one registry (``registry``); the ``unpatch_*`` verbs put back exactly what was there, and
the context managers restore exactly the state found on entry.

Example:
    >>> with patched_transformers(fused_layer=True):
    ...     logits = model(ids, use_cache=False).logits
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from flashqla_kernels import dispatch
from flashqla_kernels.patching import attention as attention_patch
from flashqla_kernels.patching import decoder as decoder_patch
from flashqla_kernels.patching import families, gdn, norms, op, registry
from flashqla_kernels.patching import mlp as mlp_patch
from flashqla_kernels.patching.attention import attention_fallback_reason

__all__ = ["patch_transformers", "unpatch_transformers", "patched_transformers", "is_patched", "patch_gdn_layers",
           "unpatch_gdn_layers", "patched_gdn_layers", "gdn_layers_patched", "attention_fallback_reason",
           "LAYER_GROUPS"]

LAYER_GROUPS = (gdn.GROUP, norms.GROUP, mlp_patch.GROUP, attention_patch.GROUP, decoder_patch.GROUP)


def _patch_forwards(patch, make) -> list[str]:
    """Replace ``forward`` of ``patch.ROLE``'s class in every family by ``make(original, modeling module)``."""
    patched = []
    for family, module, cls in families.classes(patch.ROLE):
        target = f"{family.module_name}.{cls.__name__}.forward"
        registry.swap(cls, "forward", make(registry.original(cls, "forward"), module), group=patch.GROUP,
                      target=target)
        patched.append(target)
    return patched


def patch_gdn_layers(backend: str | None = None, rms_norms: bool = True, mlp: bool = True,
                     attention: bool = True, decoder: bool = True) -> list[str]:
    """Run the GDN layers of Qwen3-Next / Qwen3.5 / Qwen3.5-MoE on the fused layer path.

    Args:
        backend: None (TileLang kernels for CUDA sm_90 tensors, torch elsewhere), "torch" or "tilelang";
            used for the glue stages and the chunk op.
        rms_norms: also put the zero-centred RMSNorm classes on the RMSNorm kernel (a no-op off Hopper).
        mlp: also put the dense SiLU MLP classes on the fused SwiGLU (a no-op off Hopper).
        attention: also put the gated full-attention classes on the fused q/k norm + RoPE and gate kernels (off
            Hopper: the same wiring with transformers' operations, equal to its forward).
        decoder: also put the decoder layers on the wiring that fuses the residual adds into the post-attention
            norm (with ``rms_norms``) and the dense MLP's ``down_proj`` (with ``mlp``); off Hopper it makes
            transformers' own calls in transformers' order.

    Returns:
        The patched targets, e.g. ``["transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet.forward"]``.
        Calling again replaces the previous layer patch (the originals saved first stay saved).

    Raises:
        ValueError: an unknown ``backend``. RuntimeError: this transformers version has no GDN class to patch.

    Example:
        >>> patch_gdn_layers()
        >>> logits = model(ids, use_cache=False).logits
        >>> unpatch_gdn_layers()
    """
    dispatch.check_backend(backend)
    unpatch_gdn_layers()
    patched = _patch_forwards(gdn, lambda f, module: gdn.make_forward(f, backend))
    if not patched:
        raise RuntimeError("patch_gdn_layers found no GDN class to patch in "
                           f"{', '.join(f.module_name for f in families.FAMILIES)}; transformers >= 5.17 is needed")
    if rms_norms:
        patched += _patch_forwards(norms, lambda f, module: norms.make_forward(f, backend))
    if mlp:
        patched += _patch_forwards(mlp_patch, lambda f, module: mlp_patch.make_forward(f, backend))
    if attention:
        patched += _patch_forwards(attention_patch, lambda f, module: attention_patch.make_forward(f, backend, module))
    if decoder:
        patched += _patch_forwards(decoder_patch, lambda f, module: decoder_patch.make_forward(
            f, backend, rms_norms, mlp))
    return patched


def unpatch_gdn_layers() -> list[str]:
    """Restore transformers' own forwards of every class the layer patch replaced (the op patch stays). Safe to call
    when nothing is patched.

    Returns:
        The restored targets.
    """
    return registry.restore(*LAYER_GROUPS)


def gdn_layers_patched() -> bool:
    """Whether any class currently runs a forward of the layer patch."""
    return bool(registry.swaps(*LAYER_GROUPS))


@contextlib.contextmanager
def patched_gdn_layers(backend: str | None = None, rms_norms: bool = True, mlp: bool = True,
                       attention: bool = True, decoder: bool = True) -> Iterator[list[str]]:
    """Context manager form of ``patch_gdn_layers``; on exit restores exactly the state found on entry.

    Example:
        >>> with patched_gdn_layers(backend="torch"):
        ...     out = model.generate(ids, max_new_tokens=8)
    """
    saved = registry.snapshot()
    try:
        yield patch_gdn_layers(backend, rms_norms, mlp, attention, decoder)
    finally:
        registry.restore_snapshot(saved)


def patch_transformers(backend: str | None = None, model: torch.nn.Module | None = None,
                       fused_layer: bool = False) -> list[str]:
    """Route the GDN layers of transformers' Qwen3-Next / Qwen3.5 / Qwen3.5-MoE onto ``chunk_gated_delta_rule`` and
    ``recurrent_gated_delta_rule``.

    Args:
        backend: passed to our op on every call: None (automatic: TileLang kernels on sm_90 CUDA tensors without
            grad, else torch), "torch" or "tilelang".
        model: optional model whose GDN layers hold the functions as instance attributes (transformers < 5.15).
        fused_layer: also run the GDN layers' whole forward on the fused layer path (``patch_gdn_layers``, with its
            RMSNorm, MLP, attention and decoder patches); False leaves a layer patch made earlier in place
            (``unpatch_transformers`` removes both).

    Returns:
        The patched targets, e.g. ``["transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule",
        ...]``. Calling again (e.g. with another backend) re-points them; the originals saved first stay saved.

    Raises:
        ValueError: an unknown ``backend``. RuntimeError: nothing to patch in this transformers version.

    Example:
        >>> patch_transformers()
        >>> model.generate(ids)          # GDN layers run our op
        >>> unpatch_transformers()
    """
    dispatch.check_backend(backend)
    patched = op.patch_globals(backend)
    if model is not None:
        patched += op.patch_instances(model, backend)
    if fused_layer:
        patched += patch_gdn_layers(backend)
    if not patched:
        raise RuntimeError("patch_transformers found nothing to patch: this transformers version has no "
                           f"{'/'.join(op.GLOBALS)} globals in {', '.join(f.module_name for f in families.FAMILIES)}; "
                           "for transformers < 5.15 pass model=<your Qwen3-Next / Qwen3.5 model> to patch its layers' "
                           "instance attributes")
    return patched


def unpatch_transformers() -> list[str]:
    """Restore everything ``patch_transformers`` and ``patch_gdn_layers`` replaced, newest first. Safe to call when
    nothing is patched.

    Returns:
        The restored targets.
    """
    return registry.restore()


def is_patched() -> bool:
    """Whether any transformers function or forward currently points at ours (the op or the layer patch)."""
    return bool(registry.swaps())


@contextlib.contextmanager
def patched_transformers(backend: str | None = None, model: torch.nn.Module | None = None,
                         fused_layer: bool = False) -> Iterator[list[str]]:
    """Context manager form of ``patch_transformers``; on exit restores exactly the state found on entry (unpatched,
    or patched with whatever backend, layer patch and options were in force before).

    Example:
        >>> with patched_transformers(backend="torch"):
        ...     logits = model(ids).logits
    """
    saved = registry.snapshot()
    try:
        yield patch_transformers(backend, model, fused_layer)
    finally:
        registry.restore_snapshot(saved)
