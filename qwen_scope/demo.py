"""The offline tour (seconds on the bundled nano model): model + SAE -> collect -> feature database -> dashboard -> report -> steering.

By default it runs offline on the bundled nano model and its SAE set (``qwen_scope.nano``) over the bundled corpus
slice; ``model=`` / ``release=`` run the same steps on a real Qwen model and a Qwen-Scope release.

    >>> result = run_demo(DemoConfig(out_dir="qwen-scope-demo"))
    >>> print(result.report)
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwen_scope.explore.views import vocab_limit

__all__ = ["DemoConfig", "DemoResult", "run_demo", "logit_lens"]

SAMPLE_TEXT = ('def read_config(path):\n    """Return the settings stored in the file at path."""\n'
               '    with open(path) as f:\n        return json.load(f)\n')
STEER_PROMPT = "The function returns"


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs on.

    Args:
        out_dir: where the store, the feature database, the dashboard and ``report.txt`` go.
        model: model hub id or directory (``None`` = the bundled nano model).
        release: SAE release id / repo / directory (``None`` = the nano SAE set; required with ``model``).
        layer: SAE layer explored (``None`` = the middle layer).
        corpus: list of texts to collect over (``None`` = the bundled corpus slice).
        tokens: token budget of the collection.
        context_len: tokens per collected row.
        text: sample text whose top features are reported.
        steer_prompt: prompt of the steering comparison.
        n_features: features in the report.
        strength: steering strength, in units of the feature's largest activation in the corpus.
        max_new_tokens: length of the steered continuations.
        dashboard_features: feature pages in the dashboard (the report's features plus the strongest ones).
        device: ``"cpu"`` or ``"cuda"``.
    """

    out_dir: str | Path = "qwen-scope-demo"
    model: str | None = None
    release: str | None = None
    layer: int | None = None
    corpus: tuple[str, ...] | None = None
    tokens: int = 24_000
    context_len: int = 256
    text: str = SAMPLE_TEXT
    steer_prompt: str = STEER_PROMPT
    n_features: int = 5
    strength: float = 1.0
    max_new_tokens: int = 32
    dashboard_features: int = 48
    device: str = "cpu"


@dataclass
class DemoResult:
    """Paths written, the plain-text report and the numbers behind it."""

    out_dir: Path
    report: str
    dashboard: Path | None
    database: Path
    store: Path
    top_features: list[dict] = field(default_factory=list)
    steering: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


@torch.no_grad()
def logit_lens(scope, layer: int, feature: int, n: int = 8) -> tuple[list[str], list[str]]:
    """Tokens a feature's decoder direction promotes / suppresses: ``lm_head(final_norm(W_dec[:, feature]))``.

    Args:
        scope: a ``Scope`` with an SAE at ``layer``.
        layer, feature: which feature.
        n: tokens per side.
    Returns:
        ``(top, bottom)`` lists of decoded token strings.
    """
    adapter = scope.adapter
    direction = scope.sae(layer).decoder_directions(feature).to(scope.device, scope.dtype)     # [1, d_model]
    logits = adapter.unembed(adapter.final_norm(direction))[0, :vocab_limit(scope)].float()
    return _readable(scope, logits.topk(8 * n).indices, n), _readable(scope, (-logits).topk(8 * n).indices, n)


def _readable(scope, ids: torch.Tensor, n: int) -> list[str]:
    """The first ``n`` tokens that decode to printable text (drops partial UTF-8 bytes and control characters)."""
    out = [t for t in scope.decode_tokens(ids) if t and "\ufffd" not in t and (t.isprintable() or t.isspace())]
    return out[:n]


def _load_scope(config: DemoConfig):
    from qwen_scope.scope import Scope

    model, release = config.model, config.release
    if model is None:
        from qwen_scope.nano import NANO_DIR, NANO_RELEASE_DIR

        model, release = NANO_DIR, release or NANO_RELEASE_DIR
    if release is None:
        raise ValueError(f"--model {model} needs --release: the SAE release to explore "
                         f"(e.g. qwen-scope-3.5-2b-base-w32k-l50; `qwen-scope releases` lists them)")
    scope = Scope.from_pretrained(model, release, device=config.device)
    layer = config.layer if config.layer is not None else scope.adapter.n_layers // 2
    scope.load_saes(str(release), [layer])
    return scope, layer


def _corpus(config: DemoConfig) -> list[str]:
    if config.corpus is not None:
        return list(config.corpus)
    from qwen_scope.nano import nano_corpus

    return nano_corpus()


def _example_text(scope, ex, width: int = 40) -> str:
    pieces = scope.decode_tokens(list(ex.tokens))
    text = "".join(p if i != ex.mark else f"[{p}]" for i, p in enumerate(pieces))
    return repr(text.replace("\n", "⏎"))[1:-1][:width * 2]


def run_demo(config: DemoConfig = DemoConfig(), *, echo: Callable[[str], None] = print) -> DemoResult:
    """Run the whole tour and write its outputs under ``config.out_dir``.

    Returns:
        ``DemoResult`` with the report text and the paths of the store, database and dashboard.
    """
    from qwen_scope.collect import collect
    from qwen_scope.explore import build_feature_database, store_chunks
    from qwen_scope.store import ActivationStore

    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    t = time.time()
    scope, layer = _load_scope(config)
    sae, point = scope.sae(layer), scope.hook_name(layer)
    seconds["load"] = time.time() - t
    echo(f"[1/5] loaded {scope.model_name} with an SAE at layer {layer} (d_sae {sae.d_sae}, k {sae.k})")

    t = time.time()
    summary = collect(scope.model, _corpus(config), saes={layer: sae}, token_budget=config.tokens,
                      context_len=config.context_len, out_dir=out / "store", tokenizer=scope.tokenizer,
                      progress=False, overwrite=True)
    seconds["collect"] = time.time() - t
    echo(f"[2/5] {summary}")

    t = time.time()
    store = ActivationStore(out / "store")
    db = build_feature_database(store_chunks(store, point), sae.d_sae,
                                meta={"model": scope.model_name, "layer": layer, "point": point})
    db_path = db.save(out / "features")
    seconds["database"] = time.time() - t
    echo(f"[3/5] feature database of {int((db.density > 0).sum())} live features -> {db_path}")

    t = time.time()
    report, top, steer_info = _report(config, scope, layer, db)
    seconds["report"] = time.time() - t

    t = time.time()
    pages = list(dict.fromkeys([f["feature"] for f in top] + db.top_features(config.dashboard_features)))
    dashboard = _write_dashboard(db, scope, layer, out, pages)
    seconds["dashboard"] = time.time() - t
    echo(f"[4/5] dashboard ({len(pages)} feature pages) -> {dashboard}" if dashboard
         else "[4/5] dashboard writer not available")
    (out / "report.txt").write_text(report + "\n", encoding="utf-8")
    (out / "summary.json").write_text(json.dumps({"layer": layer, "top_features": top, "steering": steer_info,
                                                  "seconds": seconds}, indent=1))
    echo("[5/5] report:\n" + report)
    return DemoResult(out, report, dashboard, Path(db_path), out / "store", top, steer_info, seconds)


def _write_dashboard(db, scope, layer: int, out: Path, features: list[int]) -> Path:
    from qwen_scope.explore import write_dashboard

    return Path(write_dashboard(db, out / "dashboard.html", scope=scope, layer=layer, features=features))


def _report(config: DemoConfig, scope, layer: int, db) -> tuple[str, list[dict], dict]:
    from qwen_scope.steering import add

    feats = scope.features(config.text, layers=layer)
    lines = [f"Sample text ({len(config.text)} chars), layer {layer}: FVE {feats[layer].fve:.3f}", ""]
    top = []
    for stat in feats.top(layer, config.n_features):
        up, _ = logit_lens(scope, layer, stat.feature, 6)
        examples = [_example_text(scope, ex) for ex in db.top_examples(stat.feature, 3)]
        top.append({"feature": stat.feature, "max": stat.max, "rate": stat.rate, "logit_lens": up,
                    "examples": examples})
        lines.append(f"feature #{stat.feature}: max {stat.max:.2f} on {100 * stat.rate:.0f}% of tokens")
        lines.append(f"    logit lens: {' '.join(repr(u) for u in up)}")
        for e in examples:
            lines.append(f"    corpus: {e}")
    feature = top[0]["feature"]
    strength = config.strength * float(db.max_activation[feature])
    result = scope.steer(config.steer_prompt, [add(layer, feature, strength)], max_new_tokens=config.max_new_tokens)
    lines += ["", f"Steering: add {strength:.1f} x decoder direction of feature #{feature} at layer {layer}",
              f"    prompt:   {config.steer_prompt!r}",
              f"    baseline: {result.baseline.text!r}",
              f"    steered:  {result.steered.text!r}"]
    steer_info = {"feature": feature, "strength": strength, "prompt": config.steer_prompt,
                  "baseline": result.baseline.text, "steered": result.steered.text}
    return "\n".join(lines), top, steer_info
