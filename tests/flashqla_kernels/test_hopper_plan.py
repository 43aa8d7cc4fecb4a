"""The Hopper launcher's host-side plan (``hopper/plan.py``): chunk and segment tables for ragged varlen,
when sequences are split into segments, the V slice per CTA, GVA slices, and the start tables the segment
kernels search (against brute force and the in-kernel search in emulation)."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.gated_delta_rule.hopper import plan


def test_plan_tables_for_ragged_varlen():
    chunks, segs, maps, seqs, chunk0 = plan._tables((0, 1, 48, 200), 0, True)
    assert chunks == [(0, 1), (1, 48), (48, 112), (112, 176), (176, 200)]
    # unsplit: one segment per sequence, starting from its own initial state, writing its own final state
    assert segs == [(0, 1, 0, 0), (1, 48, 1, 1), (48, 200, 2, 2)]
    assert maps == []
    # each segment's first row of the chunk table
    assert chunk0 == [(0,), (1,), (2,)]
    _, segs0, _, _, _ = plan._tables((0, 5), 0, False)
    assert segs0 == [(0, 5, -1, 0)]


def test_plan_tables_with_context_parallel_segments():
    chunks, segs, maps, seqs, chunk0 = plan._tables((0, 300, 301), 2, True)
    assert len(chunks) == 6
    # 300 tokens in 128-token segments: three segments, only the last writes the final state; every segment
    # starts from the scan's row with its own index
    assert segs == [(0, 128, 0, -1), (128, 256, 1, -1), (256, 300, 2, 0), (300, 301, 3, 1)]
    assert chunk0 == [(0,), (2,), (4,), (5,)] and all(chunks[c][0] == seg[0] for (c,), seg in zip(chunk0, segs))
    assert maps == [(0, 128), (128, 256)]
    assert seqs == [(0, 3, 0), (3, 1, 2)]


def test_plan_splits_only_when_sms_would_idle():
    # many sequences x heads fill 132 SMs: no split
    assert plan.choose_segment_chunks([64] * 16, 32, 1, 132) == 0
    assert plan.choose_segment_chunks([128] * 4, 32, 1, 132) == 0
    # one 32K-token sequence (512 chunks): one CTA per SM -> 32 heads 128-chunk segments (128 CTAs), 16 heads 64,
    # 8 heads 32; 64 heads 256 (2 segments)
    assert plan.choose_segment_chunks([512], 32, 1, 132) == 128
    assert plan.choose_segment_chunks([512], 16, 1, 132) == 64
    assert plan.choose_segment_chunks([512], 8, 1, 132) == 32
    assert plan.choose_segment_chunks([512], 64, 1, 132) == 256
    assert plan.choose_segment_chunks([512], 8, 2, 132) == 64  # 2/8: two 64-wide V slices per head
    assert plan.choose_segment_chunks([128], 32, 1, 132) == 32  # 16/32 8192x1
    # short sequences are never split below 32 chunks
    assert plan.choose_segment_chunks([32], 16, 1, 132) == 0
    assert plan.choose_segment_chunks([2, 3], 2, 1, 132) == 0


def test_block_width_follows_parallelism():
    assert plan.choose_block_v(1, 16, 128, 128, 132) == 64      # 16 heads, one sequence: more, narrower CTAs
    assert plan.choose_block_v(8, 16, 128, 128, 132) == 128
    assert plan.choose_block_v(1, 64, 256, 256, 132) == 32      # K = 256: state and tiles must fit
    assert plan.choose_block_v(4, 32, 64, 64, 132) == 64


def test_slices_widen_to_128_where_sequences_are_split():
    """plan.wide_slices_pay: 128-wide V slices where the plan splits long sequences and Hv >= 16 (the H200 rows where
    forcing 128 won); 64 stays for 8 heads, for unsplit sequences and for an explicit segment_chunks=0."""
    pay = plan.wide_slices_pay
    assert pay(64, [512], 32, 128, 128, 132) and pay(64, [128], 32, 128, 128, 132) and pay(64, [512], 16, 128, 128, 132)
    assert not pay(64, [512], 8, 128, 128, 132)          # 2/8 32768x1: 64 was faster
    assert not pay(64, [32], 16, 128, 128, 132)          # 16/16 2048x1: not split
    assert not pay(64, [512], 32, 128, 128, 132, segment_chunks=0)
    assert not pay(128, [512], 32, 128, 128, 132) and not pay(32, [512], 32, 256, 256, 132)
    assert plan.block_dv([512], 32, 128, 128, 132) == 128
    assert plan.block_dv([512], 32, 128, 128, 132, segment_chunks=0) == 64
    assert plan.block_dv([32], 16, 128, 128, 132) == 64 and plan.block_dv([512], 32, 256, 256, 132) == 32


@pytest.mark.parametrize("cu,Hv,segment_chunks,block_v", [
    ((0, 8192), 32, None, None), ((0, 8192, 16384), 32, None, None), ((0, 2048), 16, None, None),
    (tuple(range(0, 16 * 1001, 16)), 16, None, None), ((0, 8192), 32, 0, None), ((0, 8192), 32, 16, 64)])
def test_forward_plan_is_the_composition_of_the_rules(cu, Hv, segment_chunks, block_v, monkeypatch):
    """The launcher's one cached call gives what block_dv, make_plan and the chunk count give separately."""
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    bdv, pl, num_chunks = plan.forward_plan(cu, Hv, 128, 128, True, dev, segment_chunks, block_v)
    seq_chunks = plan.chunk_counts(cu)
    want_bdv = block_v or plan.block_dv(list(seq_chunks), Hv, 128, 128, 132, segment_chunks)
    want = plan.make_plan(list(cu), Hv, 128 // want_bdv, True, dev, segment_chunks)
    assert bdv == want_bdv and num_chunks == sum(seq_chunks) == pl.chunks.shape[0]
    assert pl.segment_chunks == want.segment_chunks and torch.equal(pl.segs, want.segs)
    assert plan.forward_plan(cu, Hv, 128, 128, True, dev, segment_chunks, block_v)[1] is pl


def test_gva_groups_split_into_slices_of_1_2_or_4_heads():
    assert [plan.heads_per_cta(g) for g in (1, 2, 3, 4, 6, 8, 12)] == [1, 2, 3, 4, 3, 4, 4]


def _table_starts(gamma, pl):
    """Where each map's H walk starts, from the chunk totals in float64: [R, Hv] int32, per map and head the first
    token of the last chunk after which the map's decay sum drops below NEGLIGIBLE_LOG_DECAY, or -1 when it never
    does (then M is needed and H walks everything). The rule segment_states applies in its kernel, as a table."""
    chunks = pl.chunks.long()
    out = torch.full((pl.maps.shape[0], gamma.shape[1]), -1, dtype=torch.int32)
    chunk_total = gamma.index_select(0, chunks[:, 1] - 1).double()  # [NC, Hv]
    for r, (s, e) in enumerate(pl.maps.tolist()):
        inside = ((chunks[:, 0] >= s) & (chunks[:, 0] < e)).nonzero().flatten()
        suffix = chunk_total[inside].flip(0).cumsum(0).flip(0)  # [n, Hv]: decay from each chunk to the map's end
        for h in range(gamma.shape[1]):
            below = (suffix[:, h] < -20.0).nonzero().flatten()
            if below.numel():
                out[r, h] = chunks[inside[below.max()], 0]
    return out


def test_start_table_matches_brute_force():
    """Where a map's H may start (decay below -20 after that chunk) and where M is needed (-1), per head."""
    cu = [0, 700, 705, 2000]
    pl = plan.make_plan(cu, 3, 1, True, torch.device("cpu"), 2)
    # head 0: g = 0 (M always needed), head 1: mild decay, head 2: strong decay
    g = -torch.rand(cu[-1], 3) * torch.tensor([0.0, 0.3, 3.0])
    gamma = torch.zeros_like(g)
    for s, e in pl.chunks.tolist():
        gamma[s:e] = g[s:e].cumsum(0)
    starts = _table_starts(gamma, pl)
    for r, (s, e) in enumerate(pl.maps.tolist()):
        for h in range(3):
            want = max((c for c in range(s, e, 64) if g[c:e, h].sum() < -20), default=-1)
            assert starts[r, h].item() == want
    assert (starts[:, 0] == -1).all() and (starts[:, 2] > 0).any()


def _kernel_starts(gamma, maps, threads):
    """segment_states' start search, step by step: per map and head, the chunk totals staged ``threads`` at a time
    from the map's end, thread 0 adding them in order (fp32) until the sum drops below the threshold."""
    out = torch.full((len(maps), gamma.shape[1]), -1, dtype=torch.int32)
    for r, (m0, s1) in enumerate(maps):
        nch = -(-(s1 - m0) // 64)
        for h in range(gamma.shape[1]):
            acc, found = torch.tensor(0.0, dtype=torch.float32), -1
            for blk in range(-(-nch // threads)):
                tot = [gamma[min(m0 + (ci + 1) * 64, s1) - 1, h] if ci >= 0 else 0.0
                       for ci in (nch - 1 - (blk * threads + tx) for tx in range(threads))]
                for t in range(threads):
                    if found < 0 and blk * threads + t < nch:
                        acc = acc + tot[t]
                        if acc < -20.0:
                            found = nch - 1 - (blk * threads + t)
            out[r, h] = -1 if found < 0 else m0 + found * 64
    return out


@pytest.mark.parametrize("threads", [256, 3])
def test_in_kernel_start_search_equals_the_start_table(threads):
    """segment_states finds each map's start inside the kernel; its schedule (blocks of THREADS from the map's end, a
    running fp32 sum) gives the same table, also when a map has more chunks than threads."""
    cu = [0, 1300, 1305, 4000]
    pl = plan.make_plan(cu, 4, 1, True, torch.device("cpu"), 8)
    g = -torch.rand(cu[-1], 4, dtype=torch.float64) * torch.tensor([0.0, 0.05, 0.6, 3.0], dtype=torch.float64)
    gamma = torch.zeros_like(g)
    for s, e in pl.chunks.tolist():
        gamma[s:e] = g[s:e].cumsum(0)
    gamma = gamma.float()
    want = _table_starts(gamma, pl)
    assert (want[:, 0] == -1).all() and (want[:, 3] > 0).all() and (want[:, 1] == -1).any()
    assert torch.equal(_kernel_starts(gamma, pl.maps.tolist(), threads), want)


def test_start_search_threshold_is_the_kernels():
    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.hopper import segment_states

    assert segment_states.NEGLIGIBLE_LOG_DECAY == -20.0 and segment_states.THREADS == 256


def test_wide_slices_only_where_the_segment_maps_cover_the_key_dim():
    from flashqla_kernels.gated_delta_rule.hopper import plan

    long_seq = [512]  # 32768 tokens: split into segments on 132 SMs
    assert plan.wide_slices_pay(64, long_seq, 32, 128, 128, 132)
    # K = 64 with 128-wide slices would launch K // bDV = 0 map blocks
    assert not plan.wide_slices_pay(64, long_seq, 32, 64, 128, 132)
    assert plan.block_dv(long_seq, 32, 64, 128, 132) == 64


def test_chunk_counts_count_partial_chunks_and_are_cached():
    cu = (0, 1, 65, 200, 200 + 64 * 3)
    assert plan.chunk_counts(cu) == (1, 1, 3, 3)
    # the launchers ask once a call with the offsets host_offsets keeps: the second call is a cache hit
    assert plan.chunk_counts(cu) is plan.chunk_counts(tuple(cu))
