"""Feature explanations with a detection score, written into the feature database.

For each feature the explainer model reads some of its top and quantile-bin examples from the database (the
activating token marked «like this», with its activation) and writes a one-line explanation. Then it judges held-out
examples given only that explanation: activating examples the explainer did not see, and non-activating ones (other
features' examples, whose marked token is not one of this feature's known firings). ``detection_auroc`` is the AUROC
of its ``P(yes)`` over those two sets: 1 when every activating example ranks above every non-activating one, 0.5 for
chance. Explanations are stored with ``db.set_explanation`` (``labels.json``), so ``db.search``, the dashboard and
the Neuronpedia-like export see them; a rerun skips features this explainer already explained.

    chat = TransformersChat("Qwen/Qwen3-0.6B")
    explain_features(db, [348, 949], chat, scope=scope)
    db.search("keyword default")
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from qwen_scope.explore.database import Example, FeatureDatabase
from qwen_scope.explore.views import make_decoder

__all__ = ["Explanation", "auroc", "explain_features", "explain_prompt", "judge_prompt", "split_examples"]

_EXPLAIN = ("Below are text excerpts where one feature of a language model fires. The token it fires on is between "
            "« and », followed by the activation. In one short line, say what the feature detects.\n\n{examples}")
_JUDGE = ("A feature of a language model is explained as: {explanation}\n\nExcerpt: {excerpt}\n\nDoes this feature "
          "fire on the token between « and »? Answer yes or no.")


@dataclass(frozen=True)
class Explanation:
    """One feature's explanation and its detection score.

    Attributes:
        feature: feature id. text: the explanation. explainer: the model that wrote and judged it.
        detection_auroc: AUROC of the judgements (None without both kinds of held-out example).
        scores: ``[(is_activating, P(yes))]`` per held-out example, activating ones first.
    """

    feature: int
    text: str
    explainer: str
    detection_auroc: float | None
    scores: tuple[tuple[bool, float], ...]


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve: the fraction of (positive, negative) pairs the scores order correctly, ties half.

    Example:
        >>> auroc([0.9, 0.4, 0.4, 0.1], [True, True, False, False])
        0.875
    """
    pos = [float(s) for s, y in zip(scores, labels) if y]
    neg = [float(s) for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        raise ValueError(f"AUROC needs positive and negative examples, got {len(pos)} and {len(neg)}")
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _excerpt(strings: Sequence[str], mark: int, value: float | None = None) -> str:
    parts = list(strings)
    parts[mark] = f"«{parts[mark]}»" + ("" if value is None else f" ({value:.2f})")
    return "".join(parts).replace("\n", "\\n")


def explain_prompt(examples: Sequence[tuple[Sequence[str], int, float]]) -> list[dict]:
    """The explainer's conversation for ``(token strings, mark, activation)`` examples."""
    lines = "\n".join(f"{i + 1}. {_excerpt(s, m, v)}" for i, (s, m, v) in enumerate(examples))
    return [{"role": "user", "content": _EXPLAIN.format(examples=lines)}]


def judge_prompt(explanation: str, strings: Sequence[str], mark: int) -> list[dict]:
    """The judge's conversation: does the feature explained as ``explanation`` fire on the marked token?"""
    return [{"role": "user", "content": _JUDGE.format(explanation=explanation, excerpt=_excerpt(strings, mark))}]


def _unique(examples: Iterable[Example], seen: set[int]) -> list[Example]:
    out = []
    for e in examples:
        if e.token_index not in seen:
            seen.add(e.token_index)
            out.append(e)
    return out


def split_examples(db: FeatureDatabase, feature: int, n_explain: int, n_holdout: int, gen: torch.Generator
                   ) -> tuple[list[Example], list[Example], list[Example]]:
    """(shown to the explainer, held-out activating, held-out non-activating) examples of ``feature``.

    Half of the shown ones are the strongest top examples, the rest spread over the quantile-bin samples; the
    held-out activating ones are drawn from what is left; the non-activating ones are other live features' strongest
    examples whose marked token is not a known firing of ``feature``.
    """
    seen: set[int] = set()
    top = _unique(db.top_examples(feature), seen)
    binned = _unique((e for b in db.quantile_bins(feature) for e in b.examples), seen)
    n_top = min(len(top), (n_explain + 1) // 2)
    step = max(1, len(binned) // max(n_explain - n_top, 1))
    from_bins = binned[::step][:n_explain - n_top]
    shown = top[:n_top] + from_bins
    rest = top[n_top:] + [e for e in binned if e not in from_bins]
    held = [rest[i] for i in torch.randperm(len(rest), generator=gen)[:n_holdout].tolist()]
    others = [g for g in torch.nonzero(db.count > 0).flatten().tolist() if g != feature]
    negatives: list[Example] = []
    for g in (others[i] for i in torch.randperm(len(others), generator=gen).tolist()):
        if len(negatives) == n_holdout:
            break
        e = db.top_examples(g, 1)[0]
        if e.token_index not in seen:
            seen.add(e.token_index)
            negatives.append(e)
    return shown, held, negatives


def explain_features(db: FeatureDatabase, features: Iterable[int] | None, explainer, *, scope=None, decode=None,
                     n_explain: int = 10, n_holdout: int = 6, batch_size: int = 8, max_new_tokens: int = 48,
                     seed: int = 0, overwrite: bool = False, progress: bool = True) -> dict[int, Explanation]:
    """Explain ``features`` of ``db`` with ``explainer`` and score each explanation by detection.

    Args:
        db: the feature database (its examples; explanations are stored in it, and saved if it has a path).
        features: feature ids (default: the 20 live features with the largest max activation).
        explainer: a ``TransformersChat``, an ``OpenAIChat`` or anything with their ``complete`` /
            ``yes_probability`` and a ``name``.
        scope, decode: how token ids become text (a ``Scope``, a tokenizer or a callable; see ``make_decoder``).
        n_explain: examples shown per feature. n_holdout: held-out activating and non-activating examples, each.
        batch_size: features per explainer call. max_new_tokens: length of an explanation.
        seed: for the held-out draws. overwrite: explain again features this explainer already explained.
        progress: show a progress bar.
    Returns:
        ``{feature: Explanation}`` for the features explained in this call.
    """
    from qwen_scope.sources import progress_bar

    decoder = make_decoder(decode if decode is not None else scope)
    chosen = [db._check(f) for f in (db.top_features(20) if features is None else features)]
    name = getattr(explainer, "name", type(explainer).__name__)
    todo = [f for f in chosen if int(db.count[f]) > 0
            and (overwrite or (db.explanation(f) or {}).get("explainer") != name)]
    out: dict[int, Explanation] = {}
    bar = progress_bar(total=len(todo), unit="feature", disable=not progress, desc="explaining")
    for a in range(0, len(todo), batch_size):
        batch = todo[a:a + batch_size]
        splits = {f: split_examples(db, f, n_explain, n_holdout, torch.Generator().manual_seed(seed + f))
                  for f in batch}
        texts = explainer.complete([explain_prompt([(decoder(e.tokens), e.mark, e.value) for e in splits[f][0]])
                                    for f in batch], max_new_tokens=max_new_tokens)
        lines = {f: next((s.strip() for s in t.splitlines() if s.strip()), "") for f, t in zip(batch, texts)}
        asks, owners = [], []
        for f in batch:
            _, held, negatives = splits[f]
            for e, label in [(e, True) for e in held] + [(e, False) for e in negatives]:
                asks.append(judge_prompt(lines[f], decoder(e.tokens), e.mark))
                owners.append((f, label))
        judged = explainer.yes_probability(asks) if asks else []
        for f in batch:
            scores = tuple((label, p) for (g, label), p in zip(owners, judged) if g == f)
            labels = [y for y, _ in scores]
            score = auroc([p for _, p in scores], labels) if any(labels) and not all(labels) else None
            out[f] = Explanation(f, lines[f], name, score, scores)
            db.set_explanation(f, lines[f], score=score, explainer=name)
        bar.update(len(batch))
    bar.close()
    return out
