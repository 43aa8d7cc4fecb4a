"""The engine's preallocated state for one batch: caches, per-row bookkeeping and every output buffer.

Everything a decode step reads or writes lives here, allocated once before the prefill, so a captured step replays
against the same addresses on every token. Sizes are computed first (``StateLayout.nbytes``) so a batch that cannot
fit is refused before anything is allocated, with the batch size that would.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hooks import QwenAdapter

__all__ = ["StateLayout", "DecodeState", "EngineMemoryError", "check_fits"]

# Headroom kept free on the GPU for the step's intermediates, the allocator's fragmentation and the graph pool.
_FREE_FRACTION = 0.9


class EngineMemoryError(ValueError):
    """The batch's preallocated state does not fit in free device memory; the message names a batch that would."""


@dataclass(frozen=True)
class StateLayout:
    """Shapes of one batch's state, derived from the model and the request (no tensors).

    Attributes:
        B: rows. S: cache slots per row (longest prompt + max_new_tokens). G: generated-token columns.
        top_n: candidates kept per step. V: vocabulary. readout_k: {layer: k} SAE codes kept per generated token.
        keep_logits: whether the [B, G, V] float32 logits of every step are kept.
        attention: {layer: (Hkv, D)}. gdn: {layer: (C, K, Hv, Dk, Dv)}. dtype: the model's dtype.
    """

    B: int
    S: int
    G: int
    top_n: int
    V: int
    attention: dict[int, tuple[int, int]]
    gdn: dict[int, tuple[int, int, int, int, int]]
    dtype: torch.dtype
    readout_k: dict[int, int] = field(default_factory=dict)
    keep_logits: bool = False

    @classmethod
    def of(cls, adapter: QwenAdapter, B: int, S: int, G: int, *, top_n: int, readout_k: dict[int, int],
           keep_logits: bool) -> StateLayout:
        attention, gdn = {}, {}
        for n, kind in enumerate(adapter.layer_types):
            mixer = adapter.mixer(n)
            if kind == "linear_attention":
                C = mixer.key_dim * 2 + mixer.value_dim
                gdn[n] = (C, mixer.conv_kernel_size, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
            else:
                attention[n] = (mixer.k_proj.out_features // mixer.head_dim, mixer.head_dim)
        V = int(adapter.unembed.out_features)
        dtype = next(adapter.model.parameters()).dtype
        return cls(B, S, G, top_n, V, attention, gdn, dtype, dict(readout_k), keep_logits)

    def per_row_bytes(self) -> int:
        """Bytes of state one row adds (everything here scales with B)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        kv = sum(2 * h * self.S * d * item for h, d in self.attention.values())
        gdn = sum(C * (K - 1) * item + Hv * Dk * Dv * 4 for C, K, Hv, Dk, Dv in self.gdn.values())
        cols = self.G + 1
        outputs = cols * (8 + 4 + self.top_n * (8 + 4))
        readout = sum(self.G * k * (4 + 8) for k in self.readout_k.values())
        logits = cols * self.V * 4 if self.keep_logits else 0
        # the step's own largest intermediates: the float32 logits row, its sort for top-k / top-p, the SAE codes
        work = self.V * (4 + 4 + 8)
        return kv + gdn + outputs + readout + logits + 8 * 8 + work

    def nbytes(self) -> int:
        """Preallocated bytes of the whole batch."""
        return self.B * self.per_row_bytes()


def check_fits(layout: StateLayout, device: torch.device) -> None:
    """Refuse a batch whose state exceeds the free memory of ``device`` (CUDA only; CPU memory is not checked).

    Raises:
        EngineMemoryError: naming the bytes asked, the bytes free and the largest batch size that fits.
    """
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    need = layout.nbytes()
    budget = int(free * _FREE_FRACTION)
    if need <= budget:
        return
    fits = budget // max(layout.per_row_bytes(), 1)
    raise EngineMemoryError(
        f"batch {layout.B} needs {need / 2**30:.2f} GiB of preallocated decode state ({layout.S} cache slots, "
        f"{layout.G} new tokens{', full logits kept' if layout.keep_logits else ''}) but {device} has "
        f"{free / 2**30:.2f} GiB free ({_FREE_FRACTION:.0%} usable); batch {fits} fits"
        + ("" if fits else ": shorten the prompts or max_new_tokens, or free GPU memory"))


class DecodeState:
    """The static buffers of one batch (allocated by ``__init__``, never reallocated).

    Attributes:
        k_cache / v_cache: {layer: [B, Hkv, S, D]}. conv: {layer: [B, K-1, C]} token-major. recurrent: {layer: [B, Hv, Dk, Dv]} fp32.
        prompt_lengths: [B] int64. gen_index: [1] int64, tokens sampled so far (the column the next one goes to).
        last_tokens: [B] the token each row feeds next. finished: [B] bool. lengths: [B] tokens generated per row.
        max_new: [B] per-row token budget. stop_ids: [n_stop] (empty: never stop).
        tokens: [B, G + 1]. probs: [B, G + 1]. top_ids / top_probs: [B, G + 1, top_n].
        logits: [B, G + 1, V] float32 or None. readout_values / readout_indices: {layer: [B, G, k]}.
    """

    def __init__(self, layout: StateLayout, device: torch.device, *, pad_id: int, stop_ids: list[int]):
        self.layout = layout
        B, S, G, dt = layout.B, layout.S, layout.G, layout.dtype
        z = dict(device=device)
        self.k_cache = {n: torch.zeros(B, h, S, d, dtype=dt, **z) for n, (h, d) in layout.attention.items()}
        self.v_cache = {n: torch.zeros(B, h, S, d, dtype=dt, **z) for n, (h, d) in layout.attention.items()}
        self.conv = {n: torch.zeros(B, K - 1, C, dtype=dt, **z) for n, (C, K, _, _, _) in layout.gdn.items()}
        self.recurrent = {n: torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, **z)
                          for n, (_, _, Hv, Dk, Dv) in layout.gdn.items()}
        self.prompt_lengths = torch.zeros(B, dtype=torch.long, **z)
        self.gen_index = torch.zeros(1, dtype=torch.long, **z)
        self.last_tokens = torch.zeros(B, dtype=torch.long, **z)
        self.finished = torch.zeros(B, dtype=torch.bool, **z)
        self.lengths = torch.zeros(B, dtype=torch.long, **z)
        self.max_new = torch.full((B,), G, dtype=torch.long, **z)
        self.pad = torch.full((B,), pad_id, dtype=torch.long, **z)
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, **z)
        self.slots = torch.arange(S, **z)
        self.tokens = torch.full((B, G + 1), pad_id, dtype=torch.long, **z)
        self.probs = torch.zeros(B, G + 1, **z)
        self.top_ids = torch.zeros(B, G + 1, layout.top_n, dtype=torch.long, **z)
        self.top_probs = torch.zeros(B, G + 1, layout.top_n, **z)
        self.logits = torch.zeros(B, G + 1, layout.V, **z) if layout.keep_logits else None
        self.readout_values = {n: torch.zeros(B, G, k, **z) for n, k in layout.readout_k.items()}
        self.readout_indices = {n: torch.zeros(B, G, k, dtype=torch.long, **z) for n, k in layout.readout_k.items()}

    def nbytes(self) -> int:
        """Bytes actually held by the buffers (the layout's estimate less the step's working set)."""
        seen = 0
        for value in vars(self).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            seen += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return seen

    def decode_positions(self) -> torch.Tensor:
        """[B] where the token fed by the next step sits: prompt length + tokens sampled before it."""
        return self.prompt_lengths + self.gen_index - 1
