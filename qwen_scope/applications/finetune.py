"""Fine-tuning with SAE-feature penalties: the LM loss plus ``FeaturePenalty`` at one or more layers, measured on
held-out text before and after.

The loop behind the report's training-time use (``guided.py`` has the penalty, ``sasft.py`` SASFT's form): the
training texts are packed into rows of ``seq_len`` tokens; each step is AdamW on

    loss = LM loss + weight * sum over penalised layers of  FeaturePenalty(layer)(resid_post.layer)

over ``batch_size`` rows (times ``grad_accum`` micro-batches), the penalty on every position but each row's first
(position 0 is left out as everywhere in the toolkit: it has no context and carries outlier activations). The LM loss
is ``lm_loss.causal_lm_loss`` (transformers' value, without the fp32 copy of the logits; in the held-out evaluations a
block of rows' logits at a time, whatever ``eval_batch_size``). Before and after, the held-out texts (packed the same
way) give the LM loss per token and, for each penalised feature, its mean SAE activation and firing rate (the share of
tokens where the TopK code is > 0) over positions 1.. .

    result = finetune(scope, train_texts, held_out_texts, {4: [229]}, FinetuneConfig(steps=20, lr=3e-4))
    print(result.table())              # LM loss and each feature's mean / firing rate, before -> after

Runs are deterministic for a seed (data order from a seeded generator; the global RNG is forked for the call).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hooks import capture, resid_post
from qwen_scope.applications.guided import FeaturePenalty
from qwen_scope.applications.lm_loss import causal_lm_loss

__all__ = ["FinetuneConfig", "FeatureReading", "HeldOutEval", "FinetuneResult", "finetune", "evaluate_held_out",
           "pack_texts"]

_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class FinetuneConfig:
    """Settings of ``finetune``.

    Attributes:
        steps: optimizer steps. lr: AdamW learning rate (constant after ``warmup_steps`` of linear warmup).
        weight: the penalty's weight against the LM loss. weight_decay: AdamW's.
        batch_size: rows per micro-batch. grad_accum: micro-batches per step. seq_len: tokens per row (T).
        max_grad_norm: clip the gradient norm to this (``None``: no clipping).
        precision: ``"fp32"`` (the model's own dtype) or ``"bf16"`` (autocast; weights and optimizer state stay in
            the model's dtype).
        gradient_checkpointing: recompute the blocks in the backward (``model.gradient_checkpointing_enable()``;
            switched off again afterwards).
        seed: data order and every random draw. eval_batch_size: rows per held-out forward.
        max_eval_rows: use at most this many held-out rows (``None``: all).
    """

    steps: int = 100
    lr: float = 1e-4
    weight: float = 1.0
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 128
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    seed: int = 0
    eval_batch_size: int = 16
    max_eval_rows: int | None = None

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FinetuneConfig.{name} must be an int >= 1, got {value!r}")
        if self.seq_len < 2:
            raise ValueError(f"FinetuneConfig.seq_len must be >= 2 (a row needs a token to predict), got "
                             f"{self.seq_len}")
        if self.warmup_steps < 0 or self.lr <= 0 or self.weight < 0:
            raise ValueError(f"need warmup_steps >= 0, lr > 0 and weight >= 0, got warmup_steps={self.warmup_steps}, "
                             f"lr={self.lr}, weight={self.weight}")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"FinetuneConfig.precision must be one of {_PRECISIONS}, got {self.precision!r}")


@dataclass(frozen=True)
class FeatureReading:
    """One feature on held-out text: ``mean`` SAE activation per token and firing ``rate`` (share of tokens > 0)."""

    layer: int
    feature: int
    mean: float
    rate: float


@dataclass(frozen=True)
class HeldOutEval:
    """Held-out LM loss (nats per token) and the penalised features' readings over ``n_tokens`` tokens."""

    lm_loss: float
    features: tuple[FeatureReading, ...]
    n_tokens: int

    def reading(self, layer: int, feature: int) -> FeatureReading:
        for r in self.features:
            if (r.layer, r.feature) == (layer, feature):
                return r
        raise KeyError(f"no reading of layer {layer} feature {feature}; read: "
                       f"{[(r.layer, r.feature) for r in self.features]}")


@dataclass(frozen=True)
class FinetuneResult:
    """What ``finetune`` measured.

    Attributes:
        before, after: the held-out evaluation before the first step and after the last.
        lm_losses, penalties: the training LM loss and the (unweighted) penalty of every step.
        n_train_tokens: tokens in the packed training rows. config: the settings used.
    """

    before: HeldOutEval
    after: HeldOutEval
    lm_losses: tuple[float, ...]
    penalties: tuple[float, ...]
    n_train_tokens: int
    config: FinetuneConfig

    def table(self) -> str:
        """Before / after / relative change of the held-out LM loss and of each feature's mean and firing rate."""
        rows = [("held-out LM loss (nats/token)", self.before.lm_loss, self.after.lm_loss)]
        for b in self.before.features:
            a = self.after.reading(b.layer, b.feature)
            rows += [(f"layer {b.layer} #{b.feature} mean activation", b.mean, a.mean),
                     (f"layer {b.layer} #{b.feature} firing rate", b.rate, a.rate)]
        width = max(len(r[0]) for r in rows)
        lines = [f"{'':<{width}}  {'before':>9}  {'after':>9}  {'change':>8}"]
        for name, x, y in rows:
            change = f"{(y - x) / x:+.1%}" if x else "n/a"
            lines.append(f"{name:<{width}}  {x:9.4f}  {y:9.4f}  {change:>8}")
        return "\n".join(lines)


def pack_texts(tokenizer, texts: Sequence[str], seq_len: int, *, what: str = "texts") -> torch.Tensor:
    """The token ids of ``texts`` (end-of-text between documents where the tokenizer has one), concatenated and cut
    into full rows: ``LongTensor [N, seq_len]`` (a shorter tail is dropped).

    Raises:
        ValueError: ``texts`` is empty or holds fewer than ``seq_len`` tokens.
    """
    from qwen_scope.collect_corpus import pack_rows

    if isinstance(texts, str) or not texts:
        raise ValueError(f"{what} must be a non-empty list of strings, got {type(texts).__name__}")
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    docs = ((i, i, d) for i, d in enumerate(ids))
    rows = [r.tokens for r in pack_rows(docs, seq_len, separator_id=getattr(tokenizer, "eos_token_id", None))
            if len(r.tokens) == seq_len]
    if not rows:
        total = sum(len(d) for d in ids)
        raise ValueError(f"{what} hold {total} tokens, fewer than one row of seq_len {seq_len}; pass more text or "
                         f"a smaller FinetuneConfig(seq_len=...)")
    return torch.tensor(rows, dtype=torch.long)


def _penalties(scope, features) -> list[FeaturePenalty]:
    """``{layer: feature ids}`` (or ready ``FeaturePenalty`` objects) -> penalties, each layer checked first."""
    if isinstance(features, Mapping):
        items = list(features.items())
    else:
        items = list(features)
        if not all(isinstance(p, FeaturePenalty) for p in items):
            raise TypeError("features must be {layer: feature ids} or a list of FeaturePenalty, got "
                            f"{type(features).__name__}")
    if not items:
        raise ValueError("no features to penalise: pass {layer: [feature ids]}, e.g. {4: [229]}")
    n = scope.adapter.n_layers
    name = scope.model_name or "the model"
    out = []
    for item in items:
        layer = item.layer if isinstance(item, FeaturePenalty) else item[0]
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise ValueError(f"penalty layer {layer!r} is out of range: {name} has decoder blocks 0..{n - 1}; "
                             f"use one of the layers with an SAE loaded, {scope.layers}")
        if layer not in scope.saes:
            raise ValueError(f"no SAE at penalty layer {layer}: the scope has SAEs at layers {scope.layers}; load "
                             f"one first with scope.load_saes(release, [{layer}]) (qwen-scope: --layer {layer})")
        out.append(item if isinstance(item, FeaturePenalty) else FeaturePenalty(scope.sae(layer), layer, item[1]))
    return out


def _checkpointing(model, on: bool) -> None:
    # transformers 5.24 calls it activation checkpointing and warns on the old name; releases with only the old
    # name take the fallback.
    verb = "enable" if on else "disable"
    new, old = f"activation_checkpointing_{verb}", f"gradient_checkpointing_{verb}"
    (getattr(model, new, None) or getattr(model, old))()


def _autocast(device: torch.device, precision: str, enabled: bool = True):
    # enabled=False inside an enabled region turns autocast off without ending the region (its weight cache stays)
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)
    return contextlib.nullcontext()


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A copy from pageable host memory waits for everything queued on the GPU (a host sync per micro-batch, after
    # which the GPU idles until the host has issued the next forward's kernels); from pinned memory it is queued
    # like a kernel. The pinned block is not reused before the copy has run (torch's host allocator records it).
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@torch.no_grad()
def evaluate_held_out(scope, rows: torch.Tensor, penalties: Sequence[FeaturePenalty], *, batch_size: int = 16,
                      precision: str = "fp32") -> HeldOutEval:
    """LM loss per token on ``rows [N, T]`` and each penalised feature's mean SAE activation and firing rate over
    positions 1.. (the model is put in eval mode for the call and restored).

    Returns:
        ``HeldOutEval``.
    """
    model, device = scope.model, scope.device
    points = sorted({resid_post(p.layer) for p in penalties})
    loss_sum, n_tok = 0.0, 0
    act_sum = [torch.zeros(p.features.numel(), dtype=torch.float64) for p in penalties]
    fire_sum = [torch.zeros(p.features.numel(), dtype=torch.float64) for p in penalties]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(rows), batch_size):
            x = rows[start:start + batch_size].to(device)
            with capture(model, points) as cap, _autocast(device, precision):
                loss = causal_lm_loss(scope.adapter, x)
            # The LM loss predicts positions 1.. and the features are read there: the same tokens for both.
            n = x.shape[0] * (x.shape[1] - 1)
            loss_sum, n_tok = loss_sum + float(loss) * n, n_tok + n
            for i, p in enumerate(penalties):
                resid = cap[resid_post(p.layer)][:, 1:].flatten(0, 1)  # [B * (T - 1), d_model]
                codes = scope.sae(p.layer).encode(resid.float())[:, p.features.to(device)].double()
                act_sum[i] += codes.sum(0).cpu()
                fire_sum[i] += (codes > 0).sum(0).cpu()
    finally:
        model.train(was_training)
    readings = tuple(FeatureReading(p.layer, int(f), float(a[j] / n_tok), float(r[j] / n_tok))
                     for p, a, r in zip(penalties, act_sum, fire_sum) for j, f in enumerate(p.features.tolist()))
    return HeldOutEval(loss_sum / n_tok, readings, n_tok)


def _train(scope, rows: torch.Tensor, penalties: Sequence[FeaturePenalty], cfg: FinetuneConfig, progress: bool
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from qwen_scope.sources import progress_bar

    model, device = scope.model, scope.device
    params = [p for p in model.parameters() if p.requires_grad]
    # on CUDA the fused AdamW: one kernel over every parameter instead of the multi-tensor loops' many (a 2B-shaped
    # step on an H100: 25.7 ms of optimizer kernels against 86.6); the update is the same
    fused = all(p.is_cuda and p.is_floating_point() for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1)))
    gen = torch.Generator().manual_seed(cfg.seed)
    order, cursor = torch.randperm(len(rows), generator=gen), 0
    mask = torch.ones(cfg.batch_size, cfg.seq_len, device=device)
    mask[:, 0] = 0
    lm_log, pen_log = [], []
    bar = progress_bar(total=cfg.steps, unit="step", disable=not progress, desc="fine-tuning")
    with contextlib.ExitStack() as stack:
        lasts = [stack.enter_context(p.watch(model)) for p in penalties]
        for step in range(cfg.steps):
            opt.zero_grad(set_to_none=True)
            lm_step = pen_step = 0.0
            # One autocast region a step: autocast casts each fp32 weight once and every micro-batch reuses the copy
            # (its cache lives until the outermost region exits, before the optimizer changes the weights). The
            # penalties and the backward run with autocast off, as they would outside it.
            with _autocast(device, cfg.precision):
                for _ in range(cfg.grad_accum):
                    if cursor + cfg.batch_size > len(order):
                        order, cursor = torch.randperm(len(rows), generator=gen), 0
                    x = _to_device(rows[order[cursor:cursor + cfg.batch_size]], device)
                    cursor += cfg.batch_size
                    lm = causal_lm_loss(scope.adapter, x)
                    with _autocast(device, cfg.precision, enabled=False):
                        pen = sum(last(mask=mask) for last in lasts)
                        ((lm.float() + cfg.weight * pen) / cfg.grad_accum).backward()
                    lm_step += lm.detach().float() / cfg.grad_accum
                    pen_step += pen.detach() / cfg.grad_accum
            if cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            sched.step()
            lm_log.append(lm_step)
            pen_log.append(pen_step)
            bar.update(1)
            if progress and (step % 10 == 0 or step == cfg.steps - 1):
                bar.set_postfix(lm=f"{float(lm_step):.4f}", penalty=f"{float(pen_step):.4f}")
    bar.close()
    # device tensors: the caller reads them (one wait for the GPU) once the steps are issued
    return lm_log, pen_log


def finetune(scope, train_texts: Sequence[str], held_out_texts: Sequence[str],
             features: Mapping[int, int | Sequence[int]] | Sequence[FeaturePenalty],
             config: FinetuneConfig | None = None, *, progress: bool = True) -> FinetuneResult:
    """Fine-tune ``scope.model`` in place on ``train_texts`` with the LM loss plus feature penalties, and measure
    the held-out LM loss and each penalised feature before and after.

    Args:
        scope: a ``Scope`` with SAEs at the penalised layers (its SAEs stay frozen; every model parameter that
            requires grad is trained).
        train_texts, held_out_texts: documents, packed into rows of ``config.seq_len`` tokens.
        features: ``{layer: feature id or ids}`` (squared excess over 0, summed over the features: the
            ``FeaturePenalty`` defaults), or ``FeaturePenalty`` objects (e.g. ``FeaturePenalty.sasft``).
        config: ``FinetuneConfig`` (default: its defaults).
        progress: show a progress bar.

    Returns:
        ``FinetuneResult`` (``.table()`` prints it).

    Raises:
        ValueError: a layer out of range or without an SAE, a feature id outside its SAE, too little text.

    Example:
        >>> result = finetune(nano_scope([4]), train, held, {4: [229]}, FinetuneConfig(steps=20, lr=3e-4))
        >>> result.after.reading(4, 229).mean < result.before.reading(4, 229).mean
        True
    """
    cfg = config or FinetuneConfig()
    penalties = _penalties(scope, features)
    train = pack_texts(scope.tokenizer, train_texts, cfg.seq_len, what="train_texts")
    held = pack_texts(scope.tokenizer, held_out_texts, cfg.seq_len, what="held_out_texts")[:cfg.max_eval_rows]
    if len(train) < cfg.batch_size:
        raise ValueError(f"train_texts pack into {len(train)} row(s) of {cfg.seq_len} tokens, fewer than batch_size "
                         f"{cfg.batch_size}; pass more text or a smaller batch_size / seq_len")
    model = scope.model
    devices = [scope.device] if scope.device.type == "cuda" else []
    # The blocks' own flag (transformers' GradientCheckpointingLayer): the model-level property's name changes in v6.
    was_training = model.training
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed)
        before = evaluate_held_out(scope, held, penalties, batch_size=cfg.eval_batch_size, precision=cfg.precision)
        switch = cfg.gradient_checkpointing and not checkpointing
        if switch:
            _checkpointing(model, True)
        model.train()
        try:
            lm_log, pen_log = _train(scope, train, penalties, cfg, progress)
        finally:
            model.train(was_training)
            if switch:
                _checkpointing(model, False)
        after = evaluate_held_out(scope, held, penalties, batch_size=cfg.eval_batch_size, precision=cfg.precision)
    return FinetuneResult(before, after, tuple(float(v) for v in lm_log), tuple(float(v) for v in pen_log),
                          train.numel(), cfg)
