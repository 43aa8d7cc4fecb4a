"""Host-side planning: chunk and segment tables, the V slice one CTA owns, and when to split sequences (intra-card
context parallelism).

No tilelang here. A plan depends only on the sequence lengths and the head layout, so it is cached.
Splitting a sequence into segments costs one extra pass over the split part (each segment's exact affine map,
``segment_states``) plus a short scan; it pays when a few long sequences would leave most SMs idle.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

CHUNK = 64
# Measured on an H200 (benchmarks/results/gdn_forward.md): splitting pays only while the unsplit CTAs (sequences x Hv x
# V slices) leave a quarter of the SMs idle; shorter segments than MIN_SEGMENT_CHUNKS cost more in maps and scan than
# they win. Segments aim at one CTA per SM: the chunk stage holds one 512-thread CTA per SM, so two waves of L-chunk
# segments take as long as one wave of 2L-chunk ones, and the longer segments halve the maps and the scan. Forced
# lengths on the H200 (ms; results/segments/): 16/32 32768x1: 64 -> 1.040, 128 -> 0.953; 16/64 32768x1: 128 -> 1.710,
# 256 -> 1.637; 16/16 32768x1: 32 -> 0.669, 64 -> 0.570; 2/8 32768x1: 32 -> 0.372, 64 -> 0.319; 16/32 8192x1:
# 32 -> 0.315, 16 -> 0.399, 64 -> 0.420. One CTA per SM picks the fastest length on all five rows; a target of
# two CTAs per SM picked it on one.
MIN_SEGMENT_CHUNKS = 32
CTAS_PER_SM_TARGET = 1
# kkt_solve: value heads of one GVA group solved by one CTA (64 threads each, K K^T shared)
MAX_HEADS_PER_CTA = 4


@dataclass(frozen=True)
class Plan:
    """Tables the kernels read (int32, on the device) and the split chosen.

    chunks [NC, 2]: (start, end) of every chunk. segs [S, 4]: (start, end, init row, final row) per segment.
    maps [R, 2]: token ranges of the non-final segments, each one's affine map (context parallelism only, else None).
    seqs [N, 3]: (first segment, number of segments, first map row) per sequence (None without context parallelism).
    seg_chunk0 [S]: the row of ``chunks`` each segment starts at (where the backward's recompute writes its states).
    segment_chunks: the segment length in chunks, 0 when sequences are not split.
    """

    chunks: torch.Tensor
    segs: torch.Tensor
    maps: torch.Tensor | None
    seqs: torch.Tensor | None
    segment_chunks: int
    seg_chunk0: torch.Tensor


def choose_segment_chunks(seq_chunks: list[int], Hv: int, nV: int, num_sms: int) -> int:
    """Segment length in chunks (a power of two >= 32), or 0 to keep every sequence whole.

    Args:
        seq_chunks: chunks per sequence. Hv: value heads. nV: V slices per head. num_sms: SMs on the device.
    """
    units = len(seq_chunks) * Hv * nV
    if not seq_chunks or 4 * units >= 3 * num_sms:
        return 0
    return _segment_length(max(seq_chunks), units, CTAS_PER_SM_TARGET * num_sms, MIN_SEGMENT_CHUNKS)


def _segment_length(longest: int, units: int, target_ctas: int, shortest: int) -> int:
    """The shortest power-of-two length >= ``shortest`` whose segments of the ``longest`` sequence, times ``units``
    walks, come to ``target_ctas`` or fewer; 0 where it would not split that sequence."""
    L = shortest
    while L < longest * units / target_ctas:
        L *= 2
    return L if longest > L else 0


def heads_per_cta(group: int) -> int:
    """Value heads one kkt_solve CTA solves: the largest divisor of ``group`` (= Hv / Hk) up to MAX_HEADS_PER_CTA."""
    return max(d for d in range(1, MAX_HEADS_PER_CTA + 1) if group % d == 0)


def choose_block_v(N: int, Hv: int, K: int, V: int, num_sms: int) -> int:
    """V slice per CTA: 32 for K = 256 (registers and shared memory), else 128, or 64 when even 64-wide slices
    of N x Hv heads would not fill half the SMs (more, shorter-lived CTAs)."""
    if K > 128:
        return min(V, 32)
    if N * Hv * 2 <= num_sms // 2 or V < 128:
        return min(V, 64)
    return 128


def wide_slices_pay(bdv: int, seq_chunks: list[int], Hv: int, K: int, V: int, num_sms: int,
                    segment_chunks: int | None = None) -> bool:
    """Whether the chunk stage should own 128-wide V slices where ``choose_block_v`` picks 64: when long sequences
    are split into segments (context parallelism) and there are at least 16 value heads. That stage holds one
    512-thread CTA per SM, so the segments already fill the GPU and a wider slice halves the per-chunk work repeated
    per slice (Q K^T, K S on the whole key dim, the gates). Measured on the H200 (the same kernels forced to 128):
    16/32 32768x1 1.90 -> 1.49 ms, 16/32 8192x1 0.95 -> 0.53 ms, 16/16 32768x1 1.13 -> 0.97 ms; with 8 heads 64
    stays faster (2/8 32768x1: 0.69 vs 0.89 ms), and unsplit short sequences keep 64 (16/16 2048x1: 0.20 vs 0.24 ms).

    Args:
        bdv: ``choose_block_v``'s width. seq_chunks: chunks per sequence. Hv, K, V: heads and dims. num_sms: SMs.
        segment_chunks: the caller's segment length (0 = no split), None for the plan's choice.
    """
    # K = 128 only: the segment maps give each CTA K // bDV rows of the map, so a 128-wide slice of a K = 64 head
    # would leave the map unwritten, and K = 256 keeps 32-wide slices for registers
    if bdv != 64 or V < 128 or K != 128 or Hv < 16:
        return False
    if segment_chunks is None:
        segment_chunks = choose_segment_chunks(seq_chunks, Hv, V // 128, num_sms)
    return bool(segment_chunks) and max(seq_chunks, default=0) > segment_chunks


def block_dv(seq_chunks: list[int], Hv: int, K: int, V: int, num_sms: int, segment_chunks: int | None = None) -> int:
    """Width of the V slice one CTA owns: ``choose_block_v``'s, widened to 128 where ``wide_slices_pay``.

    Args:
        seq_chunks: chunks per sequence (N = its length). Hv, K, V: heads and dims. num_sms: SMs on the device.
        segment_chunks: as for :func:`make_plan` (None: the plan's choice).
    """
    bdv = choose_block_v(len(seq_chunks), Hv, K, V, num_sms)
    if wide_slices_pay(bdv, seq_chunks, Hv, K, V, num_sms, segment_chunks):
        return 128
    return bdv


@functools.lru_cache(maxsize=64)
def _tables(cu: tuple[int, ...], L: int, has_init: bool):
    chunks, segs, maps, seqs, seg_chunk0 = [], [], [], [], []
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        chunk0 = len(chunks)
        chunks += [(s, min(s + CHUNK, eos)) for s in range(bos, eos, CHUNK)]
        step = L * CHUNK if L else max(eos - bos, 1)
        starts = list(range(bos, eos, step)) or [bos]
        first, first_map = len(segs), len(maps)
        for i, s in enumerate(starts):
            e = min(s + step, eos)
            last = i == len(starts) - 1
            init = len(segs) if L else (n if has_init else -1)
            segs.append((s, e, init, n if last else -1))
            seg_chunk0.append((chunk0 + (s - bos) // CHUNK,))
            if not last:
                maps.append((s, e))
        seqs.append((first, len(starts), first_map))
    return chunks, segs, maps, seqs, seg_chunk0


@functools.lru_cache(maxsize=16)
def chunk_counts(cu: tuple[int, ...]) -> tuple[int, ...]:
    """Chunks of every sequence packed with offsets ``cu`` [N+1] (a partial chunk counts as one). Cached: the
    launchers ask once a call, and every layer of a model passes the same offsets."""
    return tuple(-(-(e - s) // CHUNK) for s, e in zip(cu, cu[1:]))


def make_plan(cu_seqlens, Hv: int, nV: int, has_init: bool, device: torch.device,
              segment_chunks: int | None = None) -> Plan:
    """Build (or fetch) the plan for packed sequences with offsets ``cu_seqlens`` [N+1].

    ``segment_chunks``: None picks by :func:`choose_segment_chunks`; 0 never splits; L > 0 forces L-chunk segments.
    """
    if segment_chunks is None:
        segment_chunks = choose_segment_chunks(chunk_counts(tuple(cu_seqlens)), Hv, nV, num_sms(device))
    return _device_plan(tuple(cu_seqlens), segment_chunks, has_init, device)


@functools.lru_cache(maxsize=64)
def forward_plan(cu: tuple[int, ...], Hv: int, K: int, V: int, has_init: bool, device: torch.device,
                 segment_chunks: int | None = None, block_v: int | None = None) -> tuple[int, Plan, int]:
    """The forward launcher's whole plan for offsets ``cu``: (the V slice a CTA owns, the :class:`Plan`, the chunk
    count). Cached: every layer of a model passes the same offsets, and with many short sequences packed, working
    them out again (three passes over the sequences in Python) would cost more host time than the kernels run.

    Args:
        cu: offsets [N+1] as a tuple. Hv, K, V: value heads and the kernel head dims. has_init: an initial state is
            given. device: where the tables go. segment_chunks, block_v: as ``forward.chunk_gated_delta_rule_fwd``.
    """
    seq_chunks = chunk_counts(cu)
    bdv = block_dv(seq_chunks, Hv, K, V, num_sms(device), segment_chunks)
    if block_v and K <= 128:
        bdv = min(V, block_v)
    return bdv, make_plan(cu, Hv, V // bdv, has_init, device, segment_chunks), sum(seq_chunks)


@functools.lru_cache(maxsize=64)
def _device_plan(cu: tuple[int, ...], L: int, has_init: bool, device: torch.device) -> Plan:
    parts = [[x for row in t for x in row] for t in _tables(cu, L, has_init)]
    # one host-to-device copy for all tables
    buf = torch.tensor([x for p in parts for x in p], dtype=torch.int32).to(device, non_blocking=True)
    views, at = [], 0
    for p, width in zip(parts, (2, 4, 2, 3, 1)):
        views.append(buf[at:at + len(p)].view(-1, width))
        at += len(p)
    cp = bool(L)
    return Plan(chunks=views[0], segs=views[1], maps=views[2] if cp else None, seqs=views[3] if cp else None,
                segment_chunks=L, seg_chunk0=views[4].view(-1))


# The backward's dh walk: sequences are split only while their walks would keep fewer than 1 / BWD_SPLIT_BELOW of
# the SMs busy, into segments that aim at BWD_CTAS_PER_SM walks a SM (a walk's CTA takes a whole SM), no shorter
# than BWD_MIN_SEGMENT_CHUNKS. A split costs the maps, a second dh walk and the reverse scan: on an H100 at 16/32
# 32768x1 (64 walks, half the SMs) the unsplit walks took 1.68 ms against 1.82 with 128-chunk segments and 1.91
# with 64-chunk ones.
BWD_SPLIT_BELOW = 4
BWD_CTAS_PER_SM = 1
BWD_MIN_SEGMENT_CHUNKS = 16


# The backward's fused walk (one CTA per walk with all of V, 18 us a chunk step on an H100) against the dh, dqkwg and
# WY stages (chunk-parallel, per key head): the walk wins while the sequences' walks need a split of at most a few
# segments each. Through the public op on an H100 (fwd + bwd, ms, stages / walk, two runs): 16/32 32768x1
# 4.99 / 4.51 and 4.99 / 4.45, 16/32 4096x8 4.55 / 3.95 and 4.54 / 3.92, but 4/8 32768x1 1.43 / 1.74 (8 walks cut
# into 16 segments each: the segments' first dh pass and scan, then 32 steps a segment, against chunk-parallel
# stages over 4 key heads). 16/32 8192x1 (the same 32 walks, a quarter as long) is a tie: 1.77 / 1.48, then
# 1.35 / 1.65.
WALK_MIN_WALKS_PER_SM = 1 / 8


def walk_pays(seq_chunks: list[int], Hv: int, num_sms: int) -> bool:
    """Whether the backward's fused walk is the faster path: (sequences x value heads) walks before any split fill
    at least ``WALK_MIN_WALKS_PER_SM`` of the SMs (``num_sms`` 0, no GPU: always)."""
    return len(seq_chunks) * Hv >= WALK_MIN_WALKS_PER_SM * num_sms


@dataclass(frozen=True)
class BwdPlan:
    """The backward's tables (int32 on the device, ``first`` int64).

    chunks [NC, 2]: (start, end) of every chunk. walks [S, 3]: (start, end, first chunk) of every walk of the dh
    stage: each sequence, or each segment under context parallelism. segment_chunks: 0 when sequences are not
    split. With a split only: maps [S, 2] every segment's token range (``segment_states``); rest [S - N, 3] the
    walks of every segment but each sequence's first (the start-gradient pass); rscan [N, 3] (first segment,
    segments, row in rest of its second segment) for ``state_scan_bwd``; first [N] each sequence's first segment.
    """

    chunks: torch.Tensor
    walks: torch.Tensor
    segment_chunks: int
    maps: torch.Tensor | None = None
    rest: torch.Tensor | None = None
    rscan: torch.Tensor | None = None
    first: torch.Tensor | None = None


def choose_bwd_segment_chunks(seq_chunks: list[int], Hv: int, nV: int, num_sms: int) -> int:
    """The backward's segment length in chunks (a power of two >= BWD_MIN_SEGMENT_CHUNKS), or 0 to keep every
    sequence whole: split only while the walks (sequences x Hv x V slices) would fill at most 1 / BWD_SPLIT_BELOW
    of the SMs, then into segments for about BWD_CTAS_PER_SM walks a SM.

    Args:
        seq_chunks: chunks per sequence. Hv: value heads. nV: V slices per head of the sequential stages.
        num_sms: SMs on the device.
    """
    units = len(seq_chunks) * Hv * nV
    if not seq_chunks or units * BWD_SPLIT_BELOW > num_sms:
        return 0
    return _segment_length(max(seq_chunks), units, BWD_CTAS_PER_SM * num_sms, BWD_MIN_SEGMENT_CHUNKS)


@functools.lru_cache(maxsize=64)
def make_bwd_plan(cu: tuple[int, ...], segment_chunks: int, device: torch.device) -> BwdPlan:
    """The backward's tables for packed sequences with offsets ``cu`` [N+1], split into ``segment_chunks``-chunk
    segments (0: whole sequences). One host-to-device copy, cached."""
    chunks, walks, rest, rscan = [], [], [], []
    step = segment_chunks * CHUNK
    for s, e in zip(cu, cu[1:]):
        starts = list(range(s, e, step)) if step else [s]
        starts = starts or [s]
        rscan.append((len(walks), len(starts), len(rest)))
        for i, a in enumerate(starts):
            b = min(a + step, e) if step else e
            walks.append((a, b, len(chunks)))
            if i:
                rest.append(walks[-1])
            chunks += [(c, min(c + CHUNK, b)) for c in range(a, b, CHUNK)]
    tables = [chunks, walks]
    if step:
        tables += [[w[:2] for w in walks], rest, rscan]
    parts = [[x for row in t for x in row] for t in tables]
    buf = torch.tensor([x for p in parts for x in p], dtype=torch.int32).to(device, non_blocking=True)
    views, at = [], 0
    for p, width in zip(parts, (2, 3, 2, 3, 3)):
        views.append(buf[at:at + len(p)].view(-1, width))
        at += len(p)
    if not step:
        return BwdPlan(chunks=views[0], walks=views[1], segment_chunks=0)
    return BwdPlan(chunks=views[0], walks=views[1], segment_chunks=segment_chunks, maps=views[2], rest=views[3],
                   rscan=views[4], first=views[4][:, 0].long())


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count
