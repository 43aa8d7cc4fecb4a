"""CPU CI for the Hopper kernels: every stage lowers and compiles for sm_90a with the local nvcc (no GPU needed),
and the host-side plan (chunk/segment tables, when to split sequences) is right.

Compiling is the slow part (seconds per kernel); the default run builds the Qwen3.5 head layout (K = V = 128, bf16)
of every stage, ``-m slow`` adds head dims 64/256, fp16 and the remaining flags. TileLang's disk cache
(~/.tilelang/cache) makes re-runs fast.
"""
from __future__ import annotations

import shutil
import sys

import pytest

from flashqla_kernels.gated_delta_rule.hopper import plan

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not __import__("os").path.exists(
    "/usr/local/cuda/bin/nvcc"), reason="needs nvcc to compile for sm_90a")

# (stage, builder args); builders: prep(Hk, Hv, K, dtype), fused(Hk, Hv, K, V, bDV, dtype, scale, store_final),
# segment(Hk, Hv, K, V, bDV, dtype), scan(Hv, K, V, has_h0)
CORE = [
    ("prep", (16, 32, 128, "bfloat16")),
    ("fused", (16, 32, 128, 128, 128, "bfloat16", 128 ** -0.5, True)),
    ("segment", (16, 32, 128, 128, 128, "bfloat16")),
    ("scan", (32, 128, 128, True)),
]
EXTRA = [
    ("prep", (2, 4, 64, "float16")),
    ("prep", (2, 2, 256, "bfloat16")),
    ("fused", (16, 32, 128, 128, 64, "float16", 0.5, False)),
    ("fused", (2, 4, 64, 64, 64, "bfloat16", 0.125, True)),
    ("fused", (2, 2, 256, 256, 32, "bfloat16", 256 ** -0.5, True)),
    ("segment", (2, 4, 64, 64, 64, "float16")),
    ("segment", (2, 2, 256, 256, 32, "bfloat16")),
    ("scan", (32, 128, 128, False)),
    ("scan", (4, 64, 64, True)),
    ("scan", (2, 256, 256, True)),
]


def _builder(stage):
    from flashqla_kernels.gated_delta_rule.hopper import fused_fwd, prep, segment_states, state_scan

    return {"prep": prep.build_prep, "fused": fused_fwd.build_fused_fwd,
            "segment": segment_states.build_segment_states, "scan": state_scan.build_state_scan}[stage]


def _compile_and_check(stage, args):
    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.hopper import _common

    kernel = _common.compile_kernel(_builder(stage), *args)
    src = kernel.get_kernel_source()
    assert "__global__" in src
    # the recurrent stages run on Hopper's warpgroup MMA; prep's one small K K^T (64 threads) on mma.sync
    want = "mma_sync" if stage == "prep" else "wgmma"
    assert want in src, f"{stage}{args}: no {want} tensor-core GEMM in the generated CUDA"
    return src


@needs_nvcc
@pytest.mark.parametrize("stage,args", CORE, ids=[f"{s}-{a}" for s, a in CORE])
def test_stage_compiles_for_sm90a(stage, args):
    _compile_and_check(stage, args)


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("stage,args", EXTRA, ids=[f"{s}-{a}" for s, a in EXTRA])
def test_other_specialisations_compile_for_sm90a(stage, args):
    _compile_and_check(stage, args)


def test_importing_hopper_does_not_import_tilelang():
    import subprocess

    code = ("import sys, flashqla_kernels.gated_delta_rule.hopper as h; "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'; print(h.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "chunk_gated_delta_rule_fwd" in out.stdout and "unsupported_reason" in out.stdout


def test_plan_tables_for_ragged_varlen():
    chunks, segs, maps, seqs, map_chunks = plan._tables((0, 1, 48, 200), 0, True)
    assert chunks == [(0, 1), (1, 48), (48, 112), (112, 176), (176, 200)]
    # unsplit: one segment per sequence, starting from its own initial state, writing its own final state
    assert segs == [(0, 1, 0, 0), (1, 48, 1, 1), (48, 200, 2, 2)]
    assert maps == []
    _, segs0, _, _, _ = plan._tables((0, 5), 0, False)
    assert segs0 == [(0, 5, -1, 0)]


def test_plan_tables_with_context_parallel_segments():
    chunks, segs, maps, seqs, map_chunks = plan._tables((0, 300, 301), 2, True)
    assert len(chunks) == 6
    # 300 tokens in 128-token segments: three segments, only the last writes the final state; every segment
    # starts from the scan's row with its own index
    assert segs == [(0, 128, 0, -1), (128, 256, 1, -1), (256, 300, 2, 0), (300, 301, 3, 1)]
    assert maps == [(0, 128), (128, 256)]
    assert map_chunks == [(0, 2), (2, 4)]
    assert seqs == [(0, 3, 0), (3, 1, 2)]


def test_warmup_starts_match_brute_force():
    """Where a map's H may start (decay below -40 after that chunk) and where M is needed (-1), per head."""
    import torch

    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.hopper.segment_states import warmup_starts

    cu = [0, 700, 705, 2000]
    pl = plan.make_plan(cu, 3, 1, True, torch.device("cpu"), 2)
    # head 0: g = 0 (M always needed), head 1: mild decay, head 2: strong decay
    g = -torch.rand(cu[-1], 3) * torch.tensor([0.0, 0.3, 3.0])
    gamma = torch.zeros_like(g)
    for s, e in pl.chunks.tolist():
        gamma[s:e] = g[s:e].cumsum(0)
    starts = warmup_starts(gamma, pl)
    for r, (s, e) in enumerate(pl.maps.tolist()):
        for h in range(3):
            want = max((c for c in range(s, e, 64) if g[c:e, h].sum() < -40), default=-1)
            assert starts[r, h].item() == want
    assert (starts[:, 0] == -1).all() and (starts[:, 2] > 0).any()


def _kernel_starts(gamma, maps, threads):
    """The cpk kernel's start search, step by step: per map and head, the chunk totals staged ``threads`` at a time
    from the map's end, thread 0 adding them in order (fp32) until the sum drops below the threshold."""
    import torch

    from flashqla_kernels.gated_delta_rule.hopper.segment_states import NEGLIGIBLE_LOG_DECAY

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
                        if acc < NEGLIGIBLE_LOG_DECAY:
                            found = nch - 1 - (blk * threads + t)
            out[r, h] = -1 if found < 0 else m0 + found * 64
    return out


@pytest.mark.parametrize("threads", [256, 3])
def test_in_kernel_starts_equal_warmup_starts(threads):
    """cpk computes ``warmup_starts``' table inside the map kernel; its schedule (blocks of THREADS from the map's
    end, a running fp32 sum) gives the same table, also when a map has more chunks than threads."""
    import torch

    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.hopper.segment_states import warmup_starts

    cu = [0, 1300, 1305, 4000]
    pl = plan.make_plan(cu, 4, 1, True, torch.device("cpu"), 8)
    g = -torch.rand(cu[-1], 4, dtype=torch.float64) * torch.tensor([0.0, 0.1, 0.6, 3.0], dtype=torch.float64)
    gamma = torch.zeros_like(g)
    for s, e in pl.chunks.tolist():
        gamma[s:e] = g[s:e].cumsum(0)
    gamma = gamma.float()
    want = warmup_starts(gamma, pl)
    assert (want[:, 0] == -1).all() and (want[:, 3] > 0).all() and (want[:, 1] == -1).any()
    assert torch.equal(_kernel_starts(gamma, pl.maps.tolist(), threads), want)


@needs_nvcc
def test_in_kernel_starts_compile_and_fence_the_shared_buffers():
    """The cpk map kernel compiles; the planner lays later tiles over its scan buffers, so a barrier separates the
    last read of the result from the first tile write."""
    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.hopper import _common, segment_states

    src = _common.compile_kernel(segment_states.build_segment_states, 16, 32, 128, 128, 64, "bfloat16", True,
                                 True).get_kernel_source()
    tail = src[src.index("skip = "):]
    assert "__syncthreads();" in tail[:tail.index("cp_async")], "no barrier between reading the start and the tiles"


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


def test_warp_specialised_stage_takes_wide_slices_where_sequences_are_split(monkeypatch):
    """plan.wide_slices_pay: 128-wide V slices for the ws stage where the plan splits long sequences and Hv >= 16
    (the H200 rows where forcing 128 won); 64 stays for 8 heads, for unsplit sequences and for an explicit
    segment_chunks=0; the base launcher keeps choose_block_v's width."""
    import torch

    from flashqla_kernels.gated_delta_rule.hopper import forward

    monkeypatch.delenv("FLASHQLA_KERNELS_SEGMENT_CHUNKS", raising=False)
    monkeypatch.delenv("FLASHQLA_KERNELS_BLOCK_V", raising=False)
    pay = plan.wide_slices_pay
    assert pay(64, [512], 32, 128, 128, 132) and pay(64, [128], 32, 128, 128, 132) and pay(64, [512], 16, 128, 128, 132)
    assert not pay(64, [512], 8, 128, 128, 132)          # 2/8 32768x1: 64 was faster
    assert not pay(64, [32], 16, 128, 128, 132)          # 16/16 2048x1: not split
    assert not pay(64, [512], 32, 128, 128, 132, segment_chunks=0)
    assert not pay(128, [512], 32, 128, 128, 132) and not pay(32, [512], 32, 256, 256, 132)
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert forward.block_dv(1, 32, 128, 128, cpu, seq_chunks=[512], wide_cp=True) == 128
    assert forward.block_dv(1, 32, 128, 128, cpu, seq_chunks=[512]) == 64
    monkeypatch.setenv("FLASHQLA_KERNELS_BLOCK_V", "64")
    assert forward.block_dv(1, 32, 128, 128, cpu, seq_chunks=[512], wide_cp=True) == 64


def test_block_width_follows_parallelism():
    assert plan.choose_block_v(1, 16, 128, 128, 132) == 64      # 16 heads, one sequence: more, narrower CTAs
    assert plan.choose_block_v(8, 16, 128, 128, 132) == 128
    assert plan.choose_block_v(1, 64, 256, 256, 132) == 32      # K = 256: state and tiles must fit
    assert plan.choose_block_v(4, 32, 64, 64, 132) == 64


def _mirror_forward(q, k, v, g, beta, h0, cu, L):
    """The Hopper schedule in float64 torch: plan tables, gate-free A0, segment maps with the decay shortcut,
    the state scan, then the fused walk per segment — the kernels' algebra stage by stage (one head, K x V state)."""
    import torch

    from flashqla_kernels.gated_delta_rule.hopper.segment_states import warmup_starts

    T, Hv, K = k.shape
    V = v.shape[-1]
    pl = plan.make_plan(cu, Hv, 1, True, torch.device("cpu"), L)
    gamma = torch.zeros_like(g)
    a0 = torch.zeros(T, Hv, 64, dtype=g.dtype)
    for s, e in pl.chunks.tolist():
        gamma[s:e] = g[s:e].cumsum(0)
        kk = torch.einsum("ihk,jhk->hij", k[s:e], k[s:e]) * beta[s:e].T[:, :, None]
        eye = torch.eye(e - s, dtype=g.dtype).expand(Hv, -1, -1)
        inv = torch.linalg.solve_triangular(eye + kk.tril(-1), eye, upper=False, unitriangular=True)
        a0[s:e, :, :e - s] = inv.transpose(0, 1)

    def walk(S, s, e, h, with_v=True, out=None):
        for cs in range(s, e, 64):
            ce = min(cs + 64, e)
            gm, kc = gamma[cs:ce, h], k[cs:ce, h]
            dec = torch.exp(gm[:, None] - gm[None, :]).tril()
            ag = dec * a0[cs:ce, h, :ce - cs] * beta[cs:ce, h][None, :]
            w = (v[cs:ce, h] if with_v else 0) - torch.exp(gm)[:, None] * (kc @ S)
            vd = ag @ w
            if out is not None:
                qc = q[cs:ce, h]
                out[cs:ce, h] = K ** -0.5 * (torch.exp(gm)[:, None] * (qc @ S) + (dec * (qc @ kc.T)) @ vd)
            S = torch.exp(gm[-1]) * S + kc.T @ (torch.exp(gm[-1] - gm)[:, None] * vd)
        return S

    o = torch.zeros(T, Hv, V, dtype=g.dtype)
    ht = torch.zeros(len(cu) - 1, Hv, K, V, dtype=g.dtype)
    segs = pl.segs.tolist()
    starts = warmup_starts(gamma.float(), pl) if L else None
    for n, (first, count, first_map) in enumerate(pl.seqs.tolist() if L else [(i, 1, 0) for i in range(len(segs))]):
        for h in range(Hv):
            S = h0[n, h]
            for i in range(count):
                s, e, _, fin = segs[first + i]
                if i < count - 1:  # the scan: S_next = M S + H from the segment's map
                    r, st = first_map + i, int(starts[first_map + i, h])
                    H = walk(torch.zeros(K, V, dtype=g.dtype), s if st < 0 else st, e, h)
                    M = walk(torch.eye(K, dtype=g.dtype), s, e, h, with_v=False) if st < 0 else 0
                    walk(S, s, e, h, out=o)
                    S = M @ S + H if st < 0 else H
                else:
                    ht[fin, h] = walk(S, s, e, h, out=o)
    return o, ht


@pytest.mark.parametrize("L", [0, 1, 3])
def test_schedule_is_exact_in_float64(L):
    """The kernels' decomposition (gate-free A0, exact segment maps with the exp(-40) shortcut, scan, fused walk)
    equals the float64 reference to 1e-9 on ragged varlen with g = 0, mild and very strong decay heads."""
    import torch

    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    gen = torch.Generator().manual_seed(0)
    lens = [1, 47, 300, 64, 450]
    cu = [0, *__import__("itertools").accumulate(lens)]
    T, Hv, K, V = cu[-1], 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(T, Hv, K, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, Hv, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(T, Hv, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(T, Hv, generator=gen, dtype=torch.float64) * torch.tensor([0.0, 0.1, 8.0], dtype=torch.float64)
    beta = torch.rand(T, Hv, generator=gen, dtype=torch.float64)
    h0 = torch.randn(len(lens), Hv, K, V, generator=gen, dtype=torch.float64)
    o, ht = _mirror_forward(q, k, v, g, beta, h0, cu, L)
    ro, rht = chunk_gated_delta_rule_ref(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
                                         output_final_state=True, cu_seqlens=torch.tensor(cu))
    assert ((o - ro[0]).norm() / ro.norm()).item() < 1e-9
    assert ((ht - rht).norm() / rht.norm()).item() < 1e-9
