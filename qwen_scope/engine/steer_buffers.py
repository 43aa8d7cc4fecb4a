"""Steering edits as fixed-shape tensor ops over per-row device buffers, for the prefill hook and the decode step.

The math is ``qwen_scope.steering``'s, term for term: per edit ``j`` at a layer, ``delta += mask_j * step_j`` in the
edits' order, with ``step = a * W_dec[:, i]`` (raw), ``a * size * unit`` (unit: size 1; norm: the token's residual
norm) or ``(v - z_i) * W_dec[:, i]`` (clamp through the SAE with the error term kept; ablate is v = 0), and the
position masks are ``steering._mask`` itself, evaluated once per row over every cache slot. What differs is where the
numbers live: strengths, features, directions and masks are [B, E, ...] buffers (E = most edits any row has at the
layer), and the kind of each slot is a 0/1 selector, so one captured graph serves every row and every strength.
Selecting by multiplying with exact 0 and 1 changes no bit of the selected term (``x * 1 == x``, ``x + 0 == x``).
A row with fewer edits pads with inert slots (mask 0) after its own, so its sum is the reference's.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from qwen_scope.steering import FeatureEdit, _mask, parse_steer_positions
from saes import TopKSAE

__all__ = ["LayerSteerBuffers", "build_steer_buffers", "structure_of"]


def structure_of(rows: Sequence[Sequence[FeatureEdit]]) -> tuple:
    """What a captured step depends on: per edited layer, the slot count and which kinds of edit occur.

    Two requests with the same structure differ only in buffer contents (strengths, features, masks).
    """
    per_layer: dict[int, list[int]] = {}
    kinds: dict[int, set[str]] = {}
    for edits in rows:
        counts: dict[int, int] = {}
        for e in edits:
            counts[e.layer] = counts.get(e.layer, 0) + 1
            kinds.setdefault(e.layer, set()).add("clamp" if e.mode != "add" else e.scale)
        for layer, c in counts.items():
            per_layer.setdefault(layer, []).append(c)
    return tuple((layer, max(cs), tuple(sorted(kinds[layer]))) for layer, cs in sorted(per_layer.items()))


class LayerSteerBuffers:
    """Every row's edits at one layer, as device buffers.

    Attributes:
        layer, sae: the edited layer and its SAE.
        values: [B, E] float32 strengths / clamp values. features: [B, E] int64.
        directions: [B, E, d_model] float32 raw decoder columns. units: [B, E, d_model] their unit vectors.
        sel_raw / sel_scaled / is_norm / sel_clamp: [B, E] float32 0/1 selectors of each slot's kind.
        masks: [B, E, S] float32, the position mask of each slot over every cache slot.
        has_scaled / has_clamp: whether any slot is unit/norm (resp. clamp/ablate): the only structural flags.
    """

    def __init__(self, layer: int, sae: TopKSAE, B: int, E: int, S: int, d_model: int, device: torch.device,
                 has_scaled: bool, has_clamp: bool):
        self.layer, self.sae, self.S = layer, sae, S
        self.has_scaled, self.has_clamp = has_scaled, has_clamp
        z = dict(device=device)
        self.values = torch.zeros(B, E, **z)
        self.features = torch.zeros(B, E, dtype=torch.long, **z)
        self.directions = torch.zeros(B, E, d_model, **z)
        self.units = torch.zeros(B, E, d_model, **z)
        self.sel_raw, self.sel_scaled, self.is_norm, self.sel_clamp = (torch.zeros(B, E, **z) for _ in range(4))
        self.masks = torch.zeros(B, E, S, **z)

    def write(self, rows: Sequence[Sequence[FeatureEdit]], prompt_lengths: Sequence[int]) -> None:
        """Fill every buffer in place from each row's edits at this layer (rows without any get inert slots)."""
        for buf in (self.values, self.directions, self.units, self.sel_raw, self.sel_scaled, self.is_norm,
                    self.sel_clamp, self.masks):
            buf.zero_()
        self.features.zero_()
        slots = torch.arange(self.S)
        for b, (edits, prompt_length) in enumerate(zip(rows, prompt_lengths)):
            mine = [e for e in edits if e.layer == self.layer]
            if not mine:
                continue
            directions = self.sae.decoder_directions([e.feature for e in mine]).float()  # [n, d_model]
            for j, e in enumerate(mine):
                self._write_slot(b, j, e, directions[j], _mask(parse_steer_positions(e.positions), slots,
                                                                int(prompt_length)))

    def _write_slot(self, b: int, j: int, e: FeatureEdit, d: torch.Tensor, mask: torch.Tensor) -> None:
        device = self.values.device
        self.values[b, j] = e.value
        self.features[b, j] = e.feature
        self.directions[b, j] = d.to(device)
        # The reference's unit vector, formed from the same [d_model] vector with the same ops.
        self.units[b, j] = (d / d.norm().clamp_min(1e-12)).to(device)
        if e.mode == "add" and e.scale == "raw":
            self.sel_raw[b, j] = 1.0
        elif e.mode == "add":
            self.sel_scaled[b, j] = 1.0
            self.is_norm[b, j] = 1.0 if e.scale == "norm" else 0.0
        else:
            self.sel_clamp[b, j] = 1.0
        self.masks[b, j] = mask.to(device=device, dtype=torch.float32)

    def set_value(self, row: int, slot: int, value: float) -> None:
        """Change one strength / clamp value in place (the captured step reads it on its next replay)."""
        self.values[row, slot] = float(value)

    def apply(self, act: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``act`` [B, T, d_model] with every row's edits applied at ``positions`` [B, T] (int64, absolute).

        ``rows`` ([B] int64) picks the buffer rows ``act`` belongs to (a prefill group); None means all, in order.
        """
        names = ("values", "features", "directions", "units", "sel_raw", "sel_scaled", "is_norm", "sel_clamp",
                 "masks")
        t = {name: getattr(self, name) if rows is None else getattr(self, name).index_select(0, rows)
             for name in names}
        h = act.float()
        delta = torch.zeros_like(h)
        B, T = positions.shape
        # the clamped features' current codes only: no top-k sort of all d_sae codes at every step
        codes = (self.sae.feature_codes(h, t["features"][:, None, :].expand(B, T, -1)).float()
                 if self.has_clamp else None)  # [B, T, E]
        norms = h.norm(dim=-1, keepdim=True) if self.has_scaled else None  # [B, T, 1]
        for j in range(t["values"].shape[1]):
            mask = t["masks"][:, j].gather(1, positions)[..., None]  # [B, T, 1]
            v = t["values"][:, j, None, None]  # [B, 1, 1]
            d = t["directions"][:, j, None, :]  # [B, 1, d_model]
            step = t["sel_raw"][:, j, None, None] * (v * d.expand_as(h))
            if norms is not None:
                size = torch.where(t["is_norm"][:, j, None, None] > 0, norms, torch.ones_like(norms))
                step = step + t["sel_scaled"][:, j, None, None] * (v * size * t["units"][:, j, None, :])
            if codes is not None:
                z = codes[..., j, None]  # [B, T, 1]
                step = step + t["sel_clamp"][:, j, None, None] * ((v - z) * d)
            delta = delta + mask * step
        return (h + delta).to(act.dtype)


def build_steer_buffers(rows: Sequence[Sequence[FeatureEdit]], saes: Mapping[int, TopKSAE],
                        prompt_lengths: Sequence[int], S: int, d_model: int,
                        device: torch.device) -> dict[int, LayerSteerBuffers]:
    """``{layer: LayerSteerBuffers}`` for every layer any row edits, filled from ``rows`` (one edit list per row)."""
    out = {}
    for layer, E, kinds in structure_of(rows):
        if layer not in saes:
            raise KeyError(f"no SAE at layer {layer} for a steering edit; SAEs are loaded at layers {sorted(saes)}")
        buf = LayerSteerBuffers(layer, saes[layer], len(rows), E, S, d_model, device,
                                has_scaled=bool({"unit", "norm"} & set(kinds)), has_clamp="clamp" in kinds)
        buf.write(rows, prompt_lengths)
        out[layer] = buf
    return out
