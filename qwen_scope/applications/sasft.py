"""SASFT (SAE-guided SFT) end to end, and SAE-feature rewards for RL: against code-switching and repetition.

The Qwen-Scope report's training-time use (reference ``qwen-scope-saes.md`` §2.4) reuses SASFT (Deng et al.): find
the features specific to the unwanted class (a language the model switches into; degenerate repetition), measure
their average pre-activation on the wanted class, and during SFT add

    λ · mean over response tokens and selected features of  relu(pre_act_f(h) - avg_pre_act_f[sample's class])

for samples of the wanted class (``FeaturePenalty.sasft``; λ = 1e-3 in SASFT). The selection score is the
monolinguality score of Deng et al. (ACL 2025): a feature's mean activation on the class minus its mean activation on
the other class, over tokens (position 0 left out); a feature must also fire on at least ``min_rate`` of the class's
tokens to count.

For RL the same features give a dense per-token reward, ``-activation`` summed over the selected features on each
response token (``token_rewards``), laid out as TRL's PPO-style trainers hold per-token rewards: ``[B, T_response]``
aligned with the response tokens, 0 past each response's end; ``reward_function`` wraps it as the
``(prompts, completions, **kwargs) -> list[float]`` callable TRL's GRPO trainer takes (the per-token rewards summed).

    picks = contrast_features(scope, code_texts, prose_texts, layer=3, top=4)        # code-specific features
    targets = class_targets(scope, picks, prose_texts)                               # their prose average pre-acts
    pen = FeaturePenalty.sasft(scope.sae(3), 3, [p.feature for p in picks], targets)
    with pen.watch(model) as last:
        loss = model(input_ids=ids, labels=ids).loss + 1e-3 * last(mask=response_mask(ids, prompt_lens))
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hooks import capture_forward

__all__ = ["ContrastFeature", "contrast_features", "class_targets", "response_mask", "token_rewards",
           "reward_function", "repetition_rate", "split_by_repetition"]


@dataclass(frozen=True)
class ContrastFeature:
    """A feature specific to class A against class B at one layer.

    Attributes:
        layer, feature: which. score: mean_a - mean_b (the monolinguality score).
        mean_a, mean_b: mean activation per token. rate_a, rate_b: fraction of tokens where it fires.
    """

    layer: int
    feature: int
    score: float
    mean_a: float
    mean_b: float
    rate_a: float
    rate_b: float


def _token_acts(scope, texts: Sequence[str], layer: int, *, pre: bool = False) -> torch.Tensor:
    """Every token's SAE activations (or pre-activations) at ``layer`` over positions 1..: ``[sum T - 1, d_sae]``."""
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty list of strings")
    sae, rows = scope.sae(layer), []
    for text in texts:
        cap = capture_forward(scope.model, [scope.hook_name(layer)], input_ids=scope.tokenize(text))
        resid = cap[scope.hook_name(layer)][0, 1:].to(sae.device).float()
        with torch.no_grad():
            rows.append((sae.pre_acts(resid) if pre else sae.encode(resid)).float().cpu())
    return torch.cat(rows)


def contrast_features(scope, texts_a: Sequence[str], texts_b: Sequence[str], *, layer: int, top: int = 4,
                      min_rate: float = 0.02) -> list[ContrastFeature]:
    """The ``top`` features most specific to ``texts_a`` against ``texts_b`` by the monolinguality score.

    Args:
        scope: a ``Scope`` with an SAE at ``layer``.
        texts_a: the class whose features to find (the unwanted language, repetitive generations).
        texts_b: the other class. layer: SAE layer. top: features returned.
        min_rate: a feature must fire on at least this fraction of ``texts_a``'s tokens.

    Returns:
        ``[ContrastFeature]``, highest score first.

    Raises:
        ValueError: one class is empty, or no feature is more active on A than on B.
    """
    for what, texts in (("texts_a", texts_a), ("texts_b", texts_b)):
        if isinstance(texts, str) or len(texts) == 0:
            raise ValueError(f"{what} is empty: the contrast needs texts of both classes")
    a, b = _token_acts(scope, texts_a, layer), _token_acts(scope, texts_b, layer)
    mean_a, mean_b = a.mean(0), b.mean(0)
    rate_a, rate_b = (a > 0).float().mean(0), (b > 0).float().mean(0)
    score = torch.where(rate_a >= min_rate, mean_a - mean_b, torch.full_like(mean_a, float("-inf")))
    order = score.argsort(descending=True)[:top]
    picks = [ContrastFeature(layer, int(f), float(score[f]), float(mean_a[f]), float(mean_b[f]), float(rate_a[f]),
                             float(rate_b[f])) for f in order if score[f] > 0]
    if not picks:
        raise ValueError(f"no feature at layer {layer} is more active on texts_a than on texts_b (with min_rate="
                         f"{min_rate}): the classes look alike to this SAE; try another layer or clearer texts")
    return picks


def class_targets(scope, features: Sequence[ContrastFeature], texts: Sequence[str]) -> torch.Tensor:
    """``[F]`` the features' average pre-activation (``x . W_enc[f] + b_enc[f]``, no ReLU or top-k) over the tokens
    of ``texts`` (the wanted class): SASFT's per-feature targets."""
    layers = {p.layer for p in features}
    if len(layers) != 1:
        raise ValueError(f"features come from layers {sorted(layers)}; build one target vector per layer")
    pre = _token_acts(scope, texts, layers.pop(), pre=True)
    return pre[:, [p.feature for p in features]].mean(0)


def response_mask(input_ids: torch.Tensor, prompt_lengths: Sequence[int], *, pad_id: int | None = None
                  ) -> torch.Tensor:
    """``[B, T]`` float: 1 on response tokens (position >= the row's prompt length, and not ``pad_id``)."""
    lengths = torch.as_tensor(list(prompt_lengths))
    if lengths.numel() != input_ids.shape[0]:
        raise ValueError(f"got {lengths.numel()} prompt lengths for {input_ids.shape[0]} rows")
    mask = torch.arange(input_ids.shape[1])[None] >= lengths[:, None]
    if pad_id is not None:
        mask &= input_ids.cpu() != pad_id
    return mask.float().to(input_ids.device)


@torch.no_grad()
def token_rewards(scope, layer: int, features: Sequence[int], sequences: torch.Tensor, prompt_length: int, *,
                  response_lengths: Sequence[int] | None = None, scale: float = 1.0) -> torch.Tensor:
    """Per-token rewards ``-scale * sum_f activation_f`` on the response tokens of generated sequences.

    Args:
        scope: a ``Scope`` with an SAE at ``layer``. features: the penalised features (e.g. repetition ones).
        sequences: ``[B, P + R]`` prompt (left-padded to ``prompt_length``) + response token ids, as
            ``generate`` returns them.
        prompt_length: P. response_lengths: real response tokens per row (default all R).
        scale: reward per unit of activation.

    Returns:
        ``[B, R]`` float32 rewards aligned with the response tokens, 0 past each row's response length.
    """
    ids = torch.as_tensor(list(features), dtype=torch.long)
    sae = scope.sae(layer)
    cap = capture_forward(scope.model, [scope.hook_name(layer)], input_ids=sequences.to(scope.device))
    resid = cap[scope.hook_name(layer)][:, prompt_length:].to(sae.device).float()  # [B, R, d_model]
    acts = sae.encode(resid)[..., ids.to(sae.device)].float().sum(-1).cpu()  # [B, R]
    rewards = -scale * acts
    if response_lengths is not None:
        lengths = torch.as_tensor(list(response_lengths))
        rewards = rewards * (torch.arange(rewards.shape[1])[None] < lengths[:, None])
    return rewards


def reward_function(scope, layer: int, features: Sequence[int], *, scale: float = 1.0):
    """A TRL GRPO-style reward function ``(prompts, completions, **kwargs) -> list[float]``: each completion's
    summed per-token reward (its text scored after its prompt)."""

    def reward(prompts: Sequence[str], completions: Sequence[str], **kwargs) -> list[float]:
        out = []
        for prompt, completion in zip(prompts, completions):
            p = scope.tokenize(prompt)
            c = scope.tokenizer(completion, add_special_tokens=False, return_tensors="pt")["input_ids"]
            seq = torch.cat([p.cpu(), c], dim=1)
            out.append(float(token_rewards(scope, layer, features, seq, p.shape[1], scale=scale).sum()))
        return out

    return reward


def repetition_rate(ids: Sequence[int], n: int = 4) -> float:
    """Share of a token sequence's n-grams that repeat an earlier n-gram (0: none repeats; near 1: a loop)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def split_by_repetition(scope, texts: Sequence[str], *, n: int = 4, threshold: float = 0.5
                        ) -> tuple[list[str], list[str]]:
    """``(repetitive, normal)``: generations whose token ``repetition_rate`` is at least ``threshold``, and the rest
    (the two classes ``contrast_features`` compares to find repetition features)."""
    rep, normal = [], []
    for t in texts:
        ids = scope.tokenizer(t, add_special_tokens=False)["input_ids"]
        (rep if repetition_rate(ids, n) >= threshold else normal).append(t)
    return rep, normal
