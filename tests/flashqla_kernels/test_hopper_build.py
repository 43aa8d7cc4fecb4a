"""CPU CI for the Hopper kernels (``gated_delta_rule/hopper/``): every stage lowers and compiles for sm_90a with the
local nvcc (no GPU needed) with the structure it is built for, the host-side plan (chunk/segment tables, V slices,
when to split sequences) is right, and the kernels' schedules are checked in float64 emulation.

Compiling is the slow part (seconds per kernel); the default run builds the Qwen3.5 head layout (K = V = 128, bf16)
of every stage, ``-m slow`` adds head dims 64/256, fp16, other GVA groups and the ptxas register report (no spills).
TileLang's disk cache (~/.tilelang/cache) makes re-runs fast.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashqla_kernels.gated_delta_rule.hopper import plan

REPO = Path(__file__).resolve().parents[2]

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc to compile for sm_90a")
S128 = 128 ** -0.5

# (stage, builder args); builders: kkt_solve(Hk, Hv, K, dtype, l2norm), chunk_fwd(Hk, Hv, K, V, bDV, dtype, scale,
# store_final, l2norm, save_states), segment_states(Hk, Hv, K, V, bDV, dtype, l2norm), state_scan(Hv, K, V,
# has_h0)
CORE = [
    ("kkt_solve", (16, 32, 128, "bfloat16", False)),
    ("chunk_fwd", (16, 32, 128, 128, 128, "bfloat16", S128, True, False, False)),
    ("segment_states", (16, 32, 128, 128, 64, "bfloat16", False)),
    ("state_scan", (32, 128, 128, True)),
    # the op under transformers (use_qk_l2norm_in_kernel=True): q and k normalised inside the stages
    ("kkt_solve", (16, 32, 128, "bfloat16", True)),
    ("chunk_fwd", (16, 32, 128, 128, 128, "bfloat16", S128, True, True, False)),
    # the forward under grad: also the states for the backward
    ("chunk_fwd", (16, 32, 128, 128, 128, "bfloat16", S128, True, True, True)),
    # the backward's maps: M and the start table alone
    ("segment_states", (16, 32, 128, 128, 64, "bfloat16", False, True)),
    # transformers' channels-first q, k, v made token-major (the 2B layer: 16 heads of 128 each)
    ("layout", (2048, 2048, "bfloat16")),
    # v alone channels-first (transformers < 5.23 repeats q and k when Hv > Hk): the 9B layer, 32 heads of 128, one
    # sequence and a batch of them
    ("layout_slice", (4096, 0, 4096, "bfloat16")),
    ("layout_slice", (8192, 4096, 4096, "bfloat16")),
]
EXTRA = [
    ("kkt_solve", (2, 4, 64, "float16")),
    ("kkt_solve", (2, 2, 256, "bfloat16")),
    ("kkt_solve", (16, 64, 128, "bfloat16")),
    ("kkt_solve", (16, 16, 128, "bfloat16")),
    ("kkt_solve", (4, 16, 256, "float16")),
    ("kkt_solve", (2, 8, 64, "bfloat16")),
    ("chunk_fwd", (16, 32, 128, 128, 64, "float16", 0.5, False, False, False)),
    ("chunk_fwd", (2, 4, 64, 64, 64, "bfloat16", 0.125, True, False, False)),
    ("chunk_fwd", (2, 2, 256, 256, 32, "bfloat16", 256 ** -0.5, True)),
    ("chunk_fwd", (16, 16, 128, 128, 32, "bfloat16", S128, True)),
    ("segment_states", (2, 4, 64, 64, 64, "float16")),
    ("segment_states", (2, 2, 256, 256, 32, "bfloat16")),
    ("segment_states", (16, 32, 128, 128, 128, "bfloat16")),
    ("state_scan", (32, 128, 128, False)),
    ("state_scan", (4, 64, 64, True)),
    ("state_scan", (2, 256, 256, True)),
    ("segment_states", (16, 32, 128, 128, 128, "bfloat16", True)),
    ("kkt_solve", (16, 64, 128, "bfloat16", True)),
]


def _builder(stage):
    from flashqla_kernels.gated_delta_rule.hopper import chunk_fwd, kkt_solve, layout, segment_states, state_scan

    return {"kkt_solve": kkt_solve.build_kkt_solve, "chunk_fwd": chunk_fwd.build_chunk_fwd,
            "segment_states": segment_states.build_segment_states, "state_scan": state_scan.build_state_scan,
            "layout": layout.build_channels_first_to_tokens,
            "layout_slice": layout.build_channel_slice_to_tokens}[stage]


def _source(stage, args) -> str:
    pytest.importorskip("tilelang")
    from flashqla_kernels import toolkit

    return toolkit.compile_kernel(_builder(stage), *args).get_kernel_source()


def _values_warpgroup(src: str) -> str:
    # chunk_fwd's values warpgroup: from its setmaxnreg to the output warpgroup's
    return src[src.index("warpgroup_reg_dealloc<120>"):src.index("warpgroup_reg_alloc<136>")]


_ACCESS_BYTES = {"bfloat16_t": 2, "half_t": 2, "float": 4, "uint1": 4, "uint2": 8, "uint4": 16}


def _bank_conflicts(src: str, name: str) -> list[tuple[int, float]]:
    """(bytes, worst) of every element-wise access to shared buffer ``name`` inside an unrolled element loop of the
    generated CUDA: ``worst`` is the most distinct 4-byte words one bank serves for a warp's access (lanes 0-31),
    relative to the minimum an access of that width needs; 1.0 is conflict-free. Other loop counters are taken at 0."""
    out = []
    for loop in re.finditer(r"for \(int (i_\d+) = 0; \1 < (\d+);", src):
        var, n = loop.group(1), int(loop.group(2))
        depth, end = 0, src.index("{", loop.end())
        begin = end
        while True:
            depth += (src[end] == "{") - (src[end] == "}")
            if depth == 0:
                break
            end += 1
        body = src[begin:end]
        for acc in re.finditer(r"(?:\*\((\w+)\*\))?\(\(\((\w+)\*\)" + name + r"\) \+ ", body):
            stop, depth = acc.end(), 1
            while depth:
                depth += (body[stop] == "(") - (body[stop] == ")")
                stop += 1
            expr = re.sub(r"\(\(int\)threadIdx\.x\)", "tx", body[acc.end():stop - 1]).replace("(int64_t)", "")
            expr = re.sub(r"\b[a-z]\w*\b", lambda m: m.group(0) if m.group(0) in (var, "tx") else "0", expr)
            elem = _ACCESS_BYTES[acc.group(2)]
            width = _ACCESS_BYTES.get(acc.group(1), elem)
            words_each = max(1, width // 4)
            worst = 0.0
            for i in range(n):
                banks = {}
                for lane in range(32):
                    first = eval(expr, {}, {"tx": lane, var: i}) * elem // 4
                    for w in range(first, first + words_each):
                        banks.setdefault(w % 32, set()).add(w)
                worst = max(worst, max(len(ws) for ws in banks.values()) / words_each)
            out.append((width, worst))
    return out


def _check_chunk_fwd(args, src):
    # four warpgroup roles, registers moved to the state / output groups, mbarrier hand-offs, TMA loads
    for role in ("threadIdx.x) < 128", "threadIdx.x) < 256", "threadIdx.x) < 384"):
        assert role in src, f"chunk_fwd{args}: no warpgroup branch {role!r}"
    # setmaxnreg only moves away from the launch allocation (128 at 512 threads): .inc up, .dec down (an .inc to a
    # lower count is an illegal instruction); the budgets fill the 64K registers
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
    # the first element loop after it, to its closing brace at the loop's own indentation
    loop = re.search(r"\n( *)for \(int (i_\d+) = 0; \2 < \d+; \+\+\2\) \{(.*?)\n\1\}", after_ks, re.S)
    l2norm = len(args) > 8 and args[8]
    assert loop and ("ek_sh" if l2norm else "eg_sh") in loop.group(3), "no W element loop after the K S GEMM"
    assert "__sync_thread_partial" not in loop.group(3) and "stmatrix" in values
    # W reads V element-wise in the accumulator's layout (eight rows a warp): from a swizzled tile, not linear rows of
    # bDV elements, which put all eight rows in the same banks
    v_access = _bank_conflicts(src, "v_sh")
    assert v_access and all(worst == 1 for _, worst in v_access), f"V's tile has bank conflicts: {v_access}"
    # shared memory within sm_90's 227 KB a CTA (over it the launch fails): O gets its shared tile only where it fits
    from flashqla_kernels.gated_delta_rule.hopper import chunk_fwd

    K, bDV, dtype = args[2], args[4], args[5]
    save = len(args) > 9 and args[9]
    fits = chunk_fwd.shared_bytes(K, bDV, dtype, l2norm, save, True) <= chunk_fwd.SMEM_PER_CTA
    has_o_tile = "tl::tma_store(o_desc" in src
    assert has_o_tile == fits
    used = chunk_fwd.shared_bytes(K, bDV, dtype, l2norm, save, has_o_tile)
    assert used <= chunk_fwd.SMEM_PER_CTA
    # the byte count covers every dynamic shared buffer the build placed
    assert max(int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)) < used
    if has_o_tile:
        # the output warpgroup's O of a full chunk: registers -> shared (stmatrix) -> one bulk store, the shared tile
        # rewritten only after the previous store has read it
        output = src[src.index("warpgroup_reg_alloc<136>"):src.index("warpgroup_reg_dealloc<88>")]
        o_tile = output[output.index("tma_store_wait<0, true>"):]
        assert o_tile.index("ptx_stmatrix") < o_tile.index("tl::tma_store(o_desc"), "O does not leave by a bulk store"
        assert o_tile.index("__sync_thread_partial") < o_tile.index("ptx_stmatrix")
    if len(args) > 9 and args[9]:
        # saving for the backward: each chunk's entering state leaves by one bulk store of its shared copy, waited on
        # (reads only) before that copy is overwritten
        assert "tl::tma_store(hs_desc" in src and "tma_store_wait<0, true>" in src


def _check_structure(stage, args, src):
    assert "__global__" in src
    # every element-wise shared-memory access of the forward's stages is free of bank conflicts (a warp's 32 lanes)
    for name in sorted(set(re.findall(r"\(\(\w+\*\)(\w+_sh)\) \+ ", src))):
        worst = max((w for _, w in _bank_conflicts(src, name)), default=1.0)
        assert worst == 1, f"{stage}{args}: {name} is accessed with {worst:g}-way bank conflicts"
    # TileLang issues a TMA copy from the thread its elect.sync picks, over a full warp's mask: a copy put under a
    # one-thread branch (``if tx == 0``) elects inside it and hangs the kernel on the GPU
    assert not re.search(r"threadIdx\.x\) == \d+\) \{\s*if \(tl::tl_shuffle_elect", src), "an elect under one thread"
    if stage == "chunk_fwd":
        _check_chunk_fwd(args, src)
    elif stage == "segment_states":
        # Ag W multiplies the loaded fp16 tile (an fp16 wgmma); no Ag tile is formed
        assert "wgmma_ss<tl::DataType::kFloat16" in src and "ag_sh" not in src
        # W reads V element-wise in the accumulator's layout: from a swizzled tile, conflict-free
        v_access = _bank_conflicts(src, "v_sh")
        assert v_access and all(worst == 1 for _, worst in v_access), f"V's tile has bank conflicts: {v_access}"
        # every map writes its start table; the maps-only build never writes H
        assert re.search(r"\bstart\[", src)
        assert ("(hs + " not in src) == (len(args) > 7 and args[7])
    elif stage == "state_scan":
        assert "wgmma" in src, "state_scan: its M S GEMM should run on warpgroup MMA"
        # a map found negligible (start >= 0) costs neither its M load nor the product
        body = src[src.index("__global__"):]
        assert "mstart[" in body and body.index("mstart[") < body.index("tl::wgmma")
    elif stage in ("layout", "layout_slice"):
        # a warp's 32 consecutive tokens of one channel go down a column of the [token, channel] tile, whose rows
        # of 66 elements (33 words) put them in 32 distinct banks; the rows leave in whole-row stores
        assert re.search(r"tt\[\(+\(\(int\)threadIdx\.x\) & 63\) \* 66\)", src), "the transposed write is not a column"
        assert "__syncthreads();" in src and "tl::wgmma" not in src
    else:
        # the substitution reads its rows of S four floats at a time
        assert "*(float4*)(((float*)sd_sh)" in src
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


NO_SPILL = [CORE[0], CORE[1], CORE[2], CORE[4], CORE[5], CORE[6],
            ("chunk_fwd", (16, 32, 128, 128, 64, "float16", 0.5, False, False, False))]


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("stage,args", NO_SPILL, ids=[f"{s}-{a}" for s, a in NO_SPILL])
def test_kernels_do_not_spill(stage, args, tmp_path):
    """ptxas -v on the generated CUDA: the setmaxnreg budgets (chunk_fwd) and the occupancy bound (kkt_solve) cost no
    spills on the Qwen3.5 layout (bf16, K = V = 128, with and without l2norm in the kernel, saving the states or not)
    nor on fp16 64-wide slices; the PTX carries the Hopper instructions themselves."""
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


def test_every_chunk_step_build_fits_one_ctas_shared_memory():
    """Every chunk_fwd / chunk_states build the backward's tested layouts compile, and every head dim, V slice the
    plan picks, dtype, l2norm and state saving of chunk_fwd, fits sm_90's 227 KB a CTA: over it the launch fails,
    on the GPU only. O's shared tile is dropped exactly where it would not fit. No compile needed."""
    from flashqla_kernels.gated_delta_rule.hopper import backward, chunk_fwd, plan

    # (K, bDV, dtype, l2norm, with v_new's store tile)
    builds = []
    for b, a in {s for layout in backward.TESTED_LAYOUTS for s in backward.kernel_specs(*layout)}:
        if b is chunk_fwd.build_chunk_fwd:
            builds.append((a[2], a[4], a[5], len(a) > 8 and a[8], len(a) > 9 and a[9]))
        elif b is chunk_fwd.build_chunk_states:  # the backward's recompute: v_new's tile, no O
            builds.append((a[2], a[4], a[5], False, True))
    for K in (64, 128, 256):
        for n_seqs in (1, 4, 64):
            bDV = plan.choose_block_v(n_seqs, 32, K, K, 132)
            builds += [(K, bDV, dt, l2, save) for dt in ("bfloat16", "float16") for l2 in (False, True)
                       for save in (False, True)]
    assert len(builds) > 50
    for K, bDV, dtype, l2norm, save in builds:
        without = chunk_fwd.shared_bytes(K, bDV, dtype, l2norm, save, False)
        assert without <= chunk_fwd.SMEM_PER_CTA, f"chunk step K={K} bDV={bDV}: {without} bytes of shared memory"
        assert chunk_fwd.shared_bytes(K, bDV, dtype, l2norm, save, True) - without == 64 * bDV * 2
    # the Qwen layout saving the states for the backward is the build that must store O from registers
    assert chunk_fwd.shared_bytes(128, 128, "bfloat16", True, True, True) > chunk_fwd.SMEM_PER_CTA
    assert chunk_fwd.shared_bytes(128, 128, "bfloat16", True, False, True) <= chunk_fwd.SMEM_PER_CTA


def test_importing_hopper_does_not_import_tilelang():
    code = ("import sys, flashqla_kernels.gated_delta_rule.hopper as h; "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'; print(h.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "chunk_gated_delta_rule_fwd" in out.stdout and "unsupported_reason" in out.stdout

@needs_nvcc
def test_in_kernel_starts_fence_the_shared_buffers():
    """The planner lays later tiles over the start search's buffers, so a barrier separates the last read of the
    result from the first tile write."""
    src = _source("segment_states", (16, 32, 128, 128, 64, "bfloat16"))
    tail = src[src.index("skip = "):]
    assert "__syncthreads();" in tail[:tail.index("cp_async")], "no barrier between reading the start and the tiles"
