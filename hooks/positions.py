"""Token-position selections shared by capture and steering: ``None`` (all), ints, or a spec like ``"0,2,5-8"``.

Non-negative entries are absolute positions in the sequence (so they keep their meaning on decode steps, where a
forward pass sees one token at position ``past_length``); negative entries count from the end of each forward
pass (``-1`` is the last token of the pass, i.e. every new token during generation).
"""
from __future__ import annotations

import operator
import re
from collections.abc import Sequence

import torch

__all__ = ["parse_positions", "position_mask"]

_RANGE = re.compile(r"^(-?\d+)\s*-\s*(-?\d+)$")


def parse_positions(spec: None | int | str | Sequence[int]) -> tuple[int, ...] | None:
    """Normalise a position selection.

    Args:
        spec: ``None`` or ``"all"`` (every position), an int, a sequence of ints, or a string of comma-separated
            positions and inclusive ranges, e.g. ``"0,2,5-8"`` (= 0, 2, 5, 6, 7, 8). Ranges must be non-negative.

    Returns:
        a sorted tuple of distinct positions, or None for "all".

    Raises:
        ValueError: for a malformed spec, naming the bad part.

    Example:
        >>> parse_positions("0,2,5-8")
        (0, 2, 5, 6, 7, 8)
    """
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise TypeError(f"positions must be None, an int, a sequence of ints or a spec like '0,2,5-8'; got {spec!r}")
    if isinstance(spec, torch.Tensor):
        if spec.is_floating_point() or spec.is_complex():
            raise TypeError(f"positions must be integers, got a {spec.dtype} tensor; convert with .long() if intended")
        return tuple(sorted({int(p) for p in spec.flatten().tolist()}))
    if not isinstance(spec, str):
        try:  # int, numpy integer scalars
            return (operator.index(spec),)
        except TypeError:
            pass
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in ("all", "*", ""):
            return None
        out: set[int] = set()
        for part in text.split(","):
            part = part.strip()
            if m := _RANGE.match(part):
                lo, hi = int(m[1]), int(m[2])
                if lo < 0 or hi < lo:
                    raise ValueError(f"bad position range {part!r} in {spec!r}: expected 'lo-hi' with 0 <= lo <= hi")
                out.update(range(lo, hi + 1))
            elif re.fullmatch(r"-?\d+", part):
                out.add(int(part))
            else:
                raise ValueError(f"bad position {part!r} in {spec!r}: expected e.g. 'all', '5', '3-7' or '0,2,5-8'")
        return tuple(sorted(out))
    try:
        # operator.index, not int(): a float position (2.7) is a mistake to report, not to truncate.
        return tuple(sorted({operator.index(p) for p in spec}))
    except (TypeError, ValueError):
        raise TypeError(f"positions must be None, an int, a sequence of ints or a spec like '0,2,5-8'; got {spec!r}")


def position_mask(selection: tuple[int, ...] | None, positions: torch.Tensor) -> torch.Tensor:
    """Which tokens of one forward pass a selection keeps.

    Args:
        selection: output of ``parse_positions`` (None = all).
        positions: LongTensor [T], absolute positions of the pass's tokens.

    Returns:
        BoolTensor [T] on ``positions.device``.
    """
    T = positions.shape[0]
    if selection is None:
        return torch.ones(T, dtype=torch.bool, device=positions.device)
    absolute = torch.tensor([p for p in selection if p >= 0], dtype=positions.dtype, device=positions.device)
    mask = torch.isin(positions, absolute)
    for p in selection:
        if p < 0 and -p <= T:
            mask[T + p] = True
    return mask
