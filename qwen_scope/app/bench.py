"""The steering bench: features and strengths → baseline and steered generations side by side, streamed token by
token on the decode engine (where it runs; else ``Scope.steer`` on transformers' ``generate``, in one piece), and a
strength sweep plotted.

    bench = SteeringBench(scope)
    edits = bench.edits("3:42, 3:7", [8.0, -4.0], positions="generated")
    for view in bench.stream("def close(self):", edits, max_new_tokens=16):
        print(view.steered.tokens)                   # grows by one token per step; the last view is done
    sweep, fig = bench.sweep("def ", 3, 42, [-8, 0, 8])
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from hooks import resid_post
from qwen_scope.steering import FeatureEdit, SteeringResult, Sweep, steer, sweep

__all__ = ["SteeringBench", "SteerView", "SideView", "parse_features"]

_ITEM = re.compile(r"^(?:(\d+)\s*:\s*)?(\d+)$")


@dataclass(frozen=True)
class SideView:
    """One side of the bench: its tokens so far, and per step the chosen token's probability (once done)."""

    tokens: tuple[str, ...]
    probs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class SteerView:
    """Baseline and steered generations of one prompt, partial while streaming.

    Attributes:
        prompt, edits: what was asked. baseline, steered: the two sides. done: the generation has finished.
        result: the ``SteeringResult`` (equal to ``Scope.steer``'s) once done, else None.
        generated_by: ``"engine"`` or why transformers' ``generate`` ran instead.
    """

    prompt: str
    edits: tuple[FeatureEdit, ...]
    baseline: SideView
    steered: SideView
    done: bool
    result: SteeringResult | None
    generated_by: str


def parse_features(spec: str | Sequence[int | str], layer: int) -> list[tuple[int, int]]:
    """``"42, 3:7"`` (or ``[42, "3:7"]``) → ``[(layer, 42), (3, 7)]``: bare ids take ``layer``.

    Raises:
        ValueError: an item that is not ``FEATURE`` or ``LAYER:FEATURE``.
    """
    items = re.split(r"[,\s]+", spec.strip()) if isinstance(spec, str) else [str(s).strip() for s in spec]
    out = []
    for item in (i for i in items if i):
        m = _ITEM.match(item)
        if m is None:
            raise ValueError(f"feature {item!r} is not FEATURE or LAYER:FEATURE; write e.g. '42' or '3:42', "
                             "separated by commas")
        out.append((int(m[1]) if m[1] is not None else int(layer), int(m[2])))
    return out


class SteeringBench:
    """Steered generations of a ``Scope`` for the explorer.

    Args:
        scope: a ``Scope`` with SAEs at the layers to steer.
        label: ``label(feature, layer) -> str`` naming a feature in the sweep figure (default: none).
    """

    def __init__(self, scope, label: Callable[[int, int], str] | None = None):
        self.scope = scope
        self.label = label or (lambda feature, layer: "")

    def edits(self, features: str | Sequence[int | str], strengths: float | Sequence[float], *,
              layer: int | None = None, mode: str = "add", scale: str = "raw",
              positions: str = "all") -> list[FeatureEdit]:
        """The edits of the bench: one per feature, strengths broadcast from one value or given one per feature.

        Args:
            features: ``"42, 3:7"`` or a list of ids / ``"LAYER:FEATURE"`` (bare ids at ``layer``).
            strengths: one strength for all, or one per feature (clamp: the target values).
            layer: the layer of bare ids (default: the scope's only or middle SAE layer).
            mode, scale, positions: as ``qwen_scope.steering.FeatureEdit``.
        """
        layer = self.scope.layers[len(self.scope.layers) // 2] if layer is None else layer
        pairs = parse_features(features, layer)
        if not pairs:
            raise ValueError("no feature to steer; give one or more ids like '42' or '3:42' (search finds them)")
        values = [float(strengths)] * len(pairs) if isinstance(strengths, (int, float)) else list(strengths)
        if len(values) == 1:
            values *= len(pairs)
        if len(values) != len(pairs):
            raise ValueError(f"{len(values)} strengths for {len(pairs)} features; give one strength for all or one "
                             "per feature")
        return [FeatureEdit(n, f, mode, 0.0 if mode == "ablate" else v, scale if mode == "add" else "raw", positions)
                for (n, f), v in zip(pairs, values)]

    def stream(self, prompt: str, edits: Sequence[FeatureEdit], *, max_new_tokens: int = 24, top_n: int = 5,
               seed: int | None = 0, template: str | None = None) -> Iterator[SteerView]:
        """Generate greedily without and with ``edits``, yielding the two sides after every step.

        On the decode engine both sides are one batch and a view comes per token; otherwise the one view is the
        finished ``Scope.steer`` result. The last view's ``result`` equals ``Scope.steer(prompt, edits, ...)``.
        """
        from qwen_scope.engine.batches import engine_reason

        edits = tuple(edits)
        if not edits:
            raise ValueError("no edit to steer with; pick at least one feature and a strength")
        if not prompt:
            raise ValueError("the prompt is empty; type a text to continue")
        kwargs = dict(max_new_tokens=max_new_tokens, top_n=top_n, seed=seed, template=template)
        reason = engine_reason(self.scope)
        if reason is not None:
            yield _finished(steer(self.scope, prompt, list(edits), **kwargs))
            return
        yield from self._stream_engine(prompt, edits, **kwargs)

    def _stream_engine(self, prompt, edits, *, max_new_tokens, top_n, seed, template) -> Iterator[SteerView]:
        from qwen_scope.engine.batches import engine_for, sampling_config, to_generation

        scope = self.scope
        ids = scope.tokenize(prompt, template)[0]
        engine = engine_for(scope)
        run = engine.stream([ids, ids], [[], list(edits)], max_new_tokens=max_new_tokens,
                            sampling=sampling_config(scope, False, seed, {}), pad_id=scope.pad_id, top_n=top_n)
        eos = getattr(getattr(scope.model, "generation_config", None), "eos_token_id", None)
        stops = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
        rows: list[list[int]] = [[], []]
        while True:
            try:
                step = next(run).tolist()
            except StopIteration as done:
                result = done.value
                break
            for row, token in zip(rows, step):
                if not row or row[-1] not in stops:
                    row.append(token)
            yield SteerView(prompt, edits, SideView(tuple(scope.decode_tokens(rows[0]))),
                            SideView(tuple(scope.decode_tokens(rows[1]))), False, None, "engine")
        base, steered = (to_generation(scope, row) for row in result.rows)
        fired = {resid_post(n): len(steered.token_ids) for n in sorted({e.layer for e in edits})}
        yield _finished(SteeringResult(prompt, edits, base, steered, fired, "engine"))

    def run(self, prompt: str, edits: Sequence[FeatureEdit], **kwargs) -> SteerView:
        """The finished view of ``stream`` (see there)."""
        view = None
        for view in self.stream(prompt, edits, **kwargs):
            pass
        return view

    def sweep(self, prompt: str, layer: int, feature: int, strengths: Sequence[float], *, mode: str = "add",
              scale: str = "raw", positions: str = "all", max_new_tokens: int = 24, template: str | None = None):
        """Generations of one feature over ``strengths`` (one batch on the engine) and their figure.

        Returns:
            ``(Sweep, figure)``: per strength the share of generated tokens that differ from the baseline and the
            mean probability of the chosen tokens, the continuation in the hover.
        """
        if len(strengths) == 0:
            raise ValueError("no strengths to sweep; give a list such as -20,-5,0,5,20")
        result = sweep(self.scope, prompt, layer, feature, list(strengths), mode=mode, scale=scale,
                       positions=positions, max_new_tokens=max_new_tokens, template=template, engine="auto")
        return result, sweep_figure(result, self.label(feature, layer))


def sweep_figure(result: Sweep, label: str = ""):
    """Per strength: the share of generated tokens differing from the baseline, and the mean chosen probability."""
    import plotly.graph_objects as go

    base = result.baseline.token_ids.tolist()
    changed, mean_p, texts = [], [], []
    for g in result.runs:
        ids = g.token_ids.tolist()
        n = max(len(ids), len(base), 1)
        same = sum(a == b for a, b in zip(ids, base))
        changed.append(1 - same / n)
        mean_p.append(float(g.probs.mean()) if len(g.probs) else 0.0)
        texts.append(repr(g.text)[1:-1][:120])
    x = list(result.strengths)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=changed, name="tokens changed vs baseline", mode="lines+markers",
                             customdata=texts, hovertemplate="strength %{x}: %{y:.0%} changed<br>%{customdata}"
                                                             "<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=mean_p, name="mean probability of the chosen tokens", mode="lines+markers",
                             customdata=texts, hovertemplate="strength %{x}: mean p %{y:.3f}<br>%{customdata}"
                                                             "<extra></extra>"))
    name = f"#{result.feature}" + (f" {label}" if label else "")
    fig.update_layout(title=f"Strength sweep: layer {result.layer} feature {name}", height=360,
                      xaxis_title="strength", yaxis_title="fraction / probability", yaxis_range=[0, 1.05])
    return fig


def _finished(result: SteeringResult) -> SteerView:
    def side(g) -> SideView:
        return SideView(tuple(g.tokens), tuple(float(p) for p in g.probs))

    base = side(result.baseline) if result.baseline is not None else SideView(())
    return SteerView(result.prompt, result.edits, base, side(result.steered), True, result, result.generated_by)
