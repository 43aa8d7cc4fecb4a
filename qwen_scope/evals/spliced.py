"""SAE evaluation with the SAE spliced into the model: reconstruction metrics and what the splice costs the model.

Per batch of token rows ``ids [B, T]``: one clean forward records ``resid_post.n`` of every evaluated layer; then, per
layer and per mode, one forward in which block n's output at positions ``>= skip_first`` is replaced by

- ``"sae"``: the SAE reconstruction ``decode(encode(h))``;
- ``"sae+error"``: the reconstruction plus the SAE error ``h - decode(encode(h))`` (this must give the clean loss:
  a check that the splice itself is faithful);
- ``"zero"``: zeros (zero ablation); ``"mean"``: the mean residual of the first batch's spliced tokens (kept with a
  resumed run, so every batch uses the same one).

Position 0 (Qwen's attention sink, its residual norm far above the rest) is left out of the splice and of every
statistic by default, as Qwen-Scope's training left it out. Losses are next-token cross entropies (nats) of the
predictions made at positions ``>= skip_first``. ``ce_recovered`` is sae-lens's CE loss score,
``(loss_zero - loss_sae) / (loss_zero - loss_clean)`` (1 = no cost, 0 = as bad as deleting the residual), computed
from the corpus-mean losses; ``kl`` is the mean per token of ``KL(clean || spliced)`` over the next-token
distributions.

    result = evaluate_saes(nano_scope(), nano_corpus(16), out="runs/eval")    # resumable, progress bar
    print(result.table()); result.figure()
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hooks import capture, intervene, resid_post
from saes import TopKSAE, check_d_model, fused_encode
from qwen_scope.evals.corpus import corpus_rows, rows_fingerprint, token_batches
from qwen_scope.evals.results import LayerEval, SAEEvaluation

__all__ = ["MODES", "EvalConfig", "evaluate_saes"]

MODES = ("sae", "sae+error", "zero", "mean")
STATE_FILE, RESULT_FILE, FIGURE_FILE = "sae_eval.state.pt", "sae_eval.json", "sae_eval.html"


@dataclass(frozen=True)
class EvalConfig:
    """How the corpus is read and what is counted.

    Args:
        context_len: tokens per row (T). batch_size: rows per forward (B).
        max_tokens: tokens read from the corpus (None = all of it).
        skip_first: leading positions of every row neither spliced nor counted (1: the attention sink).
        dense_threshold: a feature firing on more than this fraction of the tokens counts as dense.
        text_column: the text field of corpus records.
    """

    context_len: int = 256
    batch_size: int = 8
    max_tokens: int | None = 65536
    skip_first: int = 1
    dense_threshold: float = 0.1
    text_column: str = "text"

    def __post_init__(self):
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"EvalConfig.max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if not isinstance(self.skip_first, int) or not 0 <= self.skip_first < self.context_len - 1:
            raise ValueError(f"EvalConfig.skip_first must be an int in 0..context_len-2 ({self.context_len - 2}), "
                             f"got {self.skip_first!r}")
        if not 0 < self.dense_threshold <= 1:
            raise ValueError(f"EvalConfig.dense_threshold must lie in (0, 1], got {self.dense_threshold!r}")


def _check_saes(scope, layers, saes: Mapping[int, TopKSAE] | None) -> dict[int, TopKSAE]:
    table = dict(scope.saes if saes is None else saes)
    chosen = sorted(table) if layers is None else ([layers] if isinstance(layers, int) else list(layers))
    if not chosen:
        raise ValueError("no SAE to evaluate: the scope has none attached; load some with scope.load_saes(release, "
                         "layers) or pass saes={layer: sae}")
    out = {}
    for layer in chosen:
        n = scope.adapter.n_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise ValueError(f"layer {layer!r} is outside {scope.model_name or 'the model'}'s decoder blocks 0..{n - 1}")
        if layer not in table:
            raise KeyError(f"no SAE at layer {layer}; SAEs are loaded at layers {sorted(table)}. Load it with "
                           f"scope.load_saes(release, [{layer}])")
        sae = table[layer]
        check_d_model(sae, scope.adapter.d_model, scope.model_name)
        if sae.layer is not None and sae.layer != layer:
            raise ValueError(f"the SAE given for layer {layer} was trained on layer {sae.layer} ({sae.source}); "
                             f"pass it as saes={{{sae.layer}: sae}} or load the layer-{layer} SAE")
        out[layer] = sae
    return out


class _Totals:
    """Running sums of one layer (float64 on the host), saved with the run and restored on resume."""

    def __init__(self, d_model: int, d_sae: int):
        self.n = 0
        self.sse = self.sum_x2 = self.l0 = 0.0
        self.sum_x = torch.zeros(d_model, dtype=torch.float64)
        self.fired = torch.zeros(d_sae, dtype=torch.int64)
        self.nll = dict.fromkeys(MODES, 0.0)
        self.kl = dict.fromkeys(MODES, 0.0)
        self.kl_max = dict.fromkeys(MODES, 0.0)

    def state(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_state(cls, state: dict) -> _Totals:
        out = cls.__new__(cls)
        vars(out).update(state)
        return out


def _splice(mode: str, sae: TopKSAE, skip: int, mean: torch.Tensor | None):
    def edit(act: torch.Tensor, ctx) -> torch.Tensor:
        h = act[:, skip:]
        if mode == "zero":
            new = torch.zeros_like(h)
        elif mode == "mean":
            new = mean.to(h).expand_as(h)
        elif mode == "sae":
            # The encode users run (the TileLang kernel on sm_90 for bf16 residuals), exact by its contract.
            new = sae.decode(fused_encode(h, sae))
        else:
            x = h.float()
            recon = sae(x)
            new = recon + (x - recon)
        return torch.cat([act[:, :skip], new.to(act.dtype)], dim=1)
    return edit


def _nll_kl(logits: torch.Tensor, targets: torch.Tensor, clean: torch.Tensor | None):
    """Per-token NLL and KL(clean || logits), in chunks of tokens so a 250K vocabulary stays within memory."""
    V = logits.shape[-1]
    logits, targets = logits.reshape(-1, V), targets.reshape(-1)
    clean = clean.reshape(-1, V) if clean is not None else None
    step = max(1, 2 ** 25 // V)
    nll, kl = [], []
    for a in range(0, logits.shape[0], step):
        logp = F.log_softmax(logits[a:a + step].float(), dim=-1)
        nll.append(-logp.gather(-1, targets[a:a + step, None])[:, 0])
        if clean is not None:
            ref = F.log_softmax(clean[a:a + step].float(), dim=-1)
            kl.append((ref.exp() * (ref - logp)).sum(-1))
    return torch.cat(nll), (torch.cat(kl) if kl else None)


def _batch(scope, ids: torch.Tensor, saes: dict[int, TopKSAE], totals: dict[int, _Totals],
           means: dict[int, torch.Tensor], skip: int, modes: tuple[str, ...]) -> float:
    """Evaluate one batch into ``totals``; return the batch's clean NLL sum."""
    model = scope.model
    ids = ids.to(scope.device)
    targets = ids[:, skip + 1:]
    with torch.no_grad():
        with capture(model, [resid_post(n) for n in saes]) as cap:
            clean = model(input_ids=ids, use_cache=False).logits[:, skip:-1]
        clean_nll, _ = _nll_kl(clean, targets, None)
        for n, sae in saes.items():
            x = cap[resid_post(n)][:, skip:].reshape(-1, sae.d_model).float()
            if n not in means:
                means[n] = x.mean(0).cpu()
            t = totals[n]
            codes = fused_encode(x, sae)
            recon = sae.decode(codes)
            active = codes.values > 0
            t.n += x.shape[0]
            t.sse += float((recon - x).double().pow(2).sum())
            t.sum_x += x.double().sum(0).cpu()
            t.sum_x2 += float(x.double().pow(2).sum())
            t.l0 += float(active.sum())
            t.fired += torch.bincount(codes.indices[active].cpu(), minlength=sae.d_sae)
            for mode in modes:
                with intervene(model, {resid_post(n): _splice(mode, sae, skip, means[n])}):
                    logits = model(input_ids=ids, use_cache=False).logits[:, skip:-1]
                nll, kl = _nll_kl(logits, targets, clean)
                t.nll[mode] += float(nll.double().sum())
                t.kl[mode] += float(kl.double().sum())
                t.kl_max[mode] = max(t.kl_max[mode], float(kl.max()))
    return float(clean_nll.double().sum())


def _layer_result(layer: int, t: _Totals, sae: TopKSAE, clean_loss: float, n_pred: int, cfg: EvalConfig,
                  modes: tuple[str, ...]) -> LayerEval:
    total_var = t.sum_x2 - float(t.sum_x.pow(2).sum()) / max(t.n, 1)
    loss = {m: t.nll[m] / n_pred for m in modes}
    density = t.fired.double() / max(t.n, 1)

    def recovered(ablated: str) -> float | None:
        if "sae" not in loss or ablated not in loss or loss[ablated] == clean_loss:
            return None
        return (loss[ablated] - loss["sae"]) / (loss[ablated] - clean_loss)

    return LayerEval(
        layer=layer, n_tokens=t.n, n_predictions=n_pred, d_sae=sae.d_sae, k=sae.k,
        fve=1.0 - t.sse / max(total_var, 1e-30), mse=t.sse / max(t.n, 1), l0=t.l0 / max(t.n, 1),
        dead_fraction=float((t.fired == 0).double().mean()),
        dense_fraction=float((density > cfg.dense_threshold).double().mean()), loss_clean=clean_loss,
        loss={m: loss[m] for m in modes}, kl={m: t.kl[m] / n_pred for m in modes},
        kl_max={m: t.kl_max[m] for m in modes}, ce_recovered=recovered("zero"),
        ce_recovered_mean=recovered("mean"))


def _run_meta(scope, saes, cfg: EvalConfig, modes, first: str) -> dict:
    release = scope.release
    mismatch = release.model_mismatch(scope.model_name) if release is not None and scope.model_name else None
    sources = {str(n): (s.source or (s.release.id if s.release is not None else None)) for n, s in saes.items()}
    return {"model": scope.model_name, "release": release.id if release is not None else None,
            "release_mismatch": mismatch, "sae_sources": sources, "layers": sorted(saes), "modes": list(modes),
            "config": dataclasses.asdict(cfg), "first_batch": first}


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    tmp.replace(path)


def evaluate_saes(scope, corpus, layers: int | Iterable[int] | None = None, *, config: EvalConfig | None = None,
                  saes: Mapping[int, TopKSAE] | None = None, modes: Iterable[str] = MODES,
                  out: str | Path | None = None, overwrite: bool = False, progress: bool = True) -> SAEEvaluation:
    """Evaluate SAEs spliced into ``scope.model`` over ``corpus`` (see the module docstring).

    Args:
        scope: a ``Scope``; its SAEs are evaluated unless ``saes`` is given.
        corpus: texts, ``datasets`` records, token-id lists, an ``ActivationStore`` or its directory.
        layers: layers to evaluate (default: every SAE of the scope / of ``saes``).
        config: ``EvalConfig`` (rows, batch size, token budget, skipped positions).
        saes: ``{layer: TopKSAE}`` instead of the scope's (checked against the model).
        modes: splice modes, a subset of ``MODES``; ``ce_recovered`` needs ``"sae"`` and ``"zero"``.
        out: a directory for ``sae_eval.json``, ``sae_eval.html`` (the figure) and the resume state; a run
            pointed at a directory holding an unfinished run of the same settings continues it.
        overwrite: start over instead of resuming.
        progress: show a progress bar.
    Returns:
        ``SAEEvaluation`` (``.table()``, ``.figure()``, ``.layers[n]``).
    Raises:
        ValueError: an SAE that does not fit the model or its layer, an empty corpus, or a directory holding a run
            of other settings.

    Example:
        >>> r = evaluate_saes(nano_scope(), nano_corpus(8), config=EvalConfig(max_tokens=4096))
        >>> r.layers[5].ce_recovered
    """
    from qwen_scope.sources import progress_bar

    cfg = config or EvalConfig()
    modes = tuple(dict.fromkeys(modes))
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {modes}")
    table = _check_saes(scope, layers, saes)
    rows = corpus_rows(scope.tokenizer, corpus, context_len=cfg.context_len, text_column=cfg.text_column,
                       max_tokens=cfg.max_tokens)
    batches = token_batches((r for r in rows if len(r) >= cfg.skip_first + 2), cfg.batch_size)
    first = next(batches, None)
    if first is None:
        raise ValueError(f"the corpus yielded no row of at least {cfg.skip_first + 2} tokens; pass texts, records "
                         f"with a {cfg.text_column!r} column or a non-empty store")
    meta = _run_meta(scope, table, cfg, modes, rows_fingerprint(first))
    state = {"meta": meta, "batches": 0, "clean_nll": 0.0, "n_pred": 0, "means": {},
             "totals": {n: _Totals(s.d_model, s.d_sae).state() for n, s in table.items()}}
    out = Path(out) if out is not None else None
    if out is not None and (out / STATE_FILE).is_file() and not overwrite:
        saved = torch.load(out / STATE_FILE, weights_only=True)
        if saved["meta"] != meta:
            diff = sorted(k for k in meta if saved["meta"].get(k) != meta[k])
            raise ValueError(f"{out} holds an evaluation with other settings ({', '.join(diff)} differ); pass "
                             f"overwrite=True (--overwrite) to start over, or another out directory")
        state = saved
    totals = {n: _Totals.from_state(s) for n, s in state["totals"].items()}
    done = state["batches"]
    bar = progress_bar(total=cfg.max_tokens, unit="tok", unit_scale=True, disable=not progress, desc="SAE eval")
    for i, ids in enumerate(_chain(first, batches)):
        if i < done:
            bar.update(ids.numel())
            continue
        state["clean_nll"] += _batch(scope, ids, table, totals, state["means"], cfg.skip_first, modes)
        state["n_pred"] += ids.shape[0] * (ids.shape[1] - cfg.skip_first - 1)
        state["batches"] = i + 1
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            state["totals"] = {n: t.state() for n, t in totals.items()}
            _write_atomic(out / STATE_FILE, lambda p: torch.save(state, p))
        bar.update(ids.numel())
    bar.close()
    clean_loss = state["clean_nll"] / state["n_pred"]
    result = SAEEvaluation(meta=meta, layers={n: _layer_result(n, totals[n], table[n], clean_loss, state["n_pred"],
                                                               cfg, modes) for n in sorted(table)})
    if out is not None:
        _write_atomic(out / RESULT_FILE, lambda p: p.write_text(json.dumps(result.to_dict(), indent=1)))
        result.figure().write_html(out / FIGURE_FILE, include_plotlyjs="directory")
    return result


def _chain(first: torch.Tensor, rest):
    yield first
    yield from rest
