"""CPU CI for the Hopper kernels (``gated_delta_rule/hopper/``): every stage lowers and compiles for sm_90a with the
local nvcc (no GPU needed) with the structure it is built for, the host-side plan (chunk/segment tables, V slices,
when to split sequences) is right, and the kernels' schedules are checked in float64 emulation.

Compiling is the slow part (seconds per kernel); the default run builds the Qwen3.5 head layout (K = V = 128, bf16)
of every stage, ``-m slow`` adds head dims 64/256, fp16, other GVA groups and the ptxas register report (no spills).
TileLang's disk cache (~/.tilelang/cache) makes re-runs fast.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashqla_kernels.gated_delta_rule.hopper import plan

REPO = Path(__file__).resolve().parents[2]

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc to compile for sm_90a")
S128 = 128 ** -0.5

# (stage, builder args); builders: kkt_solve(Hk, Hv, K, dtype), chunk_fwd(Hk, Hv, K, V, bDV, dtype, scale,
# store_final), segment_states(Hk, Hv, K, V, bDV, dtype), state_scan(Hv, K, V, has_h0)
CORE = [
    ("kkt_solve", (16, 32, 128, "bfloat16")),
    ("chunk_fwd", (16, 32, 128, 128, 128, "bfloat16", S128, True)),
    ("segment_states", (16, 32, 128, 128, 64, "bfloat16")),
    ("state_scan", (32, 128, 128, True)),
]
EXTRA = [
    ("kkt_solve", (2, 4, 64, "float16")),
    ("kkt_solve", (2, 2, 256, "bfloat16")),
    ("kkt_solve", (16, 64, 128, "bfloat16")),
    ("kkt_solve", (16, 16, 128, "bfloat16")),
    ("kkt_solve", (4, 16, 256, "float16")),
    ("kkt_solve", (2, 8, 64, "bfloat16")),
    ("chunk_fwd", (16, 32, 128, 128, 64, "float16", 0.5, False)),
    ("chunk_fwd", (2, 4, 64, 64, 64, "bfloat16", 0.125, True)),
    ("chunk_fwd", (2, 2, 256, 256, 32, "bfloat16", 256 ** -0.5, True)),
    ("chunk_fwd", (16, 16, 128, 128, 32, "bfloat16", S128, True)),
    ("segment_states", (2, 4, 64, 64, 64, "float16")),
    ("segment_states", (2, 2, 256, 256, 32, "bfloat16")),
    ("segment_states", (16, 32, 128, 128, 128, "bfloat16")),
    ("state_scan", (32, 128, 128, False)),
    ("state_scan", (4, 64, 64, True)),
    ("state_scan", (2, 256, 256, True)),
]


def _builder(stage):
    from flashqla_kernels.gated_delta_rule.hopper import chunk_fwd, kkt_solve, segment_states, state_scan

    return {"kkt_solve": kkt_solve.build_kkt_solve, "chunk_fwd": chunk_fwd.build_chunk_fwd,
            "segment_states": segment_states.build_segment_states, "state_scan": state_scan.build_state_scan}[stage]


def _source(stage, args) -> str:
    pytest.importorskip("tilelang")
    from flashqla_kernels import toolkit

    return toolkit.compile_kernel(_builder(stage), *args).get_kernel_source()


def _values_warpgroup(src: str) -> str:
    # chunk_fwd's values warpgroup: from its setmaxnreg to the output warpgroup's
    return src[src.index("warpgroup_reg_dealloc<120>"):src.index("warpgroup_reg_alloc<136>")]


def _check_chunk_fwd(args, src):
    # four warpgroup roles, registers moved to the state / output groups, mbarrier hand-offs, TMA loads
    for role in ("threadIdx.x) < 128", "threadIdx.x) < 256", "threadIdx.x) < 384"):
        assert role in src, f"chunk_fwd{args}: no warpgroup branch {role!r}"
    # setmaxnreg only moves away from the launch allocation (128 at 512 threads): .inc up, .dec down (an .inc to a
    # lower count is an illegal instruction)
    allocs = [int(n) for n in re.findall(r"warpgroup_reg_alloc<(\d+)>", src)]
    deallocs = [int(n) for n in re.findall(r"warpgroup_reg_dealloc<(\d+)>", src)]
    assert sorted(allocs) == [136, 160] and sorted(deallocs) == [88, 120] and sum(allocs + deallocs) <= 512
    assert "tma_load(" in src and "expect_transaction" in src
    assert ".wait(" in src and ".arrive()" in src
    # K S, Q K^T, Ag W, Q S, K^T Vn from shared memory; Pg Vd with Pg in registers
    assert src.count("tl::wgmma_ss<") == 5 and src.count("tl::wgmma_rs<") == 1
    # Ag arrives gated: no Ag loop, no Ag hand-off barrier
    assert "bar_ag" not in src and "ag_sh" not in src
    # Ag W and Pg Vd in fp16, the other GEMMs in the input dtype
    assert "wgmma_ss<tl::DataType::kFloat16" in src
    if args[5] == "bfloat16":
        assert "wgmma_ss<tl::DataType::kBFloat16" in src
    # W formed in the K S accumulator and stored by stmatrix: no warpgroup barrier inside the element loop
    values = _values_warpgroup(src)
    after_ks = values[values.index("tl::warpgroup_wait<0>();"):]
    loop = re.search(r"for \(int (i_\d+) = 0; \1 < \d+; \+\+\1\) \{(.*?)\n        \}", after_ks, re.S)
    assert loop and "eg_sh" in loop.group(2), "no W element loop after the K S GEMM"
    assert "__sync_thread_partial" not in loop.group(2) and "stmatrix" in values


def _check_structure(stage, args, src):
    assert "__global__" in src
    if stage == "chunk_fwd":
        _check_chunk_fwd(args, src)
    elif stage == "segment_states":
        # Ag W multiplies the loaded fp16 tile (an fp16 wgmma); no Ag tile is formed
        assert "wgmma_ss<tl::DataType::kFloat16" in src and "ag_sh" not in src
    elif stage == "state_scan":
        assert "wgmma" in src, "state_scan: its M S GEMM should run on warpgroup MMA"
    else:
        # K K^T and the four block-merge products: fp16 mma.sync with fp32 accumulators
        assert src.count("tl::mma_sync<tl::DataType::kFloat16, tl::DataType::kFloat16, tl::DataType::kFloat32") >= 4
        assert "ldmatrix" in src
        G = plan.heads_per_cta(args[1] // args[0])
        assert f"__launch_bounds__({64 * G}, {max(1, 8 // G)})" in src


@needs_nvcc
@pytest.mark.parametrize("stage,args", CORE, ids=[f"{s}-{a}" for s, a in CORE])
def test_stage_compiles_for_sm90a_with_its_structure(stage, args):
    _check_structure(stage, args, _source(stage, args))


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("stage,args", EXTRA, ids=[f"{s}-{a}" for s, a in EXTRA])
def test_other_specialisations_compile_for_sm90a_with_their_structure(stage, args):
    _check_structure(stage, args, _source(stage, args))


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("stage,args", CORE[:3] + [EXTRA[6]], ids=[f"{s}-{a}" for s, a in CORE[:3] + [EXTRA[6]]])
def test_kernels_do_not_spill(stage, args, tmp_path):
    """ptxas -v on the generated CUDA: the setmaxnreg budgets (chunk_fwd) and the occupancy bound (kkt_solve) cost no
    spills; the PTX carries the Hopper instructions themselves."""
    tilelang = pytest.importorskip("tilelang")
    src = tmp_path / "k.cu"
    src.write_text(_source(stage, args))
    root = os.path.dirname(tilelang.__file__)
    flags = ["-arch=sm_90a", "-std=c++17", "--use_fast_math", "-w", "-DENABLE_BF16", f"-I{root}/src",
             f"-I{root}/3rdparty/cutlass/include", str(src)]
    out = subprocess.run([NVCC, "-cubin", "-o", str(tmp_path / "k.cubin"), "-Xptxas", "-v", *flags],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert " 0 bytes spill stores" in out.stderr, out.stderr[-800:]
    ptx = tmp_path / "k.ptx"
    out = subprocess.run([NVCC, "-ptx", "-o", str(ptx), *flags], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    text = ptx.read_text()
    if stage == "chunk_fwd":
        assert "wgmma.mma_async" in text and "cp.async.bulk.tensor" in text and "mbarrier.try_wait" in text
        assert "setmaxnreg.inc.sync.aligned.u32 160" in text and "setmaxnreg.dec.sync.aligned.u32 88" in text
    else:
        assert "wgmma.mma_async" in text or "mma.sync" in text


def test_importing_hopper_does_not_import_tilelang():
    code = ("import sys, flashqla_kernels.gated_delta_rule.hopper as h; "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'; print(h.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "chunk_gated_delta_rule_fwd" in out.stdout and "unsupported_reason" in out.stdout


def test_plan_tables_for_ragged_varlen():
    chunks, segs, maps, seqs = plan._tables((0, 1, 48, 200), 0, True)
    assert chunks == [(0, 1), (1, 48), (48, 112), (112, 176), (176, 200)]
    # unsplit: one segment per sequence, starting from its own initial state, writing its own final state
    assert segs == [(0, 1, 0, 0), (1, 48, 1, 1), (48, 200, 2, 2)]
    assert maps == []
    _, segs0, _, _ = plan._tables((0, 5), 0, False)
    assert segs0 == [(0, 5, -1, 0)]


def test_plan_tables_with_context_parallel_segments():
    chunks, segs, maps, seqs = plan._tables((0, 300, 301), 2, True)
    assert len(chunks) == 6
    # 300 tokens in 128-token segments: three segments, only the last writes the final state; every segment
    # starts from the scan's row with its own index
    assert segs == [(0, 128, 0, -1), (128, 256, 1, -1), (256, 300, 2, 0), (300, 301, 3, 1)]
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
            below = (suffix[:, h] < -40.0).nonzero().flatten()
            if below.numel():
                out[r, h] = chunks[inside[below.max()], 0]
    return out


def test_start_table_matches_brute_force():
    """Where a map's H may start (decay below -40 after that chunk) and where M is needed (-1), per head."""
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
            want = max((c for c in range(s, e, 64) if g[c:e, h].sum() < -40), default=-1)
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
                        if acc < -40.0:
                            found = nch - 1 - (blk * threads + t)
            out[r, h] = -1 if found < 0 else m0 + found * 64
    return out


@pytest.mark.parametrize("threads", [256, 3])
def test_in_kernel_start_search_equals_the_start_table(threads):
    """segment_states finds each map's start inside the kernel; its schedule (blocks of THREADS from the map's end, a
    running fp32 sum) gives the same table, also when a map has more chunks than threads."""
    cu = [0, 1300, 1305, 4000]
    pl = plan.make_plan(cu, 4, 1, True, torch.device("cpu"), 8)
    g = -torch.rand(cu[-1], 4, dtype=torch.float64) * torch.tensor([0.0, 0.1, 0.6, 3.0], dtype=torch.float64)
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

    assert segment_states.NEGLIGIBLE_LOG_DECAY == -40.0 and segment_states.THREADS == 256


@needs_nvcc
def test_in_kernel_starts_fence_the_shared_buffers():
    """The planner lays later tiles over the start search's buffers, so a barrier separates the last read of the
    result from the first tile write."""
    src = _source("segment_states", (16, 32, 128, 128, 64, "bfloat16"))
    tail = src[src.index("skip = "):]
    assert "__syncthreads();" in tail[:tail.index("cp_async")], "no barrier between reading the start and the tiles"


def _mirror_forward(q, k, v, g, beta, h0, cu, L):
    """The Hopper schedule in float64 torch: plan tables, gate-free A0 (gated per chunk as kkt_solve writes Ag),
    segment maps with the decay shortcut, the state scan, then the chunk walk per segment: the kernels' algebra
    stage by stage (one head, K x V state)."""
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
    starts = _table_starts(gamma.float(), pl) if L else None
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
    """The kernels' decomposition (gated A, exact segment maps with the exp(-40) shortcut, scan, chunk walk)
    equals the float64 reference to 1e-9 on ragged varlen with g = 0, mild and very strong decay heads."""
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    gen = torch.Generator().manual_seed(0)
    lens = [1, 47, 300, 64, 450]
    cu = [0, *itertools.accumulate(lens)]
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


def _tc_inverse(S: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """kkt_solve's kernel tile by tile: the same tiles and zero fills, the same products and fp16 roundings (operand
    tiles and the written tile in fp16, products accumulated exactly), every tile starting as NaN. S [64, 64] strictly
    lower, beta / gamma [G, 64]; returns the written tile Ag [G, 64, 64]."""
    G, nan, f16 = beta.shape[0], float("nan"), (lambda t: t.to(torch.float16).to(torch.float64))

    def tile(*shape):
        return torch.full(shape, nan, dtype=torch.float64)

    def gate(val, r, c, h):
        return val * torch.exp(gamma[h, r] - gamma[h, c]) * beta[h, c]

    sd, sbd, sba = tile(64, 16), tile(32, 32), tile(32, 32)
    for i in range(64):
        sd[i] = S[i, i // 16 * 16:i // 16 * 16 + 16]
    sbd[:16, :16], sbd[16:, 16:] = f16(S[16:32, :16]), f16(S[48:, 32:48])
    sbd[:16, 16:] = sbd[16:, :16] = 0.0
    sba[:] = f16(S[32:, :32])
    xaa, xbb, d02, d13, out = tile(G, 32, 32), tile(G, 32, 32), tile(G, 32, 32), tile(G, 32, 32), tile(G, 64, 64)
    for t in (xaa, xbb):
        t[:, :16, 16:] = 0.0
    for t in (d02, d13):
        t[:, :16, 16:] = t[:, 16:, :16] = 0.0
    out[:, :32, 32:] = out[:, :16, 16:32] = out[:, 32:48, 48:] = 0.0
    for hl in range(G):  # 1: thread (hl, col) solves column c of block db
        for col in range(64):
            db, c, x = col // 16, col % 16, torch.zeros(16, dtype=torch.float64)
            for r in range(16):
                x[r] = 1.0 if r == c else -beta[hl, db * 16 + r] * (sd[db * 16 + r, :r] * x[:r]).sum()
            ro = db % 2 * 16
            for r in range(16):
                (xaa if db < 2 else xbb)[hl, ro + r, ro + c] = f16(x[r])
                (d02 if db % 2 == 0 else d13)[hl, db // 2 * 16 + r, db // 2 * 16 + c] = f16(x[r])
                out[hl, db * 16 + r, col] = f16(gate(x[r], db * 16 + r, col, hl)) if r >= c else 0.0
    rows2 = [16 + i + i // 16 * 16 for i in range(32)]  # tile row/column -> matrix row/column in step 2
    for h in range(G):  # 2
        t = f16(sbd @ d02[h] * beta[h, rows2][:, None])
        f = d13[h] @ t
        for i in range(32):
            for j in range(32):
                if i // 16 == j // 16:
                    if i < 16:
                        xaa[h, 16 + i, j] = f16(-f[i, j])
                    else:
                        xbb[h, i, j - 16] = f16(-f[i, j])
                    out[h, rows2[i], rows2[j] - 16] = f16(gate(-f[i, j], rows2[i], rows2[j] - 16, h))
    for h in range(G):  # 3
        t = f16(sba @ xaa[h] * beta[h, 32:, None])
        f = xbb[h] @ t
        for i in range(32):
            for j in range(32):
                out[h, 32 + i, j] = f16(gate(-f[i, j], 32 + i, j, h))
    return out


@pytest.mark.parametrize("n", [64, 47, 1])
def test_kkt_solve_schedule_writes_every_entry_and_equals_ag_to_fp16_accuracy(n):
    """kkt_solve's tiles and fp16 product operands: every entry of the written tile comes from a phase (no NaN), the
    upper triangle is exactly zero, and the tile equals the float64 Ag = Gamma * A0 * beta_col to fp16 accuracy, on
    keys correlated enough (shared direction) that the off-diagonal blocks matter."""
    gen = torch.Generator().manual_seed(n)
    k = torch.randn(64, 32, generator=gen, dtype=torch.float64) + 1.5 * torch.randn(1, 32, generator=gen,
                                                                                     dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1)
    k[n:] = 0
    beta = torch.rand(2, 64, generator=gen, dtype=torch.float64)
    beta[:, n:] = 0
    gamma = torch.cumsum(-torch.rand(2, 64, generator=gen, dtype=torch.float64) * 0.3, dim=1)
    S = (k @ k.T).tril(-1)
    out = _tc_inverse(S, beta, gamma)
    assert not out.isnan().any(), "read or left an entry no phase wrote"
    assert (out.triu(1) == 0).all()
    for h in range(2):
        want = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + beta[h, :, None] * S)
        want = (want * torch.exp(gamma[h, :, None] - gamma[h, None, :]) * beta[h, None, :]).tril()
        err = ((out[h] - want).norm() / want.norm()).item()
        assert err < 2e-3, err
        off = (out[h] - want)[32:, :32].abs().max().item()
        assert off < 4e-3 * max(1.0, want.abs().max().item()), off


def _torch_kkt_solve(k, g, beta, chunks, Hv):
    """kkt_solve's contract in float64 torch: gamma [T, Hv] chunk-local cumsum, Ag = Gamma * A0 * beta_col per chunk
    [T, Hv, 64] (zero above the diagonal and past a ragged chunk's end)."""
    group = Hv // k.shape[1]
    g, beta = g.double(), beta.double()
    gamma, ag = torch.zeros_like(g), torch.zeros(g.shape[0], Hv, 64, dtype=g.dtype)
    for s, e in chunks.tolist():
        kh = k[s:e].repeat_interleave(group, dim=1).double()
        gamma[s:e] = g[s:e].cumsum(0)
        eye = torch.eye(e - s, dtype=torch.float64).expand(Hv, -1, -1)
        kk = torch.einsum("ihk,jhk->hij", kh, kh) * beta[s:e].T[:, :, None]
        a0 = torch.linalg.solve_triangular(eye + kk.tril(-1), eye, upper=False, unitriangular=True).transpose(0, 1)
        gm = gamma[s:e]
        dec = torch.exp(gm[:, None, :] - gm[None, :, :]).permute(0, 2, 1)  # [row, Hv, col]
        mask = torch.ones(e - s, e - s, dtype=torch.bool).tril()[:, None, :]
        ag[s:e, :, :e - s] = torch.where(mask, a0 * dec * beta[s:e].T[None], 0.0)
    return gamma, ag


def _torch_chunk_fwd(q, k, v, ag, gamma, beta, h_init, segs, o, ht, *, scale, bDV):
    """chunk_fwd's contract in float64 torch: segments from h_init rows, o and ht written in place."""
    group = v.shape[1] // k.shape[1]
    for s0, s1, init, fin in segs.tolist():
        for h in range(v.shape[1]):
            S = h_init[init, h].double() if init >= 0 else torch.zeros_like(h_init[0, h]).double()
            for cs in range(s0, s1, 64):
                ce = min(cs + 64, s1)
                gm, kc, qc = gamma[cs:ce, h], k[cs:ce, h // group], q[cs:ce, h // group]
                dec = torch.exp(gm[:, None] - gm[None, :]).tril()
                vd = ag[cs:ce, h, :ce - cs] @ (v[cs:ce, h] - gm.exp()[:, None] * (kc @ S))
                o[cs:ce, h] = scale * (gm.exp()[:, None] * (qc @ S) + (dec * (qc @ kc.T)) @ vd)
                S = gm[-1].exp() * S + kc.T @ (torch.exp(gm[-1] - gm)[:, None] * vd)
            if ht is not None and fin >= 0:
                ht[fin, h] = S


def _torch_segment_states(k, v, ag, gamma, beta, pl, *, bDV):
    """segment_states' contract in float64 torch: each map from zero / identity starts, by the torch chunk stage on
    the map's token range."""
    R, Hv, K, V = pl.maps.shape[0], v.shape[1], k.shape[2], v.shape[2]
    hs, ms = torch.zeros(R, Hv, K, V, dtype=torch.float64), torch.zeros(R, Hv, K, K, dtype=torch.float64)
    for r, (s0, s1) in enumerate(pl.maps.tolist()):
        seg = torch.tensor([[s0, s1, 0, 0]])
        zero = torch.zeros(1, Hv, K, V, dtype=torch.float64)
        _torch_chunk_fwd(k, k, v, ag, gamma, beta, zero, seg, torch.empty_like(v), hs[r:r + 1], scale=1.0, bDV=bDV)
        eye = torch.eye(K, dtype=torch.float64).expand(1, Hv, K, K).contiguous()
        _torch_chunk_fwd(k, k, torch.zeros(v.shape[0], Hv, K, dtype=torch.float64), ag, gamma, beta, eye, seg,
                         torch.empty(v.shape[0], Hv, K, dtype=torch.float64), ms[r:r + 1], scale=1.0, bDV=bDV)
    return hs, ms


def _torch_state_scan(h0, hs, ms, seqs, num_segs):
    """state_scan's contract in float64 torch: S_0 = h0 (or 0), S_{i+1} = M_i S_i + H_i over each sequence's maps."""
    h_init = torch.zeros((num_segs,) + hs.shape[1:], dtype=torch.float64)
    for n, (first, count, first_map) in enumerate(seqs.tolist()):
        S = h0[n].double() if h0 is not None else torch.zeros_like(h_init[0])
        for i in range(count):
            h_init[first + i] = S
            if i < count - 1:
                S = ms[first_map + i].double() @ S + hs[first_map + i].double()
    return h_init


@pytest.fixture
def torch_stages(monkeypatch):
    """The launcher with every kernel swapped for its float64 torch twin (CPU); returns the recorded stage calls."""
    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.hopper import chunk_fwd, forward, kkt_solve, segment_states, state_scan

    calls = []

    def record(name, fn):
        def stage(*args, **kwargs):
            calls.append((name, kwargs.get("bDV")))
            return fn(*args, **kwargs)
        return stage

    monkeypatch.setattr(forward, "unsupported_reason", lambda *a, **kw: None)
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(kkt_solve, "kkt_solve", record("kkt_solve", _torch_kkt_solve))
    monkeypatch.setattr(chunk_fwd, "chunk_fwd", record("chunk_fwd", _torch_chunk_fwd))
    monkeypatch.setattr(segment_states, "segment_states", record("segment_states", _torch_segment_states))
    monkeypatch.setattr(state_scan, "state_scan", record("state_scan", _torch_state_scan))
    return calls


def _rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


def test_launcher_wiring_equals_reference_on_a_dense_batch(torch_stages):
    """B = 2, no cu_seqlens, l2norm in the launcher, no split: kkt_solve then chunk_fwd, equal to the reference."""
    from flashqla_kernels.gated_delta_rule.hopper import forward
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    gen = torch.Generator().manual_seed(5)
    B, Tn, Hk, Hv, K, V = 2, 70, 1, 2, 16, 8
    q, k = (torch.randn(B, Tn, Hk, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, Tn, Hv, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, Tn, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, Tn, Hv, generator=gen, dtype=torch.float64)
    h0 = torch.randn(B, Hv, K, V, generator=gen, dtype=torch.float64)
    o, ht = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True, segment_chunks=0)
    ro, rht = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    assert [name for name, _ in torch_stages] == ["kkt_solve", "chunk_fwd"]
    # g, beta and h0 travel as fp32 (the kernels' contract): agreement to fp32 rounding, not 1e-10
    assert _rel(o, ro) < 1e-6 and _rel(ht, rht) < 1e-6


def test_launcher_wiring_hands_ag_to_the_segment_maps_and_the_scan(torch_stages):
    """Ragged varlen split into 2-chunk segments: Ag reaches both consumers (the maps and chunk_fwd), the scan starts
    every segment, and the result equals the reference; block_v forces the V slice of every stage."""
    from flashqla_kernels.gated_delta_rule.hopper import forward
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    gen = torch.Generator().manual_seed(7)
    lens = [300, 47]
    cu = torch.tensor([0, *itertools.accumulate(lens)])
    Tn, Hk, Hv, K, V = cu[-1].item(), 1, 2, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(1, Tn, Hk, K, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, Tn, Hv, V, generator=gen, dtype=torch.float64)
    g = -0.1 * torch.rand(1, Tn, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, Tn, Hv, generator=gen, dtype=torch.float64)
    h0 = torch.randn(len(lens), Hv, K, V, generator=gen, dtype=torch.float64)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, segment_chunks=2)
    o, ht = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
    ro, rht = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert [name for name, _ in torch_stages] == ["kkt_solve", "segment_states", "state_scan", "chunk_fwd"]
    assert _rel(o, ro) < 1e-6 and _rel(ht, rht) < 1e-6
    torch_stages.clear()
    forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw, block_v=4)
    assert torch_stages[1] == ("segment_states", 4) and torch_stages[-1] == ("chunk_fwd", 4)


def _gdn_forward():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gdn_forward

    return gdn_forward


@pytest.mark.parametrize("config", [(16, 32, 8192, 1), (16, 32, 4096, 16), (2, 8, 32768, 1)])
def test_precompile_specs_are_the_kernels_the_public_op_compiles(config, monkeypatch):
    """benchmarks/gdn_forward.py's precompile list names each kernel with the very arguments the launcher passes to
    ``compile_kernel`` (else the carried cache misses and the device JIT-compiles). The public op runs on CPU with the
    device check passed and every kernel replaced by a no-op, a context-parallel layout included."""
    pytest.importorskip("tilelang")
    import flashqla_kernels
    from flashqla_kernels import dispatch, toolkit
    from flashqla_kernels.gated_delta_rule.hopper import forward

    stages = {"build_kkt_solve": "kkt_solve", "build_chunk_fwd": "chunk_fwd",
              "build_segment_states": "segment_states", "build_state_scan": "state_scan"}
    seen = set()
    monkeypatch.setattr(toolkit, "compile_kernel",
                        lambda builder, *args: seen.add((stages[builder.__name__], args)) or (lambda *a: None))
    monkeypatch.setattr(dispatch, "hopper_reason", lambda *tensors: None)
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)
    Hk, Hv, seqlen, nseq = config
    q = k = torch.zeros(1, seqlen * nseq, Hk, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, seqlen * nseq, Hv, 128, dtype=torch.bfloat16)
    g = beta = torch.zeros(1, seqlen * nseq, Hv)
    h0 = torch.zeros(nseq, Hv, 128, 128)
    cu = torch.arange(0, seqlen * nseq + 1, seqlen, dtype=torch.int32)
    assert forward.unsupported_reason(q, k, v, g, beta, h0, cu) is None
    with torch.no_grad():
        flashqla_kernels.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, backend="tilelang")
    assert {s for s, _ in seen} >= {"kkt_solve", "chunk_fwd"}
    if config == (16, 32, 8192, 1):
        assert {s for s, _ in seen} == {"kkt_solve", "segment_states", "state_scan", "chunk_fwd"}
    specs = set(_gdn_forward().kernel_specs([config], 132))
    assert seen <= specs, f"compiled but not precompiled: {seen - specs}"


def test_benchmark_merges_runs_over_disjoint_configs():
    """gdn_forward.py --merge: rows of two half-suite runs (one per GPU) in suite order, geomeans over all rows,
    overlapping or mismatched runs refused."""
    gdn_forward = _gdn_forward()
    from gdn_forward_report import merge

    def row(i, ours, fla):
        Hk, Hv, seqlen, nseq = gdn_forward.SUITE[i]
        return {"Hk": Hk, "Hv": Hv, "seqlen": seqlen, "nseq": nseq, "speedup_vs_fla": fla / ours,
                "ratio_vs_flashqla": 1.0}

    def part(rows, date):
        return {"gpu": "H200", "commit": "c", "date": date, "bf16_matmul_tflops": 790.0, "copy_tbps": 4.2,
                "method": "m", "configs_planned": len(rows), "rows": rows}

    a, b = part([row(5, 1.0, 2.0), row(0, 1.0, 8.0)], "d1"), part([row(3, 1.0, 4.0)], "d2")
    merged = merge([a, b], gdn_forward.SUITE)
    assert [(r["Hk"], r["Hv"], r["seqlen"], r["nseq"]) for r in merged["rows"]] == [gdn_forward.SUITE[i]
                                                                                      for i in (0, 3, 5)]
    assert merged["geomean_speedup_vs_fla"] == pytest.approx(4.0)
    assert merged["configs_planned"] == 3 and [p["date"] for p in merged["parts"]] == ["d1", "d2"]
    with pytest.raises(ValueError, match="overlap"):
        merge([a, a], gdn_forward.SUITE)
    with pytest.raises(ValueError, match="commit"):
        merge([a, {**b, "commit": "other"}], gdn_forward.SUITE)


def test_wide_slices_only_where_the_segment_maps_cover_the_key_dim():
    from flashqla_kernels.gated_delta_rule.hopper import plan

    long_seq = [512]  # 32768 tokens: split into segments on 132 SMs
    assert plan.wide_slices_pay(64, long_seq, 32, 128, 128, 132)
    # K = 64 with 128-wide slices would launch K // bDV = 0 map blocks
    assert not plan.wide_slices_pay(64, long_seq, 32, 64, 128, 132)
    assert plan.block_dv(long_seq, 32, 64, 128, 132) == 64
