"""Host-side planning: chunk and segment tables, and when to split sequences (intra-card context parallelism).

No tilelang here. A plan depends only on the sequence lengths and the head layout, so it is cached.
Splitting a sequence into segments costs one extra pass over the split part (each segment's exact affine map,
``segment_states``) plus a short scan; it pays when a few long sequences would leave most SMs idle.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

CHUNK = 64
CTAS_PER_SM = 2
# Relative costs in "one chunk step of the fused stage" units, measured on an H200.
MAP_STEP_COST = 0.6
SCAN_STEP_COST = 0.4
CP_FIXED_COST = 6.0
SEGMENT_CHOICES = (4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Plan:
    """Tables the kernels read (int32, on the device) and the split chosen.

    chunks [NC, 2]: (start, end) of every chunk. segs [S, 4]: (start, end, init row, final row) per segment.
    maps [R, 2]: token ranges of the non-final segments (context parallelism only, else None).
    seqs [N, 3]: (first segment, number of segments, first map row) per sequence (None without context parallelism).
    segment_chunks: the segment length in chunks, 0 when sequences are not split.
    """

    chunks: torch.Tensor
    segs: torch.Tensor
    maps: torch.Tensor | None
    seqs: torch.Tensor | None
    segment_chunks: int


def _cost(seq_chunks: list[int], L: int, units: int, map_units: int, slots: int) -> float:
    if L == 0:
        return max(max(seq_chunks), sum(seq_chunks) * units / slots)
    parts = [min(L, c - i) for c in seq_chunks for i in range(0, max(c, 1), L)]
    main = max(max(parts), sum(seq_chunks) * units / slots)
    split = [c - ((c - 1) // L) * L for c in seq_chunks]
    map_chunks = sum(seq_chunks) - sum(split)
    maps = MAP_STEP_COST * max(L, map_chunks * map_units / slots)
    scan = SCAN_STEP_COST * max((c + L - 1) // L for c in seq_chunks)
    return main + maps + scan + CP_FIXED_COST


def choose_segment_chunks(seq_chunks: list[int], Hv: int, nV: int, nK: int, num_sms: int) -> int:
    """Segment length in chunks that minimises the cost model (0 = do not split)."""
    if not seq_chunks or max(seq_chunks) <= SEGMENT_CHOICES[0]:
        return 0
    slots = num_sms * CTAS_PER_SM
    best, best_cost = 0, _cost(seq_chunks, 0, Hv * nV, Hv * (nV + nK), slots)
    for L in SEGMENT_CHOICES:
        if L >= max(seq_chunks):
            break
        c = _cost(seq_chunks, L, Hv * nV, Hv * (nV + nK), slots)
        if c < best_cost:
            best, best_cost = L, c
    return best


@functools.lru_cache(maxsize=64)
def _tables(cu: tuple[int, ...], L: int, has_init: bool):
    chunks, segs, maps, seqs = [], [], [], []
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        chunks += [(s, min(s + CHUNK, eos)) for s in range(bos, eos, CHUNK)]
        step = L * CHUNK if L else max(eos - bos, 1)
        starts = list(range(bos, eos, step)) or [bos]
        first, first_map = len(segs), len(maps)
        for i, s in enumerate(starts):
            e = min(s + step, eos)
            last = i == len(starts) - 1
            init = len(segs) if L else (n if has_init else -1)
            segs.append((s, e, init, n if last else -1))
            if not last:
                maps.append((s, e))
        seqs.append((first, len(starts), first_map))
    return chunks, segs, maps, seqs


def make_plan(cu_seqlens: list[int], Hv: int, nV: int, nK: int, has_init: bool, device: torch.device,
              segment_chunks: int | None = None) -> Plan:
    """Build (or fetch) the plan for packed sequences with offsets ``cu_seqlens`` [N+1].

    ``segment_chunks``: None picks by the cost model; 0 never splits; L > 0 forces L-chunk segments.
    The environment variable FLASHQLA_KERNELS_SEGMENT_CHUNKS overrides None.
    """
    if segment_chunks is None and os.environ.get("FLASHQLA_KERNELS_SEGMENT_CHUNKS"):
        segment_chunks = int(os.environ["FLASHQLA_KERNELS_SEGMENT_CHUNKS"])
    if segment_chunks is None:
        seq_chunks = [(cu_seqlens[i + 1] - cu_seqlens[i] + CHUNK - 1) // CHUNK for i in range(len(cu_seqlens) - 1)]
        segment_chunks = choose_segment_chunks(seq_chunks, Hv, nV, nK, _num_sms(device))
    return _device_plan(tuple(cu_seqlens), segment_chunks, has_init, device)


@functools.lru_cache(maxsize=64)
def _device_plan(cu: tuple[int, ...], L: int, has_init: bool, device: torch.device) -> Plan:
    chunks, segs, maps, seqs = _tables(cu, L, has_init)
    flat = [x for row in chunks for x in row] + [x for row in segs for x in row]
    flat += [x for row in maps for x in row] + [x for row in seqs for x in row]
    buf = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    a, b, c = 2 * len(chunks), 2 * len(chunks) + 4 * len(segs), 2 * len(chunks) + 4 * len(segs) + 2 * len(maps)
    return Plan(
        chunks=buf[:a].view(-1, 2),
        segs=buf[a:b].view(-1, 4),
        maps=buf[b:c].view(-1, 2) if L else None,
        seqs=buf[c:].view(-1, 3) if L else None,
        segment_chunks=L,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
