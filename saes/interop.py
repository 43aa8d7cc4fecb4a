"""Conversion to and from sae-lens 6.x ``TopKSAE`` with identical encode/decode.

sae-lens stores the transpose of the release orientation: ``W_enc [d_model, d_sae]`` and ``W_dec [d_sae, d_model]``.
Qwen-Scope SAEs map onto ``TopKSAEConfig(apply_b_dec_to_input=False, normalize_activations="none",
rescale_acts_by_decoder_norm=False)``. Going the other way, sae-lens TopK SAEs that subtract ``b_dec`` from the input
or rescale by decoder norms are folded exactly into plain weights; input normalisation cannot be expressed and raises.
"""
from __future__ import annotations

import re

import torch

from saes.topk import TopKSAE

_HOOK_RE = re.compile(r"^blocks\.(\d+)\.hook_resid_post$")


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_sae_lens(sae: TopKSAE, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
    """Build a ``sae_lens.TopKSAE`` computing exactly what ``sae`` computes.

    Args:
        sae: a ``saes.TopKSAE``.
        device, dtype: of the new SAE (default: those of ``sae``).
    Returns:
        ``sae_lens.TopKSAE`` with ``W_enc [d_model, d_sae]``, ``W_dec [d_sae, d_model]``; metadata (model name, TL and
        HF hook names) filled from ``sae.release`` / ``sae.layer`` when known, as sae-lens' own Qwen-Scope loader does.

    Example:
        >>> sl = to_sae_lens(load("qwen-scope-3.5-2b-base-w32k-l100", 12))
        >>> sl.encode(resid)                          # == sae.encode(resid)
    """
    from sae_lens import TopKSAE as SaeLensTopKSAE
    from sae_lens import TopKSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    device = torch.device(device) if device is not None else sae.device
    dtype = dtype or sae.dtype
    meta = {}
    if sae.layer is not None:
        meta.update(hook_name=sae.cfg.hook_name, hf_hook_name=f"model.layers.{sae.layer}", hook_head_index=None,
                    prepend_bos=True)
    if sae.release is not None:
        meta.update(model_name=sae.release.model_id, dataset_path=None)
    cfg = TopKSAEConfig(d_in=sae.d_model, d_sae=sae.d_sae, k=sae.k, dtype=_dtype_str(dtype), device=str(device),
                        apply_b_dec_to_input=False, normalize_activations="none",
                        rescale_acts_by_decoder_norm=False, metadata=SAEMetadata(**meta))
    out = SaeLensTopKSAE(cfg)
    state = sae.release_state()
    out.load_state_dict({
        "W_enc": state["W_enc"].T.contiguous(), "W_dec": state["W_dec"].T.contiguous(),
        "b_enc": state["b_enc"], "b_dec": state["b_dec"],
    })
    return out.to(device=device, dtype=dtype)


def from_sae_lens(sae_lens_sae, *, k: int | None = None) -> TopKSAE:
    """Build a ``saes.TopKSAE`` computing exactly what a sae-lens TopK SAE computes.

    Folds ``apply_b_dec_to_input`` (``b_enc -= b_dec @ W_enc``) and ``rescale_acts_by_decoder_norm`` (scale encoder
    columns by, and divide decoder rows by, the decoder norms) into the weights.

    Args:
        sae_lens_sae: a ``sae_lens`` TopK SAE (inference or training class; ``cfg.k`` and ``W_enc [d_in, d_sae]``).
        k: override ``cfg.k`` (normally not needed).
    Returns:
        ``TopKSAE`` in the release orientation; ``.layer`` is set when the hook name is ``blocks.{n}.hook_resid_post``.
    Raises:
        TypeError: not a TopK SAE.
        ValueError: input normalisation or activation reshaping, which a TopKSAE cannot express.
    """
    cfg = sae_lens_sae.cfg
    arch = cfg.architecture() if hasattr(cfg, "architecture") else type(cfg).__name__
    if not hasattr(cfg, "k") or arch not in ("topk",):
        raise TypeError(f"from_sae_lens needs a sae-lens TopK SAE (architecture 'topk'), got '{arch}' "
                        f"({type(sae_lens_sae).__name__})")
    for name, neutral in (("normalize_activations", "none"), ("reshape_activations", "none")):
        value = getattr(cfg, name, neutral)
        if value != neutral:
            raise ValueError(f"sae-lens SAE uses {name}={value!r}; a Qwen-Scope TopKSAE has no such step. "
                             f"Fold it into the weights or keep using sae-lens for this SAE")
    with torch.no_grad():
        w_enc = sae_lens_sae.W_enc.detach()  # [d_model, d_sae]
        w_dec = sae_lens_sae.W_dec.detach()  # [d_sae, d_model]
        b_enc, b_dec = sae_lens_sae.b_enc.detach(), sae_lens_sae.b_dec.detach()
        if getattr(cfg, "apply_b_dec_to_input", False):
            b_enc = b_enc - b_dec @ w_enc
        if getattr(cfg, "rescale_acts_by_decoder_norm", False):
            norms = w_dec.norm(dim=-1)
            w_enc, b_enc, w_dec = w_enc * norms, b_enc * norms, w_dec / norms[:, None]
        out = TopKSAE(w_enc.T.contiguous().clone(), w_dec.T.contiguous().clone(), b_enc.clone(), b_dec.clone(),
                      k=int(k if k is not None else cfg.k))
    hook = getattr(getattr(cfg, "metadata", None), "hook_name", None)
    m = _HOOK_RE.match(hook) if isinstance(hook, str) else None
    out.layer = int(m[1]) if m else None
    return out.requires_grad_(False).eval()
