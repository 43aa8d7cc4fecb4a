"""Token choice on the device: greedy, temperature, top-k, top-p and seeded sampling, per row, in fixed shapes.

The warpers run in transformers' order (temperature, then top-k, then top-p, as ``generate`` builds them) with the
same rules: top-k keeps every logit at least the k-th largest, top-p removes the tokens whose cumulative ascending
probability stays at or below ``1 - p`` but always keeps the likeliest one. A draw is the exponential race
``argmax(p / E)``, E ~ Exp(1) from a seeded ``torch.Generator``: one categorical sample per row with no
``multinomial`` and no host sync, so it can sit inside a captured graph. The probabilities recorded per step are
those of the raw logits, before any warper, as ``Scope.steer`` reports them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "SamplingBuffers", "choose_tokens", "record_step"]


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen (one setting for the whole batch).

    Attributes:
        do_sample: False for greedy (argmax), True to sample.
        temperature: > 0; divides the logits before top-k / top-p.
        top_k: keep the k likeliest tokens (0 or None: all).
        top_p: keep the smallest set whose probability reaches p (1.0: all).
        seed: seed of the engine's generator (None: a fresh nondeterministic seed).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}; use do_sample=False for greedy")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative int (0 or None keeps every token), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


class SamplingBuffers:
    """Per-row sampling parameters on the device, so changing them changes buffer contents only."""

    def __init__(self, config: SamplingConfig, B: int, V: int, device: torch.device):
        self.V = V
        self.temperature = torch.ones(B, 1, device=device)
        self.top_k = torch.full((B, 1), V, dtype=torch.long, device=device)
        self.top_p = torch.ones(B, 1, device=device)
        self.generator = torch.Generator(device=device)
        self.fill(config)

    def fill(self, config: SamplingConfig) -> None:
        """Write ``config`` into the buffers in place and reseed the generator."""
        self.config = config
        self.temperature.fill_(float(config.temperature))
        self.top_k.fill_(min(int(config.top_k), self.V) if config.top_k else self.V)
        self.top_p.fill_(float(config.top_p))
        if config.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(config.seed))


def _warp(logits: torch.Tensor, buffers: SamplingBuffers) -> torch.Tensor:
    """Temperature, top-k and top-p on [B, V] float32 logits (removed tokens get -inf)."""
    scores = logits / buffers.temperature
    sorted_desc, _ = torch.sort(scores, dim=-1, descending=True)
    kth = sorted_desc.gather(1, buffers.top_k - 1)  # [B, 1]
    scores = scores.masked_fill(scores < kth, float("-inf"))
    sorted_asc, order = torch.sort(scores, dim=-1, descending=False)
    cumulative = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - buffers.top_p)
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def choose_tokens(logits: torch.Tensor, buffers: SamplingBuffers | None) -> torch.Tensor:
    """[B] int64 next tokens from [B, V] float32 logits: argmax when ``buffers`` is None, else one seeded draw."""
    if buffers is None:
        return logits.argmax(dim=-1)
    probs = _warp(logits, buffers).softmax(dim=-1)
    # One noise row shared by the batch: every row draws as if it ran alone from the same seed, so a baseline and
    # its steered rows (or a sweep's rows) are coupled the way ``Scope.steer``'s same-seed generations are.
    race = probs.new_empty(1, probs.shape[-1]).exponential_(1.0, generator=buffers.generator)
    return (probs / race).argmax(dim=-1)


def record_step(state, logits: torch.Tensor, chosen: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """Write one sampled column into ``state`` and return the tokens fed to the next step.

    Rows already finished keep the pad token and their length; a row finishes on a stop token or when it has its
    budget of tokens. ``column`` is a [1] int64 device tensor (the column index), so no step reads a host value.

    Args:
        state: the ``DecodeState``.
        logits: [B, V] float32 raw logits of this step.
        chosen: [B] int64 tokens chosen from them.
        column: [1] int64, which generated column this is.

    Returns:
        [B] int64: the chosen tokens, pad where the row had finished before this step.
    """
    alive = ~state.finished
    tokens = torch.where(alive, chosen, state.pad)
    probs = logits.softmax(dim=-1)
    top_p, top_i = probs.topk(state.top_ids.shape[-1], dim=-1)
    idx = column.view(1, 1).expand(tokens.shape[0], 1)
    state.tokens.scatter_(1, idx, tokens[:, None])
    state.probs.scatter_(1, idx, probs.gather(1, tokens[:, None]))
    state.top_ids.index_copy_(1, column, top_i[:, None])
    state.top_probs.index_copy_(1, column, top_p[:, None])
    if state.logits is not None:
        state.logits.index_copy_(1, column, logits[:, None])
    state.lengths.add_(alive.long())
    stopped = (tokens[:, None] == state.stop_ids[None, :]).any(dim=-1) if state.stop_ids.numel() else alive & False
    state.finished.logical_or_(alive & (stopped | (state.lengths >= state.max_new)))
    state.last_tokens.copy_(tokens)
    return tokens
