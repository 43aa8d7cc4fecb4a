"""What ``Scope`` runs on the engine: steered generations, baseline + steered pairs and sweeps, each as one batch.

A sweep of N strengths over M prompts is one batched generation of M x (N + 1) rows (each prompt's baseline row
included); its rows are the generations the one-at-a-time loop gives. ``engine_reason`` says, in one line, why a
request must stay on transformers' ``generate`` (the callers log it and record it in their result).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from qwen_scope.engine.engine import DecodeEngine, EngineRow
from qwen_scope.engine.sampling import SamplingConfig
from qwen_scope.steering import FeatureEdit, Generation, Sweep, add, clamp

__all__ = ["engine_reason", "engine_for", "to_generation", "generate_rows", "generate", "sweep_batched",
           "ENGINE_KWARGS"]

log = logging.getLogger("qwen_scope.engine")

# generate() keywords the engine implements; anything else (beams, penalties, processors) stays on transformers.
ENGINE_KWARGS = frozenset({"max_new_tokens", "do_sample", "temperature", "top_k", "top_p"})


def _hooked_module(model: torch.nn.Module) -> str | None:
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return name or type(model).__name__
    return None


def engine_reason(scope, generate_kwargs: Mapping[str, object] = ()) -> str | None:
    """Why ``scope``'s generation cannot run on the decode engine (one line), or None when it can."""
    reason = DecodeEngine.unsupported_reason(scope.model)
    if reason:
        return reason
    other = sorted(set(generate_kwargs) - ENGINE_KWARGS)
    if other:
        return f"generate keywords {other} are not implemented by the engine (it takes {sorted(ENGINE_KWARGS)})"
    hooked = _hooked_module(scope.model)
    if hooked:
        return f"module {hooked!r} has forward hooks, which the engine's decode step would not run"
    return None


def engine_for(scope) -> DecodeEngine:
    """The scope's engine (built once; it keeps the last batch's buffers and captured graph for reuse)."""
    engine = getattr(scope, "_decode_engine", None)
    if engine is None or engine.adapter.model is not scope.model:
        engine = DecodeEngine(scope.model, scope.saes)
        scope._decode_engine = engine
    engine.saes = dict(scope.saes)
    return engine


def sampling_config(scope, do_sample: bool, seed: int | None, kwargs: Mapping[str, object]) -> SamplingConfig:
    """The engine's ``SamplingConfig`` for generate-style keywords, defaulting to the model's generation config."""
    if not do_sample:
        return SamplingConfig(do_sample=False, seed=seed)
    gen = getattr(scope.model, "generation_config", None)

    def pick(name, fallback):
        value = kwargs.get(name, getattr(gen, name, None))
        return fallback if value is None else value

    return SamplingConfig(True, float(pick("temperature", 1.0)), int(pick("top_k", 0)), float(pick("top_p", 1.0)),
                          seed)


def to_generation(scope, row: EngineRow) -> Generation:
    """An ``EngineRow`` as the ``Generation`` that ``Scope.steer`` returns (token strings, text, probabilities)."""
    new = row.token_ids
    return Generation(new, scope.decode_tokens(new), scope.tokenizer.decode(new.tolist(), skip_special_tokens=True),
                      row.probs, row.top_ids, row.top_probs, [scope.decode_tokens(r) for r in row.top_ids])


def generate_rows(scope, prompts: Sequence[torch.Tensor], edits: Sequence[Sequence[FeatureEdit]], *,
                  max_new_tokens: int, do_sample: bool = False, seed: int | None = 0, top_n: int = 5,
                  **kwargs):
    """One batched generation of ``prompts`` (token ids, [P] or [1, P] each), row b steered by ``edits[b]``.

    Returns:
        ``(generations, result)``: a ``Generation`` per row and the engine's ``EngineResult``.
    """
    engine = engine_for(scope)
    result = engine.generate([p.reshape(-1) for p in prompts], [list(e) for e in edits],
                             max_new_tokens=max_new_tokens, sampling=sampling_config(scope, do_sample, seed, kwargs),
                             pad_id=scope.pad_id, top_n=top_n)
    return [to_generation(scope, row) for row in result.rows], result


def sweep_batched(scope, prompts: str | Sequence[str], layer: int, feature: int, strengths: Sequence[float], *,
                  mode: str = "add", scale: str = "raw", positions="all", max_new_tokens: int = 40,
                  template: str | None = None, top_n: int = 5, seed: int | None = 0, do_sample: bool = False,
                  **kwargs) -> list[Sweep]:
    """``steering.sweep`` over several prompts as one batch: per prompt a baseline row and one row per strength.

    Args:
        scope: a ``Scope`` with an SAE at ``layer``.
        prompts: one prompt or several.
        layer, feature, strengths, mode, scale, positions: as ``steering.sweep``.
        max_new_tokens, template, top_n, seed, do_sample, **kwargs: as ``steering.steer``.

    Returns:
        one ``Sweep`` per prompt, equal to ``steering.sweep`` run prompt by prompt.

    Example:
        >>> [s.table() for s in sweep_batched(scope, ["Once", "The"], 12, 4242, [-20, 0, 20, 100])]
    """
    if mode not in ("add", "clamp"):
        raise ValueError(f"sweep mode must be 'add' or 'clamp', got {mode!r}")
    edits = [add(layer, feature, s, scale=scale, positions=positions) if mode == "add" else
             clamp(layer, feature, s, positions=positions) for s in strengths]
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [scope.tokenize(t, template)[0] for t in texts]
    rows_ids, rows_edits = [], []
    for p in ids:
        rows_ids += [p] * (len(edits) + 1)
        rows_edits += [[]] + [[e] for e in edits]
    gens, _ = generate_rows(scope, rows_ids, rows_edits, max_new_tokens=max_new_tokens, do_sample=do_sample,
                            seed=seed, top_n=top_n, **kwargs)
    width = len(edits) + 1
    return [Sweep(text, layer, feature, tuple(float(s) for s in strengths), gens[i * width],
                  tuple(gens[i * width + 1: (i + 1) * width])) for i, text in enumerate(texts)]


def generate(scope, prompts: str | Sequence[str], edits: FeatureEdit | Sequence[FeatureEdit] = (), *,
             max_new_tokens: int = 40, do_sample: bool = False, template: str | None = None, top_n: int = 5,
             seed: int | None = 0, engine: str = "auto", **generate_kwargs) -> list[Generation]:
    """Generate from one prompt or a batch of prompts, every row steered by ``edits``.

    Args:
        scope: a ``Scope`` (with SAEs at the edited layers).
        prompts: a prompt or a list of prompts (one row each, lengths may differ).
        edits: ``FeatureEdit``s applied to every row (none: plain generation).
        max_new_tokens, do_sample, template, top_n, seed, **generate_kwargs: as ``steering.steer``.
        engine: ``"auto"``, ``"static"`` or ``"transformers"``, as ``steering.steer``.

    Returns:
        one ``Generation`` per prompt.

    Example:
        >>> [g.text for g in generate(scope, ["Once upon a time", "The"], [add(12, 4242, 20.0)])]
    """
    from qwen_scope.steering import _engine_choice, _generate, _group_edits, steering

    edit_list = [edits] if isinstance(edits, FeatureEdit) else list(edits)
    _group_edits(scope.saes, edit_list)
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [scope.tokenize(t, template) for t in texts]
    if _engine_choice(scope, engine, generate_kwargs) is None:
        gens, _ = generate_rows(scope, ids, [edit_list] * len(ids), max_new_tokens=max_new_tokens,
                                do_sample=do_sample, seed=seed, top_n=top_n, **generate_kwargs)
        return gens
    out = []
    for row in ids:
        with steering(scope, edit_list, prompt_length=row.shape[1]):
            out.append(_generate(scope, row, top_n, seed, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 **generate_kwargs))
    return out
