"""Long-tail data synthesis: generate text for the SAE features a training set never activates, verify, retry.

The Qwen-Scope report's synthesis use (reference ``qwen-scope-saes.md`` §2.3: 99.74% target-feature coverage, "15x
data efficiency"): the features of a target footprint that the training set misses (``FeatureFootprint.missing``)
are the long tail. For each, a prompt is built from what is known of it: the text just before its strongest
activation in the examples it fires on, its logit-lens tokens, an explanation if one is given. A generator writes
candidates for a batch of open targets at once; each candidate's document scores say which targets it really hits
(any open target, not only the one it was written for); a candidate that hits a still-open target is kept, the
targets still open are retried, and the loop stops when every target is covered, every target has used its
attempts, or the sample budget is spent.

The baseline is random sampling from the same generator: prompts drawn at random from a pool that knows nothing of
the targets. ``efficiency`` compares the two curves of coverage against generated samples: how many samples random
sampling needs to reach a coverage level over how many the loop needs (the report's "15x").

    gaps = train.missing(target)                                      # {layer: feature ids}
    prompts = feature_prompts(scope, gaps, examples=pool_texts)
    run = synthesize(scope, TextGenerator(model, tokenizer), prompts, budget=256)
    base = sample_coverage(scope, TextGenerator(model, tokenizer), random_prompts, gaps, budget=256)
    efficiency(run, base).ratio; coverage_figure({"targeted": run, "random": base})
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from qwen_scope.applications.scoring import document_scores

__all__ = ["FeaturePrompt", "feature_prompts", "TextGenerator", "Candidate", "SynthesisRun", "synthesize", "sample_coverage",
           "Efficiency", "efficiency", "coverage_figure"]

Generator = Callable[[list[str]], list[str]]


@dataclass(frozen=True)
class FeaturePrompt:
    """What the generator is asked, for one target feature.

    Attributes:
        layer, feature: the target. prompts: the generator's inputs, one variant per attempt in turn.
        examples: snippets of texts the feature fires on (strongest first). lens: its logit-lens tokens.
        explanation: a description of the feature, when given.
    """

    layer: int
    feature: int
    prompts: tuple[str, ...]
    examples: tuple[str, ...] = ()
    lens: tuple[str, ...] = ()
    explanation: str | None = None

    @property
    def prompt(self) -> str:
        """The first variant."""
        return self.prompts[0]

    def attempt(self, i: int) -> str:
        """The prompt of the ``i``-th attempt (0-based): the variants in turn."""
        return self.prompts[i % len(self.prompts)]


def _targets(targets: Mapping[int, Iterable[int]]) -> list[tuple[int, int]]:
    out = [(int(n), int(f)) for n, ids in targets.items() for f in torch.as_tensor(list(ids)).tolist()]
    if not out:
        raise ValueError("no target features: the training footprint already covers the target (pass "
                         "train.missing(target) with a non-empty result, or a larger target footprint)")
    return out


def _prefixes(scope, texts: Sequence[str], wanted: list[tuple[int, int, int]], context_tokens: int) -> list[str]:
    """For each ``(text index, layer, feature)``: the ``context_tokens`` tokens of that text just before the
    feature's strongest position after position 0 (the generator has to write that token itself). One forward per
    distinct text."""
    cache: dict[int, object] = {}
    layers = sorted({n for _, n, _ in wanted})
    out = []
    for i, n, f in wanted:
        if i not in cache:
            cache[i] = scope.features(texts[i], layers)
        feats = cache[i]
        lf = feats[n]
        hit = (lf.indices == f) & (lf.values > 0)
        column = (lf.values * hit).sum(1)
        column[0] = 0
        peak = max(1, int(column.argmax()))
        out.append(scope.tokenizer.decode(feats.token_ids[max(0, peak - context_tokens):peak].tolist()))
    return out


def feature_prompts(scope, targets: Mapping[int, Iterable[int]], examples: Sequence[str], *, n_examples: int = 3,
                    context_tokens: int = 32, lens_top: int = 5, explanations: Mapping[tuple[int, int], str] | None =
                    None, style: str = "continue", batch_size: int = 16) -> list[FeaturePrompt]:
    """One prompt per target feature, from the examples it fires on, its logit lens and an explanation.

    Args:
        scope: a ``Scope`` with SAEs at the target layers.
        targets: ``{layer: feature ids}`` (e.g. ``train.missing(target)``).
        examples: texts to find each feature's activating examples in (a corpus the target footprint came from).
        n_examples: examples kept per feature. context_tokens: tokens before the peak kept as a continuation prompt.
        lens_top: logit-lens tokens kept. explanations: ``{(layer, feature): text}``.
        style: ``"continue"`` (base models: the text before the feature's strongest activation in each of its
            examples, one prompt variant per example, or its logit-lens tokens where no example fires) or
            ``"instruct"`` (chat models: one instruction listing the explanation, the examples and the tokens).
        batch_size: texts per forward when scoring ``examples``.

    Returns:
        ``[FeaturePrompt]`` in the order of ``targets``.
    """
    from qwen_scope.explore import logit_lens

    if style not in ("continue", "instruct"):
        raise ValueError(f"style must be 'continue' or 'instruct', got {style!r}")
    wanted = _targets(targets)
    examples = list(examples)
    layers = sorted({n for n, _ in wanted})
    scores = document_scores(scope, examples, layers, batch_size=batch_size) if examples else {}
    lens = {}
    for n in layers:
        ids = [f for m, f in wanted if m == n]
        views = logit_lens(scope, scope.sae(n).W_dec.detach()[:, ids].T.float(), top=lens_top)
        lens.update({(n, f): tuple(scope.tokenizer.decode([i]) for i in v.top_ids) for f, v in zip(ids, views)})
    best = {}
    for n, f in wanted:
        col = scores[n][:, f] if examples else torch.zeros(0)
        best[(n, f)] = [int(i) for i in col.argsort(descending=True)[:n_examples] if col[i] > 0]
    flat = [(i, n, f) for n, f in wanted for i in best[(n, f)]]
    snippets = iter(_prefixes(scope, examples, flat, context_tokens))
    out = []
    for n, f in wanted:
        found = tuple(next(snippets) for _ in best[(n, f)])
        tokens, explanation = lens[(n, f)], (explanations or {}).get((n, f))
        if style == "continue":
            variants = found or ("".join(tokens[:3]),)
        else:
            lines = ["Write a short text in which the following feature is clearly present."]
            if explanation:
                lines.append(f"The feature: {explanation}")
            lines += [f"Example: {x}" for x in found]
            lines.append(f"Related tokens: {', '.join(repr(t) for t in tokens)}")
            variants = ("\n".join(lines),)
        out.append(FeaturePrompt(n, f, variants, found, tokens, explanation))
    return out


class TextGenerator:
    """A local transformers causal LM as a batched generator: ``gen(prompts) -> continuations``.

    Prompts are left-padded into one batch per call and sampled together; on a Hopper GPU with tilelang the call
    runs under ``flashqla_kernels.patched_transformers(fused_layer=True)`` (the fused path ``collect`` uses), on
    other devices under transformers' own forward. Each call draws from its own seed (``seed`` + call number), so a
    run is reproducible.

    Args:
        model: a causal LM (e.g. ``scope.model``). tokenizer: its tokenizer.
        max_new_tokens: tokens written per prompt. temperature: sampling temperature (0 = greedy).
        top_k: sample from the k likeliest tokens (None: all). seed: the first call's seed.

    Example:
        >>> gen = TextGenerator(scope.model, scope.tokenizer, max_new_tokens=32)
        >>> gen(["def read(path):", "The module"])
    """

    def __init__(self, model, tokenizer, *, max_new_tokens: int = 48, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0):
        if max_new_tokens < 1 or temperature < 0:
            raise ValueError(f"need max_new_tokens >= 1 and temperature >= 0, got {max_new_tokens}, {temperature}")
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_k = int(max_new_tokens), float(temperature), top_k
        self.seed, self.calls = int(seed), 0

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(self.tokenizer.eos_token_id if pad is None else pad)

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> list[str]:
        from hooks import get_adapter
        from qwen_scope.collect import gdn_context

        device = next(self.model.parameters()).device
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] or [self._pad_id()] for p in prompts]
        length = max(len(i) for i in ids)
        pad = self._pad_id()
        batch = torch.tensor([[pad] * (length - len(i)) + i for i in ids], device=device)
        mask = torch.tensor([[0] * (length - len(i)) + [1] * len(i) for i in ids], device=device)
        torch.manual_seed(self.seed + self.calls)
        self.calls += 1
        sampling = dict(do_sample=True, temperature=self.temperature, top_k=self.top_k or 0) if self.temperature \
            else dict(do_sample=False)
        context, _ = gdn_context(get_adapter(self.model), device, None)
        with context:
            out = self.model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                      pad_token_id=pad, **sampling)
        return [self.tokenizer.decode(row[length:].tolist(), skip_special_tokens=True) for row in out]


@dataclass(frozen=True)
class Candidate:
    """A kept sample: the generated text, its prompt, the target it was written for and the open targets it hit."""

    text: str
    prompt: str
    aimed_at: tuple[int, int] | None
    hits: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SynthesisRun:
    """A generation run against a target set.

    Attributes:
        kept: the samples that hit a still-open target, in order.
        curve: ``(generated, covered)`` after each batch, starting at ``(0, 0)``.
        targets: every target ``(layer, feature)``. covered: those some sample hit. attempts: samples aimed at each.
    """

    kept: tuple[Candidate, ...]
    curve: tuple[tuple[int, int], ...]
    targets: tuple[tuple[int, int], ...]
    covered: frozenset[tuple[int, int]]
    attempts: Mapping[tuple[int, int], int]

    @property
    def generated(self) -> int:
        return self.curve[-1][0]

    @property
    def coverage(self) -> float:
        """Share of the targets covered."""
        return len(self.covered) / len(self.targets)

    def samples_to_reach(self, covered: int) -> int | None:
        """Generated samples when the run first covered at least ``covered`` targets (None if it never did)."""
        return next((g for g, c in self.curve if c >= covered), None)

    def __repr__(self) -> str:
        return (f"SynthesisRun(covered {len(self.covered)}/{len(self.targets)} targets ({self.coverage:.0%}) with "
                f"{self.generated} generated samples, {len(self.kept)} kept)")


def _hits(scope, texts: list[str], open_: set[tuple[int, int]], threshold: float, batch_size: int
          ) -> list[list[tuple[int, int]]]:
    layers = sorted({n for n, _ in open_})
    scores = document_scores(scope, texts, layers, batch_size=batch_size)
    return [[t for t in sorted(open_) if float(scores[t[0]][i, t[1]]) > threshold] for i in range(len(texts))]


def _generate(generator: Generator, prompts: list[str]) -> list[str]:
    out = list(generator(prompts))
    if len(out) != len(prompts) or not all(isinstance(t, str) for t in out):
        raise TypeError(f"the generator must return one str per prompt: got {len(out)} outputs for {len(prompts)} "
                        "prompts")
    return out


def synthesize(scope, generator: Generator, prompts: Sequence[FeaturePrompt], *, budget: int, batch_size: int = 16,
               attempts: int = 4, threshold: float = 0.0) -> SynthesisRun:
    """The targeted loop: write for open targets, verify, keep the hits, retry the misses, stop at ``budget``.

    Args:
        scope: a ``Scope`` with SAEs at the targets' layers (the verifier).
        generator: ``prompts -> texts`` (``TextGenerator`` or any callable returning one str per prompt).
        prompts: one ``FeaturePrompt`` per target (``feature_prompts``).
        budget: most samples generated in all. batch_size: samples per generator call (open targets are cycled to
            fill a batch). attempts: most samples aimed at one target.
        threshold: a sample hits a feature when its document score is above this.

    Returns:
        the ``SynthesisRun``.

    Raises:
        ValueError: no sample hit any target (the message says how many were tried and what to change).
    """
    if not prompts:
        raise ValueError("no prompts: build them with feature_prompts(scope, train.missing(target), examples)")
    if budget < 1 or batch_size < 1 or attempts < 1:
        raise ValueError(f"need budget, batch_size and attempts >= 1, got {budget}, {batch_size}, {attempts}")
    by_target = {(p.layer, p.feature): p for p in prompts}
    tried = dict.fromkeys(by_target, 0)
    open_ = set(by_target)
    kept: list[Candidate] = []
    curve = [(0, 0)]
    generated = 0
    while generated < budget:
        ready = [t for t in by_target if t in open_ and tried[t] < attempts]
        if not ready:
            break
        aimed = []
        for t in ready * attempts:
            if len(aimed) == min(batch_size, budget - generated) or tried[t] >= attempts:
                continue
            aimed.append((t, by_target[t].attempt(tried[t])))
            tried[t] += 1
        texts = _generate(generator, [prompt for _, prompt in aimed])
        generated += len(texts)
        for (t, prompt), text, hits in zip(aimed, texts, _hits(scope, texts, open_, threshold, batch_size)):
            new = [h for h in hits if h in open_]
            if new:
                kept.append(Candidate(text, prompt, t, tuple(new)))
                open_ -= set(new)
        curve.append((generated, len(by_target) - len(open_)))
    if not kept:
        raise ValueError(f"the generator hit none of the {len(by_target)} target features in {generated} samples "
                         f"({attempts} attempts each, budget {budget}, threshold {threshold}): its texts never carry "
                         "them. Check a prompt (prompts[0].prompt), let it write more (max_new_tokens) or more "
                         "freely (temperature), use a generator that knows the domain, or lower threshold")
    return SynthesisRun(tuple(kept), tuple(curve), tuple(by_target), frozenset(by_target) - frozenset(open_),
                        dict(tried))


def sample_coverage(scope, generator: Generator, prompts: Sequence[str], targets: Mapping[int, Iterable[int]], *,
                    budget: int, batch_size: int = 16, threshold: float = 0.0, seed: int = 0) -> SynthesisRun:
    """The baseline: ``budget`` samples from ``generator`` on prompts drawn uniformly (with replacement, seeded)
    from ``prompts``, which know nothing of the targets; the coverage of ``targets`` they reach, batch by batch."""
    pool = list(prompts)
    if not pool:
        raise ValueError("no prompts to sample from: pass a pool of generic prompts (e.g. random corpus snippets)")
    wanted = _targets(targets)
    g = torch.Generator().manual_seed(seed)
    open_ = set(wanted)
    kept: list[Candidate] = []
    curve = [(0, 0)]
    generated = 0
    while generated < budget and open_:
        n = min(batch_size, budget - generated)
        drawn = [pool[i] for i in torch.randint(len(pool), (n,), generator=g).tolist()]
        texts = _generate(generator, drawn)
        generated += n
        for prompt, text, hits in zip(drawn, texts, _hits(scope, texts, open_, threshold, batch_size)):
            new = [h for h in hits if h in open_]
            if new:
                kept.append(Candidate(text, prompt, None, tuple(new)))
                open_ -= set(new)
        curve.append((generated, len(wanted) - len(open_)))
    return SynthesisRun(tuple(kept), tuple(curve), tuple(wanted), frozenset(wanted) - frozenset(open_), {})


@dataclass(frozen=True)
class Efficiency:
    """How many fewer samples the targeted loop needs than random sampling for the same coverage.

    Attributes:
        level: the coverage compared (targets covered: the lower of the two runs' final coverage).
        targeted_samples, random_samples: samples each needed to first reach ``level``.
        ratio: random_samples / targeted_samples.
        random_short: random sampling ended below the loop's final coverage (so the loop also covers more).
    """

    level: int
    targeted_samples: int
    random_samples: int
    ratio: float
    random_short: bool

    def __str__(self) -> str:
        more = "; random sampling never reached the loop's coverage" if self.random_short else ""
        return (f"{self.level} targets covered: {self.targeted_samples} targeted vs {self.random_samples} random "
                f"samples ({self.ratio:.1f}x){more}")


def efficiency(targeted: SynthesisRun, random: SynthesisRun) -> Efficiency:
    """The data-efficiency ratio of ``targeted`` over ``random`` at the coverage both reach."""
    if set(targeted.targets) != set(random.targets):
        raise ValueError(f"the runs aim at different targets ({len(targeted.targets)} vs {len(random.targets)}); "
                         "run both against the same footprint gap")
    level = min(len(targeted.covered), len(random.covered))
    if level == 0:
        raise ValueError(f"one run covered no target (targeted {len(targeted.covered)}, random "
                         f"{len(random.covered)}): no common coverage level to compare; raise the random budget")
    t, r = targeted.samples_to_reach(level), random.samples_to_reach(level)
    return Efficiency(level, t, r, r / t, len(random.covered) < len(targeted.covered))


def coverage_figure(runs: Mapping[str, SynthesisRun], *, title: str = "target coverage vs generated samples"
                    ) -> go.Figure:
    """Coverage (share of targets) against generated samples, one line per ``{name: run}``."""
    fig = go.Figure()
    for name, run in runs.items():
        fig.add_trace(go.Scatter(x=[g for g, _ in run.curve], y=[c / len(run.targets) for _, c in run.curve],
                                 mode="lines+markers", name=name, line_shape="hv"))
    fig.update_layout(title=title, xaxis_title="generated samples", yaxis_title="target features covered",
                      yaxis_tickformat=".0%", yaxis_range=[0, 1.02], template="plotly_white", height=420)
    return fig
