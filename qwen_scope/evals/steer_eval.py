"""Steering evaluation: how much a steering edit changes the model, whether it moves its feature, what it costs in
coherence, and how that compares with controls.

For each prompt the edit's greedy continuation is generated, then read back teacher-forced twice, with and without
the edit, so every number compares the two models on the same tokens:

- ``kl_per_step[i]``: ``KL(steered || base)`` of the next-token distributions that chose generated token i;
- ``feature_activation``: the edited feature's SAE activation at the positions the edit touches (position 0 left
  out), read back by the SAE from the steered residual (so a clamp to v reads back near, not exactly, v: the other
  features shift too); ``base_feature_activation`` is the unsteered model's on the same tokens;
- ``top_logit_deltas``: the tokens whose logits the edit raises most, mean over steps;
- ``perplexity``: the base model's perplexity of the steered continuation (a coherence proxy; ``base_perplexity``
  is that of the base model's own continuation).

Controls, the same metrics: the edit with the feature's decoder direction swapped for random directions of the same
norm, and the edit moved to random features of matched firing density. ``sweep_strength`` runs the edit over
strengths and suggests the smallest strength whose effect reaches ``saturation`` of the largest effect among the
strengths whose perplexity stays within ``coherence`` x the base perplexity.

    ev = evaluate_steering(scope, ["Example:\\n\\n"], add(5, 992, 4.0))
    print(ev.summary()); ev.figure()
    sweep_strength(scope, ["Example:\\n\\n"], 5, 992, [0, 2, 4, 8, 16]).suggested
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hooks import capture, resid_post
from qwen_scope.evals.steer_results import ArmResult, StrengthSweep, SteeringEvaluation, suggest_strength
from qwen_scope.steering import FeatureEdit, add, clamp, parse_steer_positions, steer, steering

__all__ = ["evaluate_steering", "sweep_strength"]


class _Redirected:
    """An SAE whose decoder direction of one feature is swapped (the random-direction control); everything else,
    the encoder included, is the wrapped SAE's, so clamps and position rules act exactly as on the real one."""

    def __init__(self, sae, feature: int, direction: torch.Tensor):
        self.sae, self.feature, self.direction = sae, feature, direction

    @property
    def d_sae(self) -> int:
        return self.sae.d_sae

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.sae.encode(x)

    def decoder_directions(self, ids) -> torch.Tensor:
        rows = self.sae.decoder_directions(ids).clone()
        flat = torch.as_tensor([ids] if isinstance(ids, int) else ids).reshape(-1)
        rows[flat == self.feature] = self.direction.to(rows)
        return rows


def _check_edit(scope, edits) -> FeatureEdit:
    edit_list = [edits] if isinstance(edits, FeatureEdit) else list(edits)
    if len(edit_list) != 1 or not isinstance(edit_list[0], FeatureEdit):
        raise ValueError(f"a steering evaluation measures one edit (add / clamp / ablate) against its controls; "
                         f"got {len(edit_list)} edits. Evaluate them one at a time")
    edit = edit_list[0]
    n = scope.adapter.n_layers
    if not 0 <= edit.layer < n:
        raise ValueError(f"the edit steers layer {edit.layer}, outside {scope.model_name or 'the model'}'s decoder "
                         f"blocks 0..{n - 1}; pick a layer in that range with an SAE loaded ({scope.layers})")
    sae = scope.sae(edit.layer)
    if not 0 <= edit.feature < sae.d_sae:
        raise ValueError(f"feature {edit.feature} out of range for the layer-{edit.layer} SAE (d_sae {sae.d_sae})")
    return edit


def _edit_mask(edit: FeatureEdit, length: int, prompt_length: int) -> torch.Tensor:
    explicit, prompt, generated = parse_steer_positions(edit.positions)
    where = torch.arange(length)
    if explicit is None:
        return torch.ones(length, dtype=torch.bool)
    mask = torch.isin(where, torch.tensor(explicit, dtype=torch.long))
    if prompt:
        mask |= where < prompt_length
    if generated:
        mask |= where >= prompt_length
    return mask


def _generate(scope, ids: torch.Tensor, edit: FeatureEdit | None, saes, max_new_tokens: int) -> torch.Tensor:
    tok = scope.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=pad if pad is not None else 0)
    with torch.no_grad():
        if edit is None:
            return scope.model.generate(ids, **kwargs)[0, ids.shape[1]:]
        with steering(scope, [edit], saes=saes, prompt_length=ids.shape[1]):
            return scope.model.generate(ids, **kwargs)[0, ids.shape[1]:]


def _teacher_forced(scope, seq: torch.Tensor, layer: int, edit: FeatureEdit | None, saes, prompt_length: int):
    """(logits [L, V], resid_post.layer [L, d_model]) of ``seq`` [L], with ``edit`` applied (None: base model)."""
    with torch.no_grad(), _edited(scope, edit, saes, prompt_length), \
            capture(scope.model, [resid_post(layer)]) as cap:
        logits = scope.model(input_ids=seq[None], use_cache=False).logits[0].float()
    return logits, cap[resid_post(layer)][0].float()


def _edited(scope, edit: FeatureEdit | None, saes, prompt_length: int):
    if edit is None:
        return contextlib.nullcontext()
    return steering(scope, [edit], saes=saes, prompt_length=prompt_length)


def _measure(scope, prompts_ids, edit: FeatureEdit, saes, name: str, steered: list[torch.Tensor] | None,
             max_new_tokens: int, top_n: int) -> ArmResult:
    """One arm (the edit or a control) over every prompt; ``steered`` are its continuations when already made."""
    sae = scope.sae(edit.layer)
    kl_steps: list[list[float]] = []
    nll, act, base_act, n_act, delta, texts = 0.0, 0.0, 0.0, 0, None, []
    n_tok = 0
    for j, ids in enumerate(prompts_ids):
        new = steered[j] if steered is not None else _generate(scope, ids, edit, saes, max_new_tokens)
        new = new.to(ids.device)
        texts.append(scope.tokenizer.decode(new.tolist(), skip_special_tokens=True))
        P, G = ids.shape[1], new.numel()
        seq = torch.cat([ids[0], new])
        logit_b, h_b = _teacher_forced(scope, seq, edit.layer, None, saes, P)
        logit_s, h_s = _teacher_forced(scope, seq, edit.layer, edit, saes, P)
        steps = slice(P - 1, P - 1 + G)
        logp_s, logp_b = F.log_softmax(logit_s[steps], -1), F.log_softmax(logit_b[steps], -1)
        kl_steps.append((logp_s.exp() * (logp_s - logp_b)).sum(-1).clamp_min(0).tolist())
        nll += float(-logp_b.gather(-1, new[:, None]).sum())
        n_tok += G
        d = (logit_s[steps] - logit_b[steps]).sum(0)
        delta = d if delta is None else delta + d
        mask = _edit_mask(edit, seq.numel(), P).to(h_s.device)
        mask[0] = False  # the attention sink: its residual is no reading of any feature
        act += float(sae.encode(h_s[mask])[:, edit.feature].sum())
        base_act += float(sae.encode(h_b[mask])[:, edit.feature].sum())
        n_act += int(mask.sum())
    width = max(len(s) for s in kl_steps)
    per_step = [sum(s[i] for s in kl_steps if i < len(s)) / sum(1 for s in kl_steps if i < len(s))
                for i in range(width)]
    delta = delta / max(n_tok, 1)
    top = delta.topk(min(top_n, delta.numel()))
    return ArmResult(
        name=name, layer=edit.layer, feature=edit.feature, kl_per_step=tuple(per_step),
        kl=sum(map(sum, kl_steps)) / max(n_tok, 1), feature_activation=act / max(n_act, 1),
        base_feature_activation=base_act / max(n_act, 1), perplexity=math.exp(nll / max(n_tok, 1)),
        top_logit_deltas=tuple(zip(scope.decode_tokens(top.indices), top.values.tolist())), texts=tuple(texts))


def _densities(scope, layer: int, density, prompts_ids, base_new) -> torch.Tensor:
    if density is not None:
        return torch.as_tensor(getattr(density, "density", density), dtype=torch.float64).cpu()
    # Without a corpus estimate, the prompts and their base continuations stand in (rough, but no extra input).
    sae, fired, n = scope.sae(layer), None, 0
    for ids, new in zip(prompts_ids, base_new):
        _, h = _teacher_forced(scope, torch.cat([ids[0], new.to(ids.device)]), layer, None, None, ids.shape[1])
        hits = (sae.encode(h[1:]) > 0).sum(0).double().cpu()
        fired, n = (hits if fired is None else fired + hits), n + h.shape[0] - 1
    return fired / max(n, 1)


def _matched_features(density: torch.Tensor, feature: int, n: int, gen: torch.Generator) -> list[int]:
    alive = torch.nonzero(density > 0).flatten()
    alive = alive[alive != feature]
    if alive.numel() == 0:
        return []
    target = float(density[feature]) if float(density[feature]) > 0 else float(density[alive].min())
    gap = (density[alive].log() - math.log(target)).abs()
    # Random among the 4n closest in log density, so the controls are not always the same next-door features.
    pool = alive[gap.argsort()[:4 * n]]
    return pool[torch.randperm(pool.numel(), generator=gen)[:n]].tolist()


def evaluate_steering(scope, prompts: str | Sequence[str], edits, *, max_new_tokens: int = 24, n_controls: int = 2,
                      density=None, template: str | None = None, top_n: int = 8, seed: int = 0,
                      controls: bool = True) -> SteeringEvaluation:
    """Measure one steering edit on a prompt set against random-direction and random-feature controls.

    Args:
        scope: a ``Scope`` with an SAE at the edit's layer.
        prompts: a prompt or several.
        edits: one ``FeatureEdit`` (``add`` / ``clamp`` / ``ablate``), or a list holding one.
        max_new_tokens: greedy steps per prompt (G).
        n_controls: random directions and random features, each.
        density: the layer's feature densities ``[d_sae]`` (or a ``FeatureDatabase``) for matching the random
            features; default: estimated on the prompts and their base continuations.
        template: chat template of the prompts (see ``Scope.tokenize``).
        top_n: logit deltas kept. seed: for the controls. controls: False measures the edit alone.
    Returns:
        ``SteeringEvaluation`` (``.target``, ``.random_directions``, ``.random_features``, ``.result``: the
        ``SteeringResult`` of the first prompt, ``.summary()``, ``.figure()``).
    Raises:
        ValueError: several edits, an edit outside the model's layers or its SAE's features.

    Example:
        >>> ev = evaluate_steering(scope, "Example:\\n\\n", add(5, 992, 4.0))
        >>> ev.target.kl, ev.random_directions[0].kl
    """
    edit = _check_edit(scope, edits)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("evaluate_steering needs at least one prompt")
    results = [steer(scope, p, [edit], max_new_tokens=max_new_tokens, template=template, top_n=top_n)
               for p in prompts]
    prompts_ids = [scope.tokenize(p, template) for p in prompts]
    base_new = [r.baseline.token_ids for r in results]
    table = dict(scope.saes)
    target = _measure(scope, prompts_ids, edit, table, "target", [r.steered.token_ids for r in results],
                      max_new_tokens, top_n)
    base = _measure(scope, prompts_ids, dataclasses.replace(edit, mode="add", value=0.0), table, "base", base_new,
                    max_new_tokens, top_n)
    directions, features = [], []
    if controls and n_controls > 0:
        gen = torch.Generator().manual_seed(seed)
        sae = scope.sae(edit.layer)
        norm = float(sae.decoder_directions(edit.feature).float().norm())
        for i in range(n_controls):
            r = torch.randn(sae.d_model, generator=gen)
            swapped = {**table, edit.layer: _Redirected(sae, edit.feature, r * (norm / float(r.norm())))}
            directions.append(_measure(scope, prompts_ids, edit, swapped, f"random direction {i}", None,
                                       max_new_tokens, top_n))
        dens = _densities(scope, edit.layer, density, prompts_ids, base_new)
        for g in _matched_features(dens, edit.feature, n_controls, gen):
            features.append(_measure(scope, prompts_ids, dataclasses.replace(edit, feature=g), table,
                                     f"random feature {g}", None, max_new_tokens, top_n))
    return SteeringEvaluation(prompts=tuple(prompts), edit=edit, target=target, base_perplexity=base.perplexity,
                              random_directions=tuple(directions), random_features=tuple(features),
                              results=tuple(results))


def sweep_strength(scope, prompts: str | Sequence[str], layer: int, feature: int, strengths: Sequence[float], *,
                   mode: str = "add", scale: str = "raw", positions="all", max_new_tokens: int = 24,
                   template: str | None = None, saturation: float = 0.9, coherence: float = 2.0) -> StrengthSweep:
    """The edit's effect-size curve over ``strengths`` and the suggested strength (see the module docstring).

    Args:
        scope, prompts, max_new_tokens, template: as for ``evaluate_steering``.
        layer, feature: the feature steered. strengths: add strengths or clamp values, e.g. ``[0, 2, 4, 8, 16]``.
        mode, scale, positions: as for ``add`` / ``clamp``.
        saturation: fraction of the largest coherent effect that counts as saturated.
        coherence: the largest perplexity, as a multiple of the base perplexity, that still counts as coherent.
    Returns:
        ``StrengthSweep`` (``.effect``, ``.kl``, ``.perplexity``, ``.suggested``, ``.figure()``).
    """
    if mode not in ("add", "clamp"):
        raise ValueError(f"sweep_strength mode must be 'add' or 'clamp', got {mode!r}")
    if not strengths:
        raise ValueError("sweep_strength needs at least one strength, e.g. [0, 2, 4, 8, 16]")
    arms = []
    base_ppl = None
    for s in strengths:
        edit = add(layer, feature, s, scale=scale, positions=positions) if mode == "add" else \
            clamp(layer, feature, s, positions=positions)
        ev = evaluate_steering(scope, prompts, edit, max_new_tokens=max_new_tokens, template=template,
                               controls=False)
        base_ppl = ev.base_perplexity
        arms.append(ev.target)
    effect = tuple(a.feature_activation - a.base_feature_activation for a in arms)
    ppl = tuple(a.perplexity for a in arms)
    return StrengthSweep(layer=layer, feature=feature, mode=mode, strengths=tuple(float(s) for s in strengths),
                         effect=effect, kl=tuple(a.kl for a in arms), perplexity=ppl, base_perplexity=base_ppl,
                         suggested=suggest_strength(strengths, effect, ppl, base_ppl, saturation=saturation,
                                                    coherence=coherence), arms=tuple(arms))
