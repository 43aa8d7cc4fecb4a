"""The one record of every attribute the patches replaced, so that unpatching restores exactly what was there.

Every patch (the op globals of transformers' modeling modules, the op attributes of old transformers' layer
instances, the ``forward`` of the GDN, RMSNorm, MLP, attention and decoder-layer classes) goes through
:func:`swap`, which records ``(owner, attribute name, original value)`` the first time an attribute is replaced and
only re-points it after that: the original saved first stays saved, however often a patch is re-applied.
:func:`restore` puts the originals back in reverse order of the swaps (an attribute the owner did not hold itself,
e.g. a method inherited from a base class, is deleted again). :func:`snapshot` / :func:`restore_snapshot` let the
context managers leave exactly the state found on entry, whatever it was: which attributes were patched, by which
replacement, with which originals.

Each swap belongs to a *group* (``"op"``, ``"gdn"``, ``"norms"``, ``"mlp"``, ``"attention"``, ``"decoder"``), so a
patch can take off its own swaps and leave the others. Nothing here knows transformers.

Example:
    >>> swap(module, "torch_chunk_gated_delta_rule", ours, group="op", target="...modeling_qwen3_5.torch_chunk...")
    >>> saved = snapshot()
    >>> restore()                    # every original back
    >>> restore_snapshot(saved)      # the patched state again, the same replacement objects
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Swap", "Snapshot", "swap", "original", "restore", "snapshot", "restore_snapshot", "swaps", "mark",
           "backend_of", "ABSENT"]


class _Absent:
    """The original of an attribute the owner did not hold itself (inherited or missing): restoring deletes it."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()
# the attribute a replacement carries its backend in (None, "torch" or "tilelang")
_BACKEND_ATTR = "_flashqla_backend"


@dataclass(frozen=True)
class Swap:
    """One replaced attribute: ``owner.name`` held ``original`` (``ABSENT``: nothing of its own) before the first
    swap; ``group`` is the patch it belongs to, ``target`` the dotted name reported to the user."""

    owner: Any
    name: str
    original: Any
    group: str
    target: str


@dataclass(frozen=True)
class Snapshot:
    """The registry's swaps and the value each attribute held when the snapshot was taken."""

    entries: tuple[tuple[Swap, Any], ...]


_swaps: dict[tuple[int, str], Swap] = {}  # insertion order = swap order


def _key(owner: Any, name: str) -> tuple[int, str]:
    return id(owner), name


def _own(owner: Any, name: str) -> Any:
    """What ``owner`` holds itself under ``name`` (not inherited), or ABSENT."""
    return vars(owner).get(name, ABSENT)


def swap(owner: Any, name: str, value: Any, *, group: str, target: str) -> None:
    """Set ``owner.name = value``, recording the original on the first swap of this attribute."""
    key = _key(owner, name)
    if key not in _swaps:
        _swaps[key] = Swap(owner, name, _own(owner, name), group, target)
    setattr(owner, name, value)


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before our swaps: the recorded original, else the current (maybe inherited) value."""
    record = _swaps.get(_key(owner, name))
    if record is None or record.original is ABSENT:
        return getattr(owner, name)
    return record.original


def swaps(*groups: str) -> list[Swap]:
    """The recorded swaps of ``groups`` (all of them without groups), in swap order."""
    return [s for s in _swaps.values() if not groups or s.group in groups]


def _put_back(record: Swap) -> None:
    if record.original is not ABSENT:
        setattr(record.owner, record.name, record.original)
    elif record.name in vars(record.owner):
        delattr(record.owner, record.name)


def restore(*groups: str) -> list[str]:
    """Put back the originals of the swaps of ``groups`` (all without groups), newest first, and forget them.

    Returns:
        The restored targets, in the order they were restored.
    """
    done = []
    for record in reversed(swaps(*groups)):
        _put_back(record)
        del _swaps[_key(record.owner, record.name)]
        done.append(record.target)
    return done


def snapshot() -> Snapshot:
    """Every recorded swap with the value its attribute holds now."""
    return Snapshot(tuple((s, getattr(s.owner, s.name)) for s in _swaps.values()))


def restore_snapshot(saved: Snapshot) -> None:
    """Return to the state ``saved`` records: every current swap undone, then the saved swaps re-applied in their
    order with the values they held (the same replacement objects) and the same originals recorded."""
    restore()
    for record, value in saved.entries:
        _swaps[_key(record.owner, record.name)] = record
        setattr(record.owner, record.name, value)


def mark(replacement: Any, backend: str | None, wrapped: Any = None) -> Any:
    """Tag a replacement with its backend (and, for a forward, the original it wraps as ``__wrapped__``)."""
    setattr(replacement, _BACKEND_ATTR, backend)
    if wrapped is not None:
        replacement.__wrapped__ = wrapped
    return replacement


def backend_of(fn: Any, default: Any = ABSENT) -> Any:
    """The backend a replacement of ours runs (None, "torch" or "tilelang"); ``default`` for anything else."""
    return getattr(fn, _BACKEND_ATTR, default)
