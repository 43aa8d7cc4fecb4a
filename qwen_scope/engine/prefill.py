"""The prefill: the model's own forward over each group of equal-length prompts, its caches copied into the state.

Running transformers' forward (not a re-implementation) keeps the prefill on whatever path the model runs: on a
Hopper GPU under ``flashqla_kernels.patched_transformers(fused_layer=True)`` that is the fused GDN layer and the
chunked kernels. Prompts are grouped by length so no row is padded: a padded row would feed its pad tokens through
the Gated DeltaNet recurrence. Steering edits act on the prompt positions through a ``hooks.intervene`` hook that
applies the same buffers the decode step reads, so prompt and generated positions see one definition.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

import torch

from flashqla_kernels.decoder import cached_states
from hooks import QwenAdapter, intervene, resid_post
from qwen_scope.engine.sampling import SamplingBuffers, choose_tokens, record_step
from qwen_scope.engine.state import DecodeState
from qwen_scope.engine.steer_buffers import LayerSteerBuffers

__all__ = ["prefill", "length_groups"]


def _cache_kwarg(model) -> str:
    """The forward's cache keyword: ``cache`` from transformers 5.24, ``past_key_values`` before (an unknown keyword
    would be swallowed by ``**kwargs`` and the model would fill a cache of its own)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def length_groups(prompts: Sequence[torch.Tensor]) -> list[list[int]]:
    """Row indices grouped by prompt length, in first-seen order (each group is one batched forward)."""
    groups: dict[int, list[int]] = {}
    for b, ids in enumerate(prompts):
        groups.setdefault(int(ids.shape[-1]), []).append(b)
    return list(groups.values())


def _steer_hooks(steer: Mapping[int, LayerSteerBuffers], rows: torch.Tensor) -> dict:
    def make(buf: LayerSteerBuffers):
        def edit(act: torch.Tensor, ctx) -> torch.Tensor:
            positions = ctx.positions.to(act.device)[None, :].expand(act.shape[0], -1)
            return buf.apply(act, positions, rows=rows)
        return edit
    return {resid_post(n): make(buf) for n, buf in steer.items()}


def _copy_caches(adapter: QwenAdapter, cache, state: DecodeState, rows: torch.Tensor, P: int) -> None:
    for n, kind in enumerate(adapter.layer_types):
        if kind == "linear_attention":
            conv, recurrent = cached_states(cache, n)  # through the cache API of 5.17-5.22 or 5.23+
            # transformers keeps [b, C, >= Kc] channel-major; the engine the last Kc - 1 inputs token-major
            taps = state.conv[n].shape[1]
            tail = conv[..., conv.shape[-1] - taps:].transpose(1, 2)
            state.conv[n].index_copy_(0, rows, tail.to(state.conv[n].dtype))
            state.recurrent[n].index_copy_(0, rows, recurrent.float())
        else:
            layer = cache.layers[n]
            state.k_cache[n][:, :, :P].index_copy_(0, rows, layer.keys.to(state.k_cache[n].dtype))
            state.v_cache[n][:, :, :P].index_copy_(0, rows, layer.values.to(state.v_cache[n].dtype))


@torch.no_grad()
def prefill(adapter: QwenAdapter, prompts: Sequence[torch.Tensor], state: DecodeState,
            steer: Mapping[int, LayerSteerBuffers], sampling: SamplingBuffers | None) -> None:
    """Run every prompt through the model, fill the caches, and sample each row's first token (column 0).

    Args:
        adapter: the model's adapter.
        prompts: one [P_b] int64 tensor of token ids per row.
        state: the batch's ``DecodeState`` (caches, prompt lengths and column 0 are written).
        steer: the steering buffers (their prompt-position masks act here).
        sampling: sampling buffers, or None for greedy.
    """
    from transformers import DynamicCache

    device = state.prompt_lengths.device
    logits = torch.zeros(state.layout.B, state.layout.V, device=device)
    config = adapter.config.get_text_config(decoder=True)
    for group in length_groups(prompts):
        rows = torch.tensor(group, dtype=torch.long, device=device)
        ids = torch.stack([prompts[b].to(device) for b in group])  # [b, P]
        P = ids.shape[1]
        cache = DynamicCache(config=config)
        with intervene(adapter.model, _steer_hooks(steer, rows)):
            out = adapter.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{_cache_kwarg(adapter.model): cache})
        _copy_caches(adapter, cache, state, rows, P)
        state.prompt_lengths.index_fill_(0, rows, P)
        logits.index_copy_(0, rows, out.logits[:, -1].float())
    record_step(state, logits, choose_tokens(logits, sampling), state.gen_index)
    state.gen_index.add_(1)
