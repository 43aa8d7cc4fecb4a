"""Train TopK SAEs (Gao et al. 2024, as Qwen-Scope did) and save them in the exact Qwen-Scope release layout.

Recipe, in the normalised space ``xn = x / s`` (``s`` makes ``E||xn||^2 = 1``, measured on the first batch)::

    pre  = W_enc (xn - b_dec) + b_enc           # decoder-bias pre-subtraction while training
    z    = TopK_k(ReLU(pre))
    x̂n  = W_dec z + b_dec                       # W_dec columns kept at unit norm
    loss = ||x̂n - xn||^2 + aux_coef * ||ê - e||^2,  e = xn - x̂n (detached),
           ê = W_dec TopK_aux_k(ReLU(pre) restricted to dead latents)   # AuxK, aux_coef = 1/32

Decoder columns are renormalised after every step and the gradient component parallel to each column is removed
before it. ``export()`` folds the scale and the pre-subtraction into the release form (no b_dec pre-subtraction, no
normalisation): ``W_enc' = W_enc``, ``b_enc' = s (b_enc - W_enc b_dec)``, ``W_dec' = W_dec`` (unit columns),
``b_dec' = s b_dec``. TopK is invariant to the positive factor ``s``, so the released SAE picks the same features and its
codes are ``s`` times the training codes.

Example:
    >>> result = train_sae(acts, SAETrainingConfig(d_sae=2048, k=32, n_tokens=2_000_000))   # acts [N, d_model]
    >>> save_sae(result.sae, "SAE-Res-MyModel-W2K-L0_32", layer=3)    # layer3.sae.pt + layer3.sae.safetensors
"""
from __future__ import annotations

import json
import math
import operator
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from saes.loading import RELEASE_CONFIG
from saes.topk import TopKSAE
from saes.training_data import as_batches

__all__ = ["SAETrainingConfig", "SAETrainer", "TrainingResult", "train_sae", "evaluate_sae", "save_sae",
           "save_release"]


@dataclass(frozen=True)
class SAETrainingConfig:
    """Hyper-parameters of one TopK SAE run.

    Args:
        d_sae: number of latents.
        k: latents kept per token (the release's ``L0_{k}``).
        n_tokens: training tokens; the run takes ``ceil(n_tokens / batch_size)`` steps.
        batch_size: tokens per step (default 4096).
        lr: Adam learning rate; ``None`` = Gao et al.'s ``2e-4 / sqrt(d_sae / 2**14)``.
        lr_decay_fraction: the learning rate decays linearly to 0 over this final fraction of the steps.
        aux_k: latents the AuxK loss may use; ``None`` = ``min(d_model // 2, d_sae)``.
        aux_coef: weight of the AuxK loss (1/32, as Qwen-Scope).
        dead_after_tokens: a latent that has not fired for this many tokens counts as dead.
        grad_clip: max global gradient norm, ``None`` for no clipping.
        log_every: steps between history entries and progress-bar updates.
        seed: seeds the initialisation.
        device: where to train (``None`` = where the batches are).
    """

    d_sae: int
    k: int
    n_tokens: int
    batch_size: int = 4096
    lr: float | None = None
    lr_decay_fraction: float = 0.2
    aux_k: int | None = None
    aux_coef: float = 1 / 32
    dead_after_tokens: int = 1_000_000
    grad_clip: float | None = 1.0
    log_every: int = 50
    seed: int = 0
    device: str | None = None

    def __post_init__(self):
        if self.d_sae < 1 or not 1 <= self.k <= self.d_sae:
            raise ValueError(f"need 1 <= k <= d_sae, got k={self.k}, d_sae={self.d_sae}")
        if self.n_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"n_tokens and batch_size must be positive, got {self.n_tokens}, {self.batch_size}")

    @property
    def n_steps(self) -> int:
        return math.ceil(self.n_tokens / self.batch_size)

    def resolved_lr(self) -> float:
        return self.lr if self.lr is not None else 2e-4 / math.sqrt(self.d_sae / 2 ** 14)


@dataclass
class TrainingResult:
    """What ``train_sae`` returns: the SAE in release form, the logged history, the last window's metrics and the
    number of tokens it was trained on (fewer than asked when the data ran out)."""

    sae: TopKSAE
    history: list[dict] = field(default_factory=list)
    final: dict = field(default_factory=dict)
    n_tokens: int = 0


class SAETrainer(nn.Module):
    """Step-level TopK SAE trainer (use ``train_sae`` for the whole loop).

    Args:
        d_model: width of the activations.
        config: ``SAETrainingConfig``.
        first_batch: ``[N, d_model]`` activations used for the input scale ``s`` and the ``b_dec`` initialisation.
    """

    def __init__(self, d_model: int, config: SAETrainingConfig, first_batch: torch.Tensor):
        super().__init__()
        self.config, self.d_model = config, d_model
        g = torch.Generator().manual_seed(config.seed)
        x = first_batch.detach().float().cpu()
        scale = x.pow(2).sum(-1).mean().sqrt().clamp_min(1e-8)
        w_dec = torch.randn(d_model, config.d_sae, generator=g)
        w_dec = w_dec / w_dec.norm(dim=0, keepdim=True)
        self.W_enc = nn.Parameter(w_dec.T.contiguous())
        self.W_dec = nn.Parameter(w_dec)
        self.b_enc = nn.Parameter(torch.zeros(config.d_sae))
        self.b_dec = nn.Parameter((x / scale).mean(0))
        self.register_buffer("scale", scale)
        self.register_buffer("tokens_since_fired", torch.zeros(config.d_sae, dtype=torch.long))
        self.aux_k = min(config.aux_k or max(d_model // 2, 1), config.d_sae)
        self.n_steps_done = 0
        self.to(config.device or first_batch.device)
        self.optimizer = torch.optim.Adam(self.parameters(), lr=config.resolved_lr(), betas=(0.9, 0.999),
                                          eps=6.25e-10)

    def _encode(self, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre = torch.relu((xn - self.b_dec) @ self.W_enc.T + self.b_enc)
        values, indices = pre.topk(self.config.k, dim=-1)
        return pre, values, indices

    def _decode(self, values: torch.Tensor, indices: torch.Tensor, bias: bool = True) -> torch.Tensor:
        # Dense decode: on CPU and for moderate d_sae a scatter + matmul beats embedding_bag several times over.
        z = values.new_zeros(values.shape[0], self.W_dec.shape[1]).scatter(1, indices, values)
        return nn.functional.linear(z, self.W_dec, self.b_dec if bias else None)

    def dead_mask(self) -> torch.Tensor:
        """``[d_sae]`` bool: latents that have not fired for ``dead_after_tokens`` tokens."""
        return self.tokens_since_fired >= self.config.dead_after_tokens

    def step(self, x: torch.Tensor) -> dict[str, float]:
        """One optimiser step on ``x [N, d_model]``; returns this batch's metrics (mse, aux, fve, l0, dead)."""
        x = x.to(self.W_enc.device, torch.float32)
        xn = x / self.scale
        pre, values, indices = self._encode(xn)
        recon = self._decode(values, indices)
        err = recon - xn
        mse = err.pow(2).sum(-1).mean()
        aux = self._aux_loss(pre, (xn - recon).detach())
        loss = mse + self.config.aux_coef * aux
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._project_decoder_grad()
        if self.config.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.parameters(), self.config.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.n_steps_done)
        self.optimizer.step()
        self.n_steps_done += 1
        with torch.no_grad():
            self.W_dec.div_(self.W_dec.norm(dim=0, keepdim=True).clamp_min(1e-8))
            fired = torch.zeros_like(self.tokens_since_fired, dtype=torch.bool)
            fired[indices[values > 0]] = True
            self.tokens_since_fired.add_(x.shape[0]).masked_fill_(fired, 0)
            var = (xn - xn.mean(0)).pow(2).sum(-1).mean()
            # One token has no variance about its own mean: its FVE is undefined (nan), not -inf.
            fve = float(1 - mse / var) if x.shape[0] > 1 else math.nan
            return {"loss": float(loss), "mse": float(mse), "aux": float(aux), "fve": fve,
                    "l0": float((values > 0).sum(-1).float().mean()), "dead": float(self.dead_mask().float().mean())}

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step``: constant, then linear decay to 0 over ``lr_decay_fraction`` of the run."""
        total = self.config.n_steps
        decay = max(1, round(total * self.config.lr_decay_fraction))
        return self.config.resolved_lr() * min(1.0, (total - step) / decay)

    def _aux_loss(self, pre: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dead = self.dead_mask()
        n_dead = int(dead.sum())
        if n_dead == 0:
            return pre.new_zeros(())
        k_aux = min(self.aux_k, n_dead)
        values, indices = (pre * dead).topk(k_aux, dim=-1)
        residual_hat = self._decode(values, indices, bias=False)
        # Normalised by the residual's energy so the coefficient means the same at any loss level.
        return (residual_hat - residual).pow(2).sum(-1).mean() / residual.pow(2).sum(-1).mean().clamp_min(1e-12)

    def _project_decoder_grad(self) -> None:
        # Keep unit-norm columns on the sphere: drop the gradient's component along each column.
        if self.W_dec.grad is not None:
            w = self.W_dec.data
            self.W_dec.grad.sub_(w * (w * self.W_dec.grad).sum(0, keepdim=True))

    @torch.no_grad()
    def export(self) -> TopKSAE:
        """The trained SAE in release form (fp32, on CPU, scale and pre-subtraction folded; see module doc)."""
        s = self.scale.float().cpu()
        w_enc, w_dec = self.W_enc.float().cpu(), self.W_dec.float().cpu()
        b_enc, b_dec = self.b_enc.float().cpu(), self.b_dec.float().cpu()
        return TopKSAE(w_enc.clone(), w_dec.clone(), s * (b_enc - w_enc @ b_dec), s * b_dec, k=self.config.k)


def train_sae(activations: Iterable[torch.Tensor] | torch.Tensor, config: SAETrainingConfig, *,
              progress: bool = True, desc: str = "SAE", on_short_data: str = "warn") -> TrainingResult:
    """Train a TopK SAE on activations.

    Args:
        activations: a Tensor ``[N, d_model]`` (reshuffled every epoch, cycled until ``n_tokens``) or any iterable of
            Tensors ``[..., d_model]`` (re-batched to ``batch_size``; see ``saes.training_data`` for store and
            live-model sources). Training stops at ``n_tokens`` or when the iterable ends.
        config: ``SAETrainingConfig``.
        progress: show a tqdm bar with FVE, L0 and dead fraction.
        desc: progress-bar label.
        on_short_data: when the iterable ends before ``n_tokens``: ``"warn"`` (default; train on what there was),
            ``"raise"`` (``ValueError``) or ``"ignore"``.
    Returns:
        ``TrainingResult(sae, history, final, n_tokens)``; ``n_tokens`` is the number of tokens trained on; ``history`` holds one dict per ``log_every`` steps with ``step``,
        ``tokens`` and window means of ``loss, mse, aux, fve, l0, dead`` (weighted by batch tokens, so the small last
        batch of an epoch barely counts; a batch's undefined FVE (one token) is left out).
    """
    from tqdm.auto import tqdm

    if on_short_data not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_short_data must be 'warn', 'raise' or 'ignore', got {on_short_data!r}")
    torch.manual_seed(config.seed)
    batches = as_batches(activations, config.batch_size, seed=config.seed)
    first = next(batches, None)
    if first is None:
        raise ValueError("train_sae got no activations; pass a Tensor [N, d_model] or a non-empty iterable")
    trainer = SAETrainer(first.shape[-1], config, first)
    history: list[dict] = []
    window: list[tuple[int, dict]] = []
    bar = tqdm(total=config.n_steps, desc=desc, disable=not progress, leave=False)
    tokens = 0
    step_batches = _chain_first(first, batches)
    for step, x in enumerate(step_batches, start=1):
        window.append((x.shape[0], trainer.step(x)))
        tokens += x.shape[0]
        if step % config.log_every == 0 or step == config.n_steps:
            entry = {"step": step, "tokens": tokens, **_window_means(window)}
            history.append(entry)
            window = []
            bar.set_postfix(fve=f"{entry['fve']:.3f}", l0=f"{entry['l0']:.1f}", dead=f"{entry['dead']:.3f}")
        bar.update(1)
        if step >= config.n_steps:
            break
    bar.close()
    if window:
        history.append({"step": step, "tokens": tokens, **_window_means(window)})
    # A Tensor is cycled to n_steps (its epoch tails are short batches); only an iterable that ended early is short.
    if step < config.n_steps and on_short_data != "ignore":
        message = (f"train_sae: the activations ran out after {tokens:,} of the {config.n_tokens:,} tokens asked "
                   f"for ({step} of {config.n_steps} steps); pass more data, lower n_tokens, or a Tensor (which is "
                   f"cycled)")
        if on_short_data == "raise":
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=2)
    return TrainingResult(trainer.export(), history, dict(history[-1]), tokens)


def _window_means(window: list[tuple[int, dict]]) -> dict[str, float]:
    """Token-weighted mean of each metric over ``(n_tokens, metrics)`` steps, skipping nan entries."""
    out = {}
    for key in window[0][1]:
        pairs = [(n, m[key]) for n, m in window if not math.isnan(m[key])]
        out[key] = sum(n * v for n, v in pairs) / sum(n for n, _ in pairs) if pairs else math.nan
    return out


def _chain_first(first: torch.Tensor, rest: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    yield first
    yield from rest


@torch.no_grad()
def evaluate_sae(sae: TopKSAE, activations: Iterable[torch.Tensor] | torch.Tensor, *,
                 batch_size: int = 8192) -> dict[str, float]:
    """Reconstruction metrics of ``sae`` over activations (one pass).

    Args:
        sae: a ``TopKSAE`` (release form).
        activations: Tensor ``[N, d_model]`` or iterable of Tensors ``[..., d_model]``.
        batch_size: tokens per forward.
    Returns:
        dict with ``fve`` (1 - SSE / total variance about the mean), ``mse`` (per token, summed over d_model), ``l0``
        (mean active latents), ``dead_fraction`` (latents that never fired here), ``n_tokens``.
    """
    if isinstance(activations, torch.Tensor):
        activations = [activations]
    sse = total = s1 = s2 = l0 = 0.0
    n = 0
    fired = torch.zeros(sae.d_sae, dtype=torch.bool)
    sum_x = None
    for x in activations:
        for xb in x.reshape(-1, x.shape[-1]).split(batch_size):
            xb = xb.to(sae.device, torch.float32)
            codes = sae.encode_sparse(xb)
            recon = sae.decode(codes)
            sse += float((recon - xb).pow(2).sum())
            s2 += float(xb.pow(2).sum())
            sum_x = xb.sum(0) if sum_x is None else sum_x + xb.sum(0)
            active = codes.values > 0
            l0 += float(active.sum())
            fired[codes.indices[active].cpu()] = True
            n += xb.shape[0]
    if n == 0:
        raise ValueError("evaluate_sae got no activations")
    total = s2 - float(sum_x.pow(2).sum()) / n
    return {"fve": 1 - sse / max(total, 1e-12), "mse": sse / n, "l0": l0 / n,
            "dead_fraction": float((~fired).float().mean()), "n_tokens": n}


def save_sae(sae: TopKSAE, directory: str | Path, layer: int, *, formats: tuple[str, ...] = ("pt", "safetensors"),
             dtype: torch.dtype = torch.float32, metadata: Mapping[str, object] | None = None) -> list[Path]:
    """Write one SAE as ``layer{layer}.sae.pt`` (torch-saved dict of the four release tensors, as Qwen-Scope ships)
    and/or ``layer{layer}.sae.safetensors`` (same keys; header metadata holds k, d_sae, d_model, layer).

    Args:
        sae: the SAE (release form).
        directory: the release directory; name it ``SAE-Res-{Model}-W{d_sae/1024}K-L0_{k}`` so ``saes.load`` can infer k.
        layer: decoder-block index the SAE reads (its output: hook point ``resid_post.<layer>``).
        formats: any of ``"pt"``, ``"safetensors"``.
        dtype: dtype written (fp32 like the release; bf16 halves the size).
        metadata: extra string-able entries for the safetensors header.
    Returns:
        the paths written.
    """
    from safetensors.torch import save_file

    try:
        index = None if isinstance(layer, bool) else operator.index(layer)  # int or numpy integer
    except TypeError:
        index = None
    if index is None or index < 0:
        raise ValueError(f"layer must be a non-negative int (the decoder block the SAE reads, named layer{{n}}.sae.*), "
                         f"got {layer!r}; a negative index cannot be resolved without the model's depth")
    layer = index
    unknown = set(formats) - {"pt", "safetensors"}
    if unknown or not formats:
        raise ValueError(f"formats must be a non-empty subset of ('pt', 'safetensors'), got {formats}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {key: t.detach().to("cpu", dtype).contiguous() for key, t in sae.release_state().items()}
    paths = []
    if "pt" in formats:
        paths.append(_write_atomically(out / f"layer{layer}.sae.pt", lambda tmp: torch.save(state, tmp)))
    if "safetensors" in formats:
        meta = {"k": str(sae.k), "d_sae": str(sae.d_sae), "d_model": str(sae.d_model), "layer": str(layer),
                "format": "qwen-scope-release"}
        meta.update({key: value if isinstance(value, str) else json.dumps(value)
                     for key, value in (metadata or {}).items()})
        paths.append(_write_atomically(out / f"layer{layer}.sae.safetensors",
                                       lambda tmp: save_file(state, str(tmp), metadata=meta)))
    return paths


def _write_atomically(path: Path, write) -> Path:
    """Run ``write(tmp)`` then rename ``tmp`` onto ``path``: an interrupted save never leaves a half-written file
    under the name loaders read (nor a stray temporary: it is dot-prefixed and removed on failure)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save_release(saes: Mapping[int, TopKSAE], directory: str | Path, *, formats: tuple[str, ...] = ("pt", "safetensors"),
                 dtype: torch.dtype = torch.float32, info: Mapping[str, object] | None = None) -> Path:
    """Write a whole SAE set (one file per layer, see ``save_sae``) plus ``training.json`` with ``info``.

    Args:
        saes: ``{layer: TopKSAE}``.
        directory: release directory (any name; ``SAE-Res-{Model}-W{N}K-L0_{k}`` matches the published sets).
            ``release.json`` beside the files records k and the sizes, so ``saes.load(directory, layer)`` reads it
            back whatever the name says.
        formats, dtype: as ``save_sae``.
        info: training provenance (config, metrics) stored in ``training.json`` (the release format has no config
            file; loaders ignore it).
    Returns:
        the directory.
    """
    out = Path(directory)
    ks = {sae.k for sae in saes.values()}
    if not saes:
        raise ValueError("save_release got no SAEs; pass {layer: TopKSAE}")
    if len(ks) != 1:
        raise ValueError(f"a release has one k for all layers, got {sorted(ks)}; save them in separate directories")
    sizes = {(sae.d_sae, sae.d_model) for sae in saes.values()}
    if len(sizes) != 1:
        raise ValueError(f"a release has one (d_sae, d_model) for all layers, got {sorted(sizes)}; save them in "
                         f"separate directories")
    for layer, sae in sorted(saes.items()):
        save_sae(sae, out, layer, formats=formats, dtype=dtype)
    (d_sae, d_model), = sizes
    # saes.load(directory, layer) reads k and the sizes from here, whatever the directory is called.
    (out / RELEASE_CONFIG).write_text(json.dumps({"format": "qwen-scope-release", "k": ks.pop(), "d_sae": d_sae,
                                                  "d_model": d_model, "layers": sorted(int(n) for n in saes)},
                                                 indent=1))
    if info is not None:
        (out / "training.json").write_text(json.dumps(_jsonable(info), indent=1, sort_keys=True))
    return out


def _jsonable(value):
    if isinstance(value, SAETrainingConfig):
        return asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return round(value, 6)
    return value
