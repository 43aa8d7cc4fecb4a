"""Activation sources for SAE training: in-memory tensors, any iterator of batches, an activation store, a live model.

Every source yields float Tensors ``[N, d_model]``; ``as_batches`` turns any of them into fixed-size training batches.

Example:
    >>> batches = model_activations(model, token_batches, layer=3)           # live: [B, T] ids -> [B*(T-1), d_model]
    >>> batches = store_activations(store, "resid_post.3")                   # from qwen_scope.store.ActivationStore
    >>> result = train_sae(batches, SAETrainingConfig(d_sae=2048, k=32, n_tokens=1_000_000))
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["as_batches", "rebatch", "tensor_batches", "store_activations", "model_activations", "decoder_layers"]


def tensor_batches(x: torch.Tensor, batch_size: int, *, seed: int = 0, epochs: int | None = None
                   ) -> Iterator[torch.Tensor]:
    """Shuffled batches ``[batch_size, d_model]`` from an in-memory ``x [N, d_model]``, a fresh permutation per epoch.

    Args:
        x: activations ``[N, d_model]`` (or ``[..., d_model]``, flattened).
        batch_size: tokens per batch (the last batch of an epoch may be smaller).
        seed: seeds the permutations.
        epochs: passes over ``x``; ``None`` = forever.
    """
    x = x.reshape(-1, x.shape[-1])
    g = torch.Generator().manual_seed(seed)
    epoch = 0
    while epochs is None or epoch < epochs:
        perm = torch.randperm(x.shape[0], generator=g).to(x.device)
        yield from (x[idx] for idx in perm.split(batch_size))
        epoch += 1


def rebatch(chunks: Iterable[torch.Tensor], batch_size: int, *, shuffle_buffer: int = 0, seed: int = 0
            ) -> Iterator[torch.Tensor]:
    """Re-cut a stream of ``[..., d_model]`` chunks into ``[batch_size, d_model]`` batches.

    Args:
        chunks: any iterable of Tensors whose last dim is d_model.
        batch_size: tokens per output batch (the final one may be smaller).
        shuffle_buffer: if > 0, tokens are mixed in a buffer of this many tokens (half of it is emitted each time it
            fills), so neighbouring tokens of one document rarely share a batch.
        seed: seeds the mixing.
    """
    g = torch.Generator().manual_seed(seed)
    pending: list[torch.Tensor] = []
    held = 0
    limit = max(shuffle_buffer, batch_size)
    for chunk in chunks:
        chunk = chunk.reshape(-1, chunk.shape[-1])
        pending.append(chunk)
        held += chunk.shape[0]
        if held < limit:
            continue
        buf = torch.cat(pending)
        if shuffle_buffer:
            buf = buf[torch.randperm(buf.shape[0], generator=g).to(buf.device)]
        keep = buf.shape[0] // 2 if shuffle_buffer else buf.shape[0] % batch_size
        emit = buf[: buf.shape[0] - keep]
        n_full = emit.shape[0] // batch_size * batch_size
        if n_full:  # an empty tensor splits into one empty batch, which would train on nothing (nan loss)
            yield from emit[:n_full].split(batch_size)
        rest = torch.cat([emit[n_full:], buf[buf.shape[0] - keep:]])
        pending, held = [rest], rest.shape[0]
    if held:
        buf = torch.cat(pending)
        if shuffle_buffer:
            buf = buf[torch.randperm(buf.shape[0], generator=g).to(buf.device)]
        yield from buf.split(batch_size)


def as_batches(source: Iterable[torch.Tensor] | torch.Tensor, batch_size: int, *, seed: int = 0
               ) -> Iterator[torch.Tensor]:
    """Training batches from a Tensor ``[N, d_model]`` (cycled, reshuffled per epoch) or an iterable (re-batched)."""
    if isinstance(source, torch.Tensor):
        if source.ndim < 2 or source.numel() == 0:
            raise ValueError(f"expected activations [N, d_model], got shape {tuple(source.shape)}")
        return tensor_batches(source, batch_size, seed=seed)
    return rebatch(source, batch_size)


def store_activations(store, point: str, *, chunk_tokens: int = 65536, shuffle_buffer: int = 262144,
                      seed: int = 0) -> Iterator[torch.Tensor]:
    """Dense activations of ``point`` from an activation store (``qwen_scope.store.ActivationStore`` or any object
    with the same ``iter_shuffled`` / ``iter_chunks`` methods), in shuffled order.

    Args:
        store: the store; it must hold dense activations of ``point``.
        point: canonical hook name, e.g. ``"resid_post.3"``.
        chunk_tokens: tokens read at a time.
        shuffle_buffer: mixing buffer (tokens) when the store offers no shuffled iterator.
        seed: shuffling seed.
    Yields:
        Tensors ``[n, d_model]``.
    """
    points = list(getattr(store, "points", []) or [])
    if points and point not in points:
        raise ValueError(f"store has no point {point!r}; it holds {points}. Collect it first, e.g. "
                         f"`qwen-scope collect --points {point}`")
    if hasattr(store, "iter_shuffled"):
        # One shuffled epoch; callers wanting more passes chain several calls with different seeds.
        yield from store.iter_shuffled(point, chunk_tokens, buffer_tokens=shuffle_buffer, seed=seed, kind="dense",
                                       dtype=torch.float32)
        return
    chunks = (payload for _, payload in store.iter_chunks(point, kind="dense", chunk_tokens=chunk_tokens))
    yield from rebatch(chunks, chunk_tokens, shuffle_buffer=shuffle_buffer, seed=seed)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a Qwen3 / Qwen3.5 causal LM or its VL wrapper (``model.model[.language_model].layers``)."""
    for path in ("model.layers", "model.language_model.layers", "language_model.layers", "layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}: looked for model.layers and "
                     "model.language_model.layers")


@torch.no_grad()
def model_activations(model: nn.Module, token_batches: Iterable[torch.Tensor], layer: int | list[int], *,
                      skip_positions: int = 1, device: str | torch.device | None = None
                      ) -> Iterator[torch.Tensor | dict[int, torch.Tensor]]:
    """Residual-stream activations (output of decoder block ``layer``, the Qwen-Scope SAE site) from a live model.

    Args:
        model: a Qwen causal LM.
        token_batches: iterable of input-id Tensors ``[B, T]``.
        layer: a block index, or a list of them (then each item is ``{layer: Tensor}``).
        skip_positions: leading positions dropped from every sequence (position 0 is an outlier in small models;
            Qwen-Scope filters it too).
        device: where the model runs (``None`` = the model's device).
    Yields:
        fp32 Tensors ``[B * (T - skip_positions), d_model]`` on CPU (or dicts of them for a list of layers).
    """
    layers = [layer] if isinstance(layer, int) else list(layer)
    blocks = decoder_layers(model)
    for n in layers:
        if not 0 <= n < len(blocks):
            raise ValueError(f"layer {n} out of range: the model has {len(blocks)} decoder blocks")
    device = device or next(model.parameters()).device
    captured: dict[int, torch.Tensor] = {}
    for ids in token_batches:
        # Hooks live only around this forward: none stay on the model while the consumer holds a paused generator.
        handles = [blocks[n].register_forward_hook(_grab(captured, n)) for n in layers]
        try:
            model(input_ids=ids.to(device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        acts = {n: captured.pop(n)[:, skip_positions:] for n in layers}
        acts = {n: a.reshape(-1, a.shape[-1]).float().cpu() for n, a in acts.items()}
        yield acts[layers[0]] if isinstance(layer, int) else acts


def _grab(store: dict, n: int):
    def hook(module, args, output):
        store[n] = (output[0] if isinstance(output, tuple) else output).detach()
    return hook
