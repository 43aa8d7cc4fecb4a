"""Token-position selections shared by capture and steering: ``None`` (all), ints, or a spec like ``"0,2,5-8"``.

Non-negative entries are absolute positions in the sequence (so they keep their meaning on decode steps, where a
forward pass sees one token at position ``past_length``); negative entries count from the end of each forward
pass (``-1`` is the last token of the pass, i.e. every new token during generation).
"""
from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["Positions", "parse_positions", "position_mask"]

_RANGE = re.compile(r"^(-?\d+)\s*-\s*(-?\d+)$")
# Positions live in int64 tensors; anything past this is a typo, not a sequence.
_MAX_POSITION = 2 ** 62


@dataclass(frozen=True)
class Positions:
    """A token selection kept in bounded form: merged inclusive ranges of absolute positions, plus positions counted
    from the end of each pass. ``"0-100000000"`` is one range, never a set of 10^8 ints.

    Attributes:
        ranges: sorted, non-overlapping ``(lo, hi)`` inclusive ranges of non-negative positions.
        from_end: sorted negative positions (``-1`` is the last token of a pass).
    """

    ranges: tuple[tuple[int, int], ...] = ()
    from_end: tuple[int, ...] = ()

    @classmethod
    def of(cls, absolute: Sequence[tuple[int, int]], from_end: Sequence[int] = ()) -> Positions:
        """Merge (lo, hi) ranges (any order, overlapping or adjacent) and negative positions into a ``Positions``."""
        merged: list[list[int]] = []
        for lo, hi in sorted(absolute):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return cls(tuple((lo, hi) for lo, hi in merged), tuple(sorted(set(from_end))))

    def __bool__(self) -> bool:
        return bool(self.ranges or self.from_end)

    def __contains__(self, position: int) -> bool:
        if position < 0:
            return position in self.from_end
        return any(lo <= position <= hi for lo, hi in self.ranges)

    @cached_property
    def _bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        lo = torch.tensor([r[0] for r in self.ranges], dtype=torch.long)
        hi = torch.tensor([r[1] for r in self.ranges], dtype=torch.long)
        return lo, hi

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """BoolTensor [T]: which tokens of a pass (absolute ``positions`` [T]) the selection keeps."""
        T = positions.shape[0]
        mask = torch.zeros(T, dtype=torch.bool, device=positions.device)
        if self.ranges:
            lo, hi = (b.to(positions.device) for b in self._bounds)
            where = positions.long()
            # The last range starting at or before each position, then whether it reaches that far.
            i = torch.searchsorted(lo, where, right=True) - 1
            mask = (i >= 0) & (where <= hi[i.clamp_min(0)])
        for p in self.from_end:
            if -p <= T:
                mask[T + p] = True
        return mask


def _checked(value: int, spec: object) -> int:
    if abs(value) > _MAX_POSITION:
        raise ValueError(f"position {value} in {spec!r} is beyond any sequence (more than 2**62); expected e.g. "
                         f"'0-1023'")
    return value


def _from_ints(values, spec: object) -> Positions:
    ints = [_checked(v, spec) for v in values]
    return Positions.of([(p, p) for p in ints if p >= 0], [p for p in ints if p < 0])


def parse_positions(spec: None | int | str | Sequence[int] | Positions) -> Positions | None:
    """Normalise a position selection, once, into bounded form.

    Args:
        spec: ``None`` or ``"all"`` (every position), an int, a sequence of ints, a LongTensor, a ``Positions``, or a
            string of comma-separated positions and inclusive ranges, e.g. ``"0,2,5-8"`` (= 0, 2, 5, 6, 7, 8). Ranges
            must be non-negative; a range past the sequence simply selects nothing there.

    Returns:
        a ``Positions`` (merged ranges, never expanded), or None for "all".

    Raises:
        ValueError: for a malformed spec, naming the bad part.
        TypeError: for floats, bools and other non-integers.

    Example:
        >>> parse_positions("0,2,5-8,-1")
        Positions(ranges=((0, 0), (2, 2), (5, 8)), from_end=(-1,))
    """
    if spec is None or isinstance(spec, Positions):
        return spec
    if isinstance(spec, bool):
        raise TypeError(f"positions must be None, an int, a sequence of ints or a spec like '0,2,5-8'; got {spec!r}")
    if isinstance(spec, torch.Tensor):
        if spec.is_floating_point() or spec.is_complex() or spec.dtype == torch.bool:
            raise TypeError(f"positions must be integers, got a {spec.dtype} tensor; convert with .long() if intended")
        return _from_ints(spec.flatten().unique().tolist(), "tensor")
    if not isinstance(spec, str):
        try:  # int, numpy integer scalars
            return _from_ints([operator.index(spec)], spec)
        except TypeError:
            pass
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in ("all", "*", ""):
            return None
        ranges: list[tuple[int, int]] = []
        ends: list[int] = []
        for part in text.split(","):
            part = part.strip()
            if m := _RANGE.match(part):
                lo, hi = _checked(int(m[1]), spec), _checked(int(m[2]), spec)
                if lo < 0 or hi < lo:
                    raise ValueError(f"bad position range {part!r} in {spec!r}: expected 'lo-hi' with 0 <= lo <= hi")
                ranges.append((lo, hi))
            elif re.fullmatch(r"-?\d+", part):
                p = _checked(int(part), spec)
                if p >= 0:
                    ranges.append((p, p))
                else:
                    ends.append(p)
            else:
                raise ValueError(f"bad position {part!r} in {spec!r}: expected e.g. 'all', '5', '3-7' or '0,2,5-8'")
        return Positions.of(ranges, ends)
    try:
        # operator.index, not int(): a float position (2.7) is a mistake to report, not to truncate.
        return _from_ints([operator.index(p) for p in spec], spec)
    except (TypeError, ValueError):
        raise TypeError(f"positions must be None, an int, a sequence of ints or a spec like '0,2,5-8'; got {spec!r}")


def position_mask(selection: Positions | None, positions: torch.Tensor) -> torch.Tensor:
    """Which tokens of one forward pass a selection keeps.

    Args:
        selection: output of ``parse_positions`` (None = all).
        positions: LongTensor [T], absolute positions of the pass's tokens.

    Returns:
        BoolTensor [T] on ``positions.device``.
    """
    if selection is None:
        return torch.ones(positions.shape[0], dtype=torch.bool, device=positions.device)
    return selection.mask(positions)
