"""SAE-guided training signals: a differentiable penalty on chosen SAE features, for SFT / RL (SASFT-style).

The Qwen-Scope report's training-time use (reference ``qwen-scope-saes.md`` §2.4): to suppress a behaviour such as
code-switching into another language or degenerate repetition, find the SAE features that carry it (``compare``,
``FeatureClassifier``) and add a loss that keeps those features from firing on the tokens where the behaviour is
unwanted, while the usual LM loss keeps the rest of the model in place.

A TopK SAE's code is ReLU then top-k; the penalty uses the differentiable part, the chosen features' ReLU
pre-activations (a feature whose pre-activation is pushed to <= 0 cannot be among the top k):

    penalty = mean over the (masked) tokens of  sum over chosen features f of  relu(W_enc[f] x + b_enc[f] - target)^p

with x the residual stream at the SAE's layer (``resid_post.layer``, read with gradients), ``target`` an allowed level
(0 by default, or one per feature) and ``p`` = 2 (smooth) or 1; ``FeaturePenalty.sasft`` is SASFT's form (``p`` = 1,
a mean over the features, per-feature targets: ``qwen_scope.applications.sasft``). Only the chosen rows of ``W_enc`` enter the matmul, so a penalty on a
handful of features costs next to nothing beside the forward. The SAE itself stays frozen.

    pen = FeaturePenalty(scope.sae(12), layer=12, features=[6159, 812])
    with pen.watch(model) as last:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss + 0.1 * last(mask=wrong_language)      # mask: [B, T], 1 where the features must stay off
    loss.backward()
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hooks import intervene, resid_post

__all__ = ["FeaturePenalty"]


class FeaturePenalty:
    """Penalty on the pre-activations of ``features`` of ``sae`` at ``resid_post.<layer>``.

    Args:
        sae: a ``TopKSAE`` (its weights are read, never trained).
        layer: the decoder block whose output the SAE reads.
        features: feature ids to keep off.
        target: pre-activation level allowed before the penalty starts: one for all features or one per feature
            (SASFT: each feature's average pre-activation on the sample's own class).
        power: 2 (squared excess, smooth) or 1.
        reduce: combine the features of a token by ``"sum"`` or ``"mean"`` (SASFT).
    """

    def __init__(self, sae, layer: int, features: int | Iterable[int], *,
                 target: float | Sequence[float] | torch.Tensor = 0.0, power: int = 2, reduce: str = "sum"):
        ids = torch.as_tensor([features] if isinstance(features, int) else list(features), dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("no features to penalise: pass feature ids, e.g. the top of scope.compare(...)")
        bad = ids[(ids < 0) | (ids >= sae.d_sae)]
        if bad.numel():
            raise ValueError(f"feature ids {bad.tolist()} are outside the SAE's 0..{sae.d_sae - 1} (layer {layer}, "
                             f"d_sae {sae.d_sae}); pick ids below {sae.d_sae}, e.g. from "
                             f"scope.features(text).top({layer})")
        targets = torch.as_tensor(target, dtype=torch.float32).flatten()
        if targets.numel() not in (1, ids.numel()):
            raise ValueError(f"target must be one level or one per feature ({ids.numel()}), got {targets.numel()}")
        if power not in (1, 2) or reduce not in ("sum", "mean"):
            raise ValueError(f"need power 1 or 2 and reduce 'sum' or 'mean', got power={power}, reduce={reduce!r}")
        self.layer, self.features, self.power, self.reduce = int(layer), ids, int(power), reduce
        self.target = targets.expand(ids.numel()).clone()  # [F]
        self._W = sae.W_enc.detach()[ids].float()  # [F, d_model]
        self._b = sae.b_enc.detach()[ids].float()
        self._device_copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._device_key: tuple | None = None

    @classmethod
    def sasft(cls, sae, layer: int, features: Iterable[int], targets: Sequence[float] | torch.Tensor
              ) -> FeaturePenalty:
        """SASFT's loss term: ``mean over tokens and features of relu(pre_act_f - avg_pre_act_f)`` (power 1, a
        mean over the features), ``targets`` the features' average pre-activations on the sample's own class
        (``sasft.class_targets``); multiply by λ (SASFT's default 1e-3) and pass the response mask."""
        return cls(sae, layer, features, target=targets, power=1, reduce="mean")

    def pre_acts(self, resid: torch.Tensor) -> torch.Tensor:
        """The chosen features' pre-activations ``[..., F]`` in fp32 (differentiable in ``resid``)."""
        W, b, _ = self._on(resid.device)
        return F.linear(resid.float(), W, b)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The rows, bias and targets on the activations' device, copied once: a copy from host memory inside the
        # training loop waits for the GPU to finish all its queued work (a host sync every micro-batch). Keyed on
        # the target tensor and its version, so a reassigned or edited ``target`` is copied again.
        key = (device, id(self.target), self.target._version)
        if self._device_key != key:
            self._device_copy = (self._W.to(device), self._b.to(device), self.target.to(device))
            self._device_key = key
        return self._device_copy

    def __call__(self, resid: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The penalty of residual activations ``resid [B, T, d_model]``; ``mask [B, T]`` (1 = penalise) selects
        tokens, the mean is over the selected ones (0 when none is)."""
        excess = (self.pre_acts(resid) - self._on(resid.device)[2]).clamp(min=0)
        per_feature = excess * excess if self.power == 2 else excess
        per_token = per_feature.sum(-1) if self.reduce == "sum" else per_feature.mean(-1)  # [B, T]
        if mask is None:
            return per_token.mean()
        if mask.shape != per_token.shape:
            raise ValueError(f"mask must be [B, T] = {tuple(per_token.shape)}, got {tuple(mask.shape)}")
        mask = mask.to(per_token.dtype)
        return (per_token * mask).sum() / mask.sum().clamp(min=1)

    @contextlib.contextmanager
    def watch(self, model: nn.Module) -> Iterator[Callable[..., torch.Tensor]]:
        """Read ``resid_post.<layer>`` with gradients during forwards inside the block; yields ``last(mask=None)``,
        the penalty of the most recent forward. The hook is removed on exit.

        Raises (from ``last``):
            RuntimeError: no forward ran inside the block yet.
        """
        seen: list[torch.Tensor] = []

        def keep(act: torch.Tensor, ctx) -> None:
            seen[:] = [act]
            return None

        def last(mask: torch.Tensor | None = None) -> torch.Tensor:
            if not seen:
                raise RuntimeError(f"no forward pass reached {resid_post(self.layer)} inside FeaturePenalty.watch(); "
                                   "run the model inside the with-block first")
            return self(seen[0], mask)

        with intervene(model, {resid_post(self.layer): keep}):
            yield last

    def __repr__(self) -> str:
        shown = self.features.tolist()[:8]
        more = f" (+{self.features.numel() - 8})" if self.features.numel() > 8 else ""
        level = self.target[0].item() if bool((self.target == self.target[0]).all()) else "per feature"
        return (f"FeaturePenalty(layer={self.layer}, features={shown}{more}, target={level}, "
                f"power={self.power}, reduce={self.reduce!r})")
