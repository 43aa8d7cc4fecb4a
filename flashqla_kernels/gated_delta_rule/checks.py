"""Input validation shared by the reference, the torch path and the public API.

One place that knows the op's shapes, so every entry point raises the same actionable error.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["check_inputs", "host_offsets", "sequence_spans", "resolve_scale"]


def _shape(x: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in x.shape) + "]"


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor {_shape(x)}"
    return f"a {type(x).__name__}"


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None) -> int:
    """Validate the op's inputs and return N, the number of sequences.

    Args:
        q, k: [B, T, Hk, K]; v: [B, T, Hv, V] with Hv a multiple of Hk; g, beta: [B, T, Hv].
        initial_state: optional [N, Hv, K, V]. cu_seqlens: optional integer [N+1] offsets (then B must be 1).

    Returns:
        N: B for dense inputs, len(cu_seqlens) - 1 for varlen inputs.

    Raises:
        ValueError / TypeError naming the argument, the expected and the actual value.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T, H, D]; got q {_shape(q)}, k {_shape(k)}, v {_shape(v)} "
                         "(head-first layouts are not supported: transpose to [B, T, H, D])")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, T, Hk, K]; got q {_shape(q)}, k {_shape(k)}")
    B, T, Hk, K = k.shape
    Bv, Tv, Hv, V = v.shape
    if (Bv, Tv) != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, Hv, V] like q/k; got v {_shape(v)}")
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(f"value heads Hv={Hv} must be a multiple of q/k heads Hk={Hk} (GVA: value head h reads "
                         f"key head h // (Hv/Hk)); got q/k {_shape(k)}, v {_shape(v)}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, Hv):
            raise ValueError(f"{name} must be [B, T, Hv] = [{B},{T},{Hv}]; got {_shape(x)}")
    devices = {x.device for x in (q, k, v, g, beta)}
    if len(devices) > 1:
        raise ValueError(f"q, k, v, g, beta must be on one device; got {sorted(str(d) for d in devices)}")
    N = B
    if cu_seqlens is not None:
        N = _check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be a floating-point tensor [N, Hv, K, V] (fp32 recommended); got "
                            f"{_describe(initial_state)}")
        if tuple(initial_state.shape) != (N, Hv, K, V):
            raise ValueError(f"initial_state must be [N, Hv, K, V] = [{N},{Hv},{K},{V}] (N = "
                             f"{'len(cu_seqlens) - 1' if cu_seqlens is not None else 'B'}); got {_shape(initial_state)}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}; move it with .to()")
    return N


def _check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> int:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise TypeError("cu_seqlens must be a 1-D integer tensor of offsets [N+1] (FlashAttention style), e.g. "
                        f"torch.tensor([0, 47, 128], dtype=torch.int32); got {_describe(cu_seqlens)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along T, so B must be 1; got B={B}. "
                         "Flatten with x.reshape(1, -1, *x.shape[2:]) and pass offsets.")
    if torch.compiler.is_compiling():
        # reading the offsets is a host sync that would split the traced graph; an eager call checks them
        return cu_seqlens.shape[0] - 1
    offsets, ordered = _offsets_entry(cu_seqlens)
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] > T:
        # cu_seqlens[-1] < T is a padded tail (FlashQLA's packed batches): ignored, its outputs 0
        raise ValueError(f"cu_seqlens must start at 0 and end at most at T={T}; got {offsets[:4]}...{offsets[-2:]}")
    if not ordered:
        raise ValueError(f"cu_seqlens must be non-decreasing; got {list(offsets)}")
    return len(offsets) - 1


_HOST_OFFSETS: dict = {}


def host_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple of ints, without a device sync when the same, unmodified tensor object comes back
    (every layer of a model forward passes the same one; a sync per call would stall the host in the hot path).
    Keyed on object identity, checked by weakref and version."""
    return _offsets_entry(cu_seqlens)[0]


def _offsets_entry(cu_seqlens: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    # (offsets, whether they never decrease), both kept with the tensor's version: a call that finds them costs
    # O(1) host time however many sequences are packed
    key = id(cu_seqlens)
    hit = _HOST_OFFSETS.get(key)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    offsets = tuple(int(x) for x in cu_seqlens.tolist())
    entry = (offsets, all(b >= a for a, b in zip(offsets, offsets[1:])))
    if len(_HOST_OFFSETS) > 64:
        _HOST_OFFSETS.clear()
    _HOST_OFFSETS[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, entry)
    return entry


def sequence_spans(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row b, start, end) of every sequence n, in order n = 0..N-1."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    offsets = host_offsets(cu_seqlens)
    return [(0, s, e) for s, e in zip(offsets, offsets[1:])]


def resolve_scale(scale: float | None, K: int) -> float:
    """The output scale: ``K ** -0.5`` when None (applied after the optional q/k l2norm). 0.0 is honoured."""
    return K ** -0.5 if scale is None else float(scale)
