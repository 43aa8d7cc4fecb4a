"""Steering with SAE features during generation: add a decoder direction, clamp a feature, ablate a feature.

Edits act on ``resid_post.<layer>`` (the SAE's own site) on the prefill and on every decode step. Qwen's demo adds
the raw decoder column, ``h + a * W_dec[:, i]``; ``scale="unit"`` uses the unit direction, ``scale="norm"`` makes
``a`` a fraction of each token's residual norm. A clamp sets the SAE code of the feature to a value while keeping
the SAE's error term: ``h' = decode(z with z_i = v) + (h - decode(z)) = h + (v - z_i) W_dec[:, i]``; ablation is a
clamp to 0.

    result = scope.steer("Once upon a time", [add(12, 4242, 20.0, positions="generated")])
    print(result.side_by_side())
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hooks import InterventionContext, Positions, intervene, parse_positions, position_mask, resid_post
from saes import TopKSAE

log = logging.getLogger(__name__)

__all__ = ["FeatureEdit", "add", "clamp", "ablate", "PRESETS", "steering", "Generation", "SteeringResult",
           "Sweep", "steer", "sweep", "parse_steer_positions"]

# Qwen's demo presets for the raw decoder column (scale="raw").
PRESETS = {"light": 5.0, "medium": 20.0, "strong": 100.0}
_MODES = ("add", "clamp", "ablate")
_SCALES = ("raw", "unit", "norm")
# Far beyond any useful strength (residual norms are in the tens to thousands), far below float32 overflow.
_MAX_VALUE = 1e6


@dataclass(frozen=True)
class FeatureEdit:
    """One edit of one SAE feature at one layer.

    Attributes:
        layer: SAE layer (the edit acts on ``resid_post.<layer>``).
        feature: feature id in [0, d_sae).
        mode: ``"add"`` (add ``value`` times the direction), ``"clamp"`` (set the code to ``value``) or
            ``"ablate"`` (set the code to 0).
        value: strength for add (negative suppresses), target activation for clamp.
        scale: add only: ``"raw"`` decoder column (Qwen's demo), ``"unit"`` direction, or ``"norm"`` (unit direction
            times each token's residual norm, so ``value`` is a fraction of it).
        positions: ``"all"``, ``"prompt"``, ``"generated"``, or absolute positions like ``"0,2,5-8"``; items may be
            combined, e.g. ``"0-3,generated"``. Positions past the prompt steer generated tokens.
    """

    layer: int
    feature: int
    mode: str = "add"
    value: float = 0.0
    scale: str = "raw"
    positions: str | int | Sequence[int] = "all"

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.scale not in _SCALES:
            raise ValueError(f"scale must be one of {_SCALES}, got {self.scale!r}")
        what = "clamp value" if self.mode == "clamp" else "strength"
        try:
            value = float(self.value)
        except (TypeError, ValueError):
            raise TypeError(f"{what} of {self.mode} at layer {self.layer} feature {self.feature} must be a number, "
                            f"got {self.value!r}") from None
        # NaN / Inf (and magnitudes whose square overflows float32 in the norms downstream) give NaN text silently.
        if not math.isfinite(value) or abs(value) > _MAX_VALUE:
            raise ValueError(f"{what} {self.value!r} of {self.mode} at layer {self.layer} feature {self.feature} must "
                             f"be finite and at most {_MAX_VALUE:g} in size; Qwen's presets are {PRESETS}")
        object.__setattr__(self, "value", value)
        parse_steer_positions(self.positions)


def add(layer: int, feature: int, strength: float | str, *, scale: str = "raw",
        positions: str | int | Sequence[int] = "all") -> FeatureEdit:
    """Add ``strength`` x the feature's decoder direction (a preset name ``"light"/"medium"/"strong"`` works too)."""
    if isinstance(strength, str) and strength not in PRESETS:
        raise ValueError(f"strength {strength!r} is not a preset; expected a number or one of {PRESETS}")
    value = PRESETS[strength] if isinstance(strength, str) else strength
    return FeatureEdit(layer, int(feature), "add", value, scale, positions)


def clamp(layer: int, feature: int, value: float, *, positions: str | int | Sequence[int] = "all") -> FeatureEdit:
    """Set the feature's SAE code to ``value`` (error term kept)."""
    return FeatureEdit(layer, int(feature), "clamp", value, "raw", positions)


def ablate(layer: int, feature: int, *, positions: str | int | Sequence[int] = "all") -> FeatureEdit:
    """Set the feature's SAE code to 0 (error term kept)."""
    return FeatureEdit(layer, int(feature), "ablate", 0.0, "raw", positions)


def parse_steer_positions(spec: str | int | Sequence[int]) -> tuple[Positions | None, bool, bool]:
    """Split a steering position spec into (explicit positions or None for all, prompt?, generated?).

    Example:
        >>> parse_steer_positions("0-3,generated")
        (Positions(ranges=((0, 3),), from_end=()), False, True)
    """
    if isinstance(spec, str):
        words = [w.strip().lower() for w in spec.split(",") if w.strip()]
        if not words or "all" in words:
            return None, False, False
        prompt, generated = "prompt" in words, "generated" in words
        rest = ",".join(w for w in words if w not in ("prompt", "generated"))
        explicit = parse_positions(rest) if rest else Positions()
        if explicit.from_end:
            raise ValueError(f"steering positions must be non-negative, got {spec!r}")
        return explicit, prompt, generated
    explicit = parse_positions(spec)
    if explicit is not None and explicit.from_end:
        raise ValueError(f"steering positions must be non-negative, got {spec!r}")
    return explicit, False, False


def _mask(parsed: tuple[Positions | None, bool, bool], positions: torch.Tensor, prompt_length: int) -> torch.Tensor:
    explicit, prompt, generated = parsed
    if explicit is None:
        return torch.ones_like(positions, dtype=torch.bool)
    mask = position_mask(explicit, positions) if explicit else torch.zeros_like(positions, dtype=torch.bool)
    if prompt:
        mask |= positions < prompt_length
    if generated:
        mask |= positions >= prompt_length
    return mask


class _LayerSteer:
    """The edit function of one layer: every FeatureEdit of that layer, applied together to one pass."""

    def __init__(self, sae: TopKSAE, edits: Sequence[FeatureEdit], prompt_length: int | None):
        self.sae, self.edits = sae, list(edits)
        self.fixed_prompt_length, self.prompt_length = prompt_length, prompt_length
        self.directions = sae.decoder_directions([e.feature for e in self.edits]).float()  # [n, d_model]
        # Parsed once here, not on every forward pass of every decode step.
        self.positions = [parse_steer_positions(e.positions) for e in self.edits]
        # the features a clamp / ablate reads, and each such edit's column among them
        self.column = {j: c for c, j in enumerate(j for j, e in enumerate(self.edits) if e.mode != "add")}
        self.clamped = torch.tensor([self.edits[j].feature for j in self.column], dtype=torch.long)

    def __call__(self, act: torch.Tensor, ctx: InterventionContext) -> torch.Tensor:
        # Without an explicit prompt length, the first prefill pass defines it.
        if self.fixed_prompt_length is None and ctx.is_prefill:
            self.prompt_length = int(ctx.positions[-1]) + 1
        prompt_length = self.prompt_length if self.prompt_length is not None else int(ctx.positions[-1]) + 1
        h = act.float()
        directions = self.directions.to(h.device)
        delta = torch.zeros_like(h)
        # the clamped features' codes only: no top-k sort over all d_sae (the engine computes them the same way)
        codes = (self.sae.feature_codes(h, self.clamped.to(h.device)).float()
                 if self.column else None)  # [B, T, clamped edits]
        for j, e in enumerate(self.edits):
            mask = _mask(self.positions[j], ctx.positions, prompt_length)[None, :, None].to(h.dtype)  # [1, T, 1]
            d = directions[j]
            if e.mode == "add":
                if e.scale == "raw":
                    step = e.value * d.expand_as(h)
                else:
                    unit = d / d.norm().clamp_min(1e-12)
                    size = h.norm(dim=-1, keepdim=True) if e.scale == "norm" else 1.0
                    step = e.value * size * unit
            else:
                z = codes[..., self.column[j], None]  # [B, T, 1]
                step = (e.value - z) * d
            delta = delta + mask * step
        return (h + delta).to(act.dtype)


def _group_edits(table: Mapping[int, TopKSAE], edits: Sequence[FeatureEdit]) -> dict[int, list[FeatureEdit]]:
    """Check every edit against the SAEs and group them by layer."""
    by_layer: dict[int, list[FeatureEdit]] = {}
    for e in edits:
        if not isinstance(e, FeatureEdit):
            raise TypeError(f"edits must be FeatureEdit (use add/clamp/ablate), got {type(e).__name__}")
        if e.layer not in table:
            raise KeyError(f"no SAE at layer {e.layer} for {e}; SAEs are loaded at layers {sorted(table)}")
        if not 0 <= e.feature < table[e.layer].d_sae:
            raise ValueError(f"feature {e.feature} out of range for the layer-{e.layer} SAE (d_sae "
                             f"{table[e.layer].d_sae})")
        by_layer.setdefault(e.layer, []).append(e)
    return by_layer


@contextlib.contextmanager
def steering(scope, edits: Sequence[FeatureEdit], *, saes: Mapping[int, TopKSAE] | None = None,
             prompt_length: int | None = None) -> Iterator[dict[str, int]]:
    """Apply ``edits`` to every forward pass inside the with-block (prefill and decode steps).

    Args:
        scope: a ``Scope`` (its SAEs are used), or a bare model together with ``saes``.
        edits: ``FeatureEdit``s (``add`` / ``clamp`` / ``ablate``); several features and layers at once.
        saes: ``{layer: TopKSAE}``, overriding the scope's.
        prompt_length: where generated positions start; default: the length of the first prefill pass.

    Returns:
        (yields) a dict counting, per hook point, the passes that were steered.

    Example:
        >>> with steering(scope, [add(12, 4242, 20.0)]):
        ...     scope.model.generate(ids, max_new_tokens=20)
    """
    model = getattr(scope, "model", scope)
    table = dict(saes) if saes is not None else dict(getattr(scope, "saes", {}))
    by_layer = _group_edits(table, edits)
    fns = {resid_post(n): _LayerSteer(table[n], es, prompt_length) for n, es in by_layer.items()}
    with intervene(model, fns) as handle:
        yield handle.fired


@dataclass(frozen=True)
class Generation:
    """One generated continuation with the model's per-step probabilities (before sampling processors).

    Attributes:
        token_ids: [G] new tokens. tokens: their display strings. text: decoded continuation.
        probs: [G] probability of each chosen token. top_ids / top_probs: [G, n] the n likeliest tokens per step.
    """

    token_ids: torch.Tensor
    tokens: list[str]
    text: str
    probs: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    top_tokens: list[list[str]] = field(repr=False, default_factory=list)


def _generate(scope, ids: torch.Tensor, top_n: int, seed: int | None, **kwargs) -> Generation:
    tok = scope.tokenizer
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if pad is not None else getattr(tok, "eos_token_id", None)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = scope.model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                                   output_logits=True, pad_token_id=pad if pad is not None else 0, **kwargs)
    new = out.sequences[0, ids.shape[1]:].cpu()
    probs = torch.stack([lg[0].float().softmax(-1).cpu() for lg in out.logits])[: len(new)]  # [G, V]
    top_probs, top_ids = probs.topk(min(top_n, probs.shape[-1]), dim=-1)
    chosen = probs.gather(-1, new[:, None])[:, 0]
    return Generation(new, scope.decode_tokens(new), tok.decode(new.tolist(), skip_special_tokens=True), chosen,
                      top_ids, top_probs, [scope.decode_tokens(row) for row in top_ids])


@dataclass(frozen=True)
class SteeringResult:
    """Baseline and steered generations of one prompt. ``fired`` counts steered passes per hook point."""

    prompt: str
    edits: tuple[FeatureEdit, ...]
    baseline: Generation | None
    steered: Generation
    fired: dict[str, int]
    generated_by: str = "transformers"

    @property
    def first_difference(self) -> int | None:
        """Index of the first generated token where steered and baseline differ (None if identical)."""
        if self.baseline is None:
            return None
        a, b = self.baseline.token_ids.tolist(), self.steered.token_ids.tolist()
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return i
        return None if len(a) == len(b) else min(len(a), len(b))

    def side_by_side(self, width: int = 36) -> str:
        """Plain-text table: per step, baseline token and probability | steered token and probability."""
        lines = [f"prompt: {self.prompt!r}", "edits: " + "; ".join(_describe(e) for e in self.edits),
                 f"baseline: {self.baseline.text!r}" if self.baseline else "", f"steered:  {self.steered.text!r}",
                 f"{'step':>4}  {'baseline':<{width}}| steered"]
        base = self.baseline
        n = max(len(self.steered.tokens), len(base.tokens) if base else 0)
        for i in range(n):
            left = f"{base.tokens[i]!r} {float(base.probs[i]):.2f}" if base and i < len(base.tokens) else ""
            right = (f"{self.steered.tokens[i]!r} {float(self.steered.probs[i]):.2f}"
                     if i < len(self.steered.tokens) else "")
            mark = "*" if base and left and right and base.token_ids[i] != self.steered.token_ids[i] else " "
            lines.append(f"{i:>4}{mark} {left:<{width}}| {right}")
        return "\n".join(line for line in lines if line)


def _describe(e: FeatureEdit) -> str:
    what = {"add": f"add {e.value:g}x ({e.scale})", "clamp": f"clamp to {e.value:g}", "ablate": "ablate"}[e.mode]
    return f"layer {e.layer} feature {e.feature}: {what} at {e.positions}"


def steer(scope, prompt: str, edits: FeatureEdit | Sequence[FeatureEdit], *, max_new_tokens: int = 40,
          do_sample: bool = False, template: str | None = None, top_n: int = 5, seed: int | None = 0,
          baseline: bool = True, engine: str = "auto", **generate_kwargs) -> SteeringResult:
    """Generate from ``prompt`` without and with ``edits`` (same seed), with per-step token probabilities.

    Args:
        scope: a ``Scope`` with SAEs at the edited layers.
        prompt: the prompt text.
        edits: one or several ``FeatureEdit``s.
        max_new_tokens, do_sample: generation length and greedy (default) vs sampling.
        template: chat template, see ``Scope.tokenize``.
        top_n: candidates kept per step.
        seed: torch seed set before each generation (so sampled runs are comparable).
        baseline: also generate the unsteered continuation.
        engine: ``"auto"`` (the static decode engine, baseline and steered as one batch, where it applies; else
            transformers' ``generate``, the reason logged and kept in ``generated_by``), ``"static"`` (the engine
            or a ValueError naming why not) or ``"transformers"``.
        **generate_kwargs: passed to ``model.generate`` (e.g. ``temperature``).

    Returns:
        ``SteeringResult`` (``.side_by_side()`` renders it).

    Example:
        >>> r = steer(scope, "My favourite food is", [add(12, 4242, "medium", positions="generated")])
        >>> r.steered.text
    """
    edit_list = (edits,) if isinstance(edits, FeatureEdit) else tuple(edits)
    _group_edits(scope.saes, edit_list)
    ids = scope.tokenize(prompt, template)
    reason = _engine_choice(scope, engine, generate_kwargs)
    if reason is None:
        from qwen_scope.engine.batches import generate_rows

        rows = [[]] * baseline + [list(edit_list)]
        gens, _ = generate_rows(scope, [ids] * len(rows), rows, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                seed=seed, top_n=top_n, **generate_kwargs)
        passes = dict.fromkeys(_group_edits(scope.saes, edit_list), len(gens[-1].token_ids))
        return SteeringResult(prompt, edit_list, gens[0] if baseline else None, gens[-1],
                              {resid_post(n): c for n, c in passes.items()}, "engine")
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, **generate_kwargs)
    base = _generate(scope, ids, top_n, seed, **kwargs) if baseline else None
    with steering(scope, edit_list, prompt_length=ids.shape[1]) as fired:
        steered = _generate(scope, ids, top_n, seed, **kwargs)
    return SteeringResult(prompt, edit_list, base, steered, dict(fired), f"transformers ({reason})")


def _engine_choice(scope, engine: str, generate_kwargs: Mapping[str, object]) -> str | None:
    """None to generate on the decode engine, else the one-line reason for transformers' ``generate``."""
    if engine not in ("auto", "static", "transformers"):
        raise ValueError(f"engine must be 'auto', 'static' or 'transformers', got {engine!r}")
    if engine == "transformers":
        return "engine='transformers' was asked for"
    from qwen_scope.engine.batches import engine_reason

    reason = engine_reason(scope, generate_kwargs)
    if reason and engine == "static":
        raise ValueError(f"engine='static' cannot run this request: {reason}; use engine='auto' to fall back to "
                         "transformers' generate")
    if reason:
        log.info("steering: transformers' generate, not the decode engine: %s", reason)
    return reason


@dataclass(frozen=True)
class Sweep:
    """Generations of one prompt over a range of strengths (``runs[i]`` belongs to ``strengths[i]``)."""

    prompt: str
    layer: int
    feature: int
    strengths: tuple[float, ...]
    baseline: Generation
    runs: tuple[Generation, ...]

    def table(self) -> str:
        rows = [f"layer {self.layer} feature {self.feature}; baseline: {self.baseline.text!r}"]
        rows += [f"{s:>8g}: {g.text!r}" for s, g in zip(self.strengths, self.runs)]
        return "\n".join(rows)


def sweep(scope, prompt: str, layer: int, feature: int, strengths: Sequence[float], *, mode: str = "add",
          scale: str = "raw", positions: str | int | Sequence[int] = "all", **steer_kwargs) -> Sweep:
    """Steer one feature at several strengths (add) or clamp values (clamp) and collect the continuations.

    Args:
        scope, prompt: as for ``steer``.
        layer, feature: the feature to steer.
        strengths: e.g. ``[-20, -5, 0, 5, 20, 100]``.
        mode: ``"add"`` or ``"clamp"``.
        scale, positions: as for ``add``.
        **steer_kwargs: passed to ``steer`` (``max_new_tokens``, ``template``, ...); ``engine="auto"`` runs the
            baseline and every strength as one batch on the decode engine (default: one generate per strength).

    Returns:
        ``Sweep`` (``.table()`` renders it).
    """
    if mode not in ("add", "clamp"):
        raise ValueError(f"sweep mode must be 'add' or 'clamp', got {mode!r}")
    # Every strength checked before the first generation.
    edits = [add(layer, feature, s, scale=scale, positions=positions) if mode == "add" else
             clamp(layer, feature, s, positions=positions) for s in strengths]
    # The one-generation-per-strength loop stays the default (its calls are what callers count on); engine="auto"
    # or "static" runs the baseline and every strength as one batch on the decode engine.
    engine = steer_kwargs.pop("engine", "transformers")
    generate_kwargs = {k: v for k, v in steer_kwargs.items()
                       if k not in ("max_new_tokens", "do_sample", "template", "top_n", "seed", "baseline")}
    if _engine_choice(scope, engine, generate_kwargs) is None:
        from qwen_scope.engine.batches import sweep_batched

        return sweep_batched(scope, prompt, layer, feature, strengths, mode=mode, scale=scale, positions=positions,
                             **{k: v for k, v in steer_kwargs.items() if k != "baseline"})[0]
    steer_kwargs["engine"] = "transformers"
    base = steer(scope, prompt, [], **{**steer_kwargs, "baseline": False}).steered
    runs = [steer(scope, prompt, [edit], **{**steer_kwargs, "baseline": False}).steered for edit in edits]
    return Sweep(prompt, layer, feature, tuple(float(s) for s in strengths), base, tuple(runs))
