"""CPU CI for the Hopper backward (``hopper/backward.py`` and its stages): every stage lowers and compiles for sm_90a
with the local nvcc (no GPU), the launcher asks for exactly the specialisations ``backward.kernel_specs`` lists (so
``backward.precompile()`` fills the cache the GPU test reads), and no kernel sums with atomics (determinism).

The default run builds the Qwen3.5 layout (Hk = 16, Hv = 32, K = V = 128, bf16) with and without the in-kernel
l2norm; ``-m slow`` adds head dims 64 / 256 and fp16. Fill a cache for a GPU machine:
``TILELANG_CACHE_DIR=<dir> python -c "from flashqla_kernels.gated_delta_rule.hopper import backward;
backward.precompile()"``.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from flashqla_kernels.gated_delta_rule.hopper import backward
from tests.flashqla_kernels.test_hopper_build import _bank_conflicts

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc to compile for sm_90a")


def _specs(*layouts):
    seen = {}
    for layout in layouts:
        for builder, args in backward.kernel_specs(*layout):
            seen.setdefault((builder.__name__, args), (builder, args))
    return list(seen.values())


def _ids(specs):
    return [f"{b.__name__.removeprefix('build_')}-{a}" for b, a in specs]


def _lazy_specs(*layouts):
    # the builders live in the stage modules, which import tilelang: resolved at collection only where it imports
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return []
    return _specs(*layouts)


QWEN = [(16, 32, 128, 128, "bfloat16", l2, True, True) for l2 in (True, False)]
# one layout per head dim and dtype: the GPU test's own layouts are compiled by ``precompile`` for the device, and
# every one of them in CI would add minutes of nvcc for no new lowering path
EXTRA_LAYOUTS = [
    (2, 4, 64, 64, "float16", True, False, False),
    (2, 2, 256, 256, "bfloat16", False, True, True),
    (16, 32, 128, 128, "float16", False, False, False),
]
CORE = _lazy_specs(*QWEN)
CORE_KEYS = {(b.__name__, a) for b, a in CORE}
EXTRA = [s for s in _lazy_specs(*EXTRA_LAYOUTS) if (s[0].__name__, s[1]) not in CORE_KEYS]


def _check(builder, args):
    from flashqla_kernels import toolkit

    src = toolkit.compile_kernel(builder, *args).get_kernel_source()
    assert "__global__" in src
    # every cross-CTA sum is a fixed-order loop over partials: a float atomic would make runs differ
    assert "atomicAdd" not in src and "AtomicAdd" not in src, f"{builder.__name__}{args}: atomics"
    # a TMA copy under a one-thread branch: TileLang's elect.sync inside it hangs the kernel
    assert not re.search(r"threadIdx\.x\) == \d+\) \{\s*if \(tl::tl_shuffle_elect", src), f"{builder.__name__}{args}"
    name = builder.__name__
    if name in ("build_chunk_states", "build_bwd_dh", "build_bwd_dqkwg", "build_bwd_dqkwg_group", "build_bwd_wy",
                "build_bwd_wy_group", "build_bwd_walk", "build_bwd_walk_ws"):
        assert "wgmma" in src, f"{name}{args}: its GEMMs should run on warpgroup MMA"
    if name == "build_bwd_dqkwg_group":
        # its warpgroups hand off through mbarriers only: a planner-inserted bar.sync shared one named-barrier id
        # across warpgroups and hung the kernel
        assert "__sync_thread_partial" not in src, f"{name}{args}: a named bar.sync inside a warpgroup's branch"
    if name == "build_bwd_walk":
        # the consumers sync among their 256 threads only: a whole-CTA barrier after the roles split (the one
        # allowed is after the mbarriers' init) would wait for the producer, which never reaches it
        assert src.count("__syncthreads()") == 1, f"{name}{args}: a whole-CTA barrier inside a role"
        assert "__sync_thread_partial(3, 256)" in src, f"{name}{args}: the consumers' syncs"
    if name == "build_bwd_walk_ws":
        # each consumer warpgroup syncs its own 128 threads on its own named barrier (S 1, A 2, B 3), and nothing
        # else: a planner's bar.sync inside a role, or one shared across roles, would hang the walk
        assert src.count("__syncthreads()") == 1, f"{name}{args}: a whole-CTA barrier inside a role"
        assert set(re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", src)) == {
            ("1", "128"), ("2", "128"), ("3", "128")}, f"{name}{args}: the roles' own syncs"
        # the tiles fit one CTA (227 KB with the static arrays and barriers); the planner lays them out largest first,
        # so the last is a [C, C] one of 8 KB
        offsets = [int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)]
        assert offsets and max(offsets) + 8192 <= 232448 - 3072, f"{name}{args}: {max(offsets)}"
    # the grouped kernels' fp32 running sums, read and written in accumulator layout, each thread its own elements:
    # rows padded to shift 8 banks, so those accesses are at most 2-way (unpadded: 8-way). The one row-major copy
    # from dk_part into dka_sh, once a chunk, stays 4-way.
    tile = {"build_bwd_dqkwg_group": "dqa_sh", "build_bwd_wy_group": "dka_sh"}.get(name)
    if tile:
        worst = [w for _, w in _bank_conflicts(src, tile)]
        assert worst and [w for w in worst if w > 2.0] == ([4.0] if tile == "dka_sh" else []), f"{name}{args}: {worst}"


@needs_nvcc
@pytest.mark.parametrize("builder,args", CORE, ids=_ids(CORE))
def test_backward_stage_compiles_for_sm90a(builder, args):
    _check(builder, args)


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("builder,args", EXTRA, ids=_ids(EXTRA))
def test_other_backward_specialisations_compile_for_sm90a(builder, args):
    _check(builder, args)


def _cpu_inputs(Hk, Hv, K, V, dtype, lens, pad, dense_batch=None):
    B, T = (dense_batch, lens[0]) if dense_batch else (1, sum(lens) + pad)
    N = dense_batch or len(lens)
    dt = getattr(torch, dtype)
    q, k = (torch.randn(B, T, Hk, K).to(dt) for _ in range(2))
    v, do = (torch.randn(B, T, Hv, V).to(dt) for _ in range(2))
    g, beta = -torch.rand(B, T, Hv), torch.rand(B, T, Hv)
    cu = None if dense_batch else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, do, N, cu


def _recording_launcher(layout, monkeypatch):
    """The compiler replaced by a recorder (every kernel a no-op) and CPU inputs of ``layout``: (the list of
    (builder, args) asked for, (q, k, v, g, beta, do, N, cu, h0, dht), the padded head dims)."""
    pytest.importorskip("tilelang")
    from flashqla_kernels import toolkit

    asked = []
    monkeypatch.setattr(toolkit, "compile_kernel", lambda builder, *args: asked.append((builder, args)) or (
        lambda *tensors: None))
    Hk, Hv, K, V, dtype, l2, has_h0, has_dht = layout
    q, k, v, g, beta, do, N, cu = _cpu_inputs(Hk, Hv, K, V, dtype, [1, 70, 130], pad=5)
    h0 = torch.randn(N, Hv, K, V) if has_h0 else None
    dht = torch.randn(N, Hv, K, V) if has_dht else None
    return asked, (q, k, v, g, beta, do, N, cu, h0, dht), tuple(backward.forward.padded_head_dim(d) for d in (K, V))


@pytest.mark.parametrize("layout", [QWEN[0], *EXTRA_LAYOUTS, (2, 4, 96, 40, "bfloat16", True, True, False)])
def test_launcher_compiles_exactly_the_listed_specialisations(layout, monkeypatch):
    """The launcher run on CPU tensors with the compiler replaced by a recorder: what it asks for is
    ``kernel_specs`` of its (padded) layout, so ``precompile`` builds what a GPU run loads."""
    asked, (q, k, v, g, beta, do, N, cu, h0, dht), (Kp, Vp) = _recording_launcher(layout, monkeypatch)
    Hk, Hv, K, V, dtype, l2, has_h0, has_dht = layout
    monkeypatch.setattr(backward, "WALK", False)  # the staged stages (the walk's own test below)
    # whole sequences (the plan's choice at this size), then forced 1-chunk segments (context parallelism)
    for segment_chunks in (None, 1):
        dq, dk, dv, dg, dbeta, dh0 = backward.chunk_gated_delta_rule_bwd(
            q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2,
            segment_chunks=segment_chunks)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dv.dtype == v.dtype
        assert dg.shape == g.shape and dbeta.shape == beta.shape and (dh0 is None) == (h0 is None)
        for x in (dq, dk, dv, dg, dbeta):
            assert not x[:, -5:].any(), "the padded tail's gradients must be exactly 0"
    want = {(b, a) for b, a in backward.kernel_specs(Hk, Hv, Kp, Vp, dtype, l2, has_h0, has_dht, scale=K ** -0.5)}
    assert set(asked) <= want
    assert any(b.__name__.startswith("build_bwd_dqkwg") for b, _ in asked)
    assert any(b.__name__ == "build_chunk_states" for b, _ in asked)
    # the forward under grad saves the states with its chunk kernel: that kernel is listed too (its other kernels
    # are the forward's own precompile list's)
    recompute = set(asked)
    monkeypatch.setattr(backward.plan, "num_sms", lambda device: 132)  # the forward's plan asks the device
    for segment_chunks in (None, 1):
        out = backward.forward.chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, initial_state=h0, output_final_state=has_dht, use_qk_l2norm_in_kernel=l2,
            cu_seqlens=cu, segment_chunks=segment_chunks, save_states=True)
        rows = q.shape[0] * q.shape[1]
        assert len(out) == 6 and out[2].shape[1:] == (Hv, Kp, Vp) and out[3].shape == (rows, Hv, Vp)
        assert out[4].shape == (rows, Hv) and out[5].shape == (rows, Hv, 64)  # gamma and Ag
    saving = {(b, a) for b, a in set(asked) - recompute if b.__name__ == "build_chunk_fwd"}
    assert saving and all(a[9] is True for _, a in saving) and saving <= want  # save_states
    # the forward's plan picks one of the V slices listed for the states, bwd_dqkwg.KERNEL between the
    # per-value-head path (dqkwg, WY, GVA) and the grouped one, and the layout pass runs only on channels-first
    # inputs: only those may go unasked
    assert {b.__name__ for b, _ in want - set(asked)} <= {
        "build_chunk_states", "build_segment_states", "build_chunk_fwd", "build_bwd_dqkwg", "build_bwd_dqkwg_group",
        "build_bwd_wy", "build_bwd_wy_group", "build_gva_bwd", "build_channels_first_to_tokens", "build_bwd_walk",
        "build_bwd_walk_ws"}


@pytest.mark.parametrize("layout", [QWEN[0], (2, 4, 64, 64, "float16", True, False, False),
                                    (2, 4, 96, 40, "bfloat16", True, True, False)])
def test_fused_walk_launcher_compiles_only_listed_specialisations(layout, monkeypatch):
    """With ``backward.WALK`` on, the launcher runs the walk (whole sequences and segments), asks only for
    ``kernel_specs``' kernels, and never for the dqkwg and WY stages it replaces."""
    asked, (q, k, v, g, beta, do, N, cu, h0, dht), (Kp, Vp) = _recording_launcher(layout, monkeypatch)
    monkeypatch.setattr(backward, "WALK", True)
    Hk, Hv, K, V, dtype, l2, has_h0, has_dht = layout
    for segment_chunks in (None, 1):
        dq, dk, dv, dg, dbeta, dh0 = backward.chunk_gated_delta_rule_bwd(
            q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2,
            segment_chunks=segment_chunks)
        assert dq.shape == q.shape and dv.shape == v.shape and (dh0 is None) == (h0 is None)
        if dh0 is not None:
            assert dh0.shape == (N, Hv, K, V)
        for x in (dq, dk, dv, dg, dbeta):
            assert not x[:, -5:].any(), "the padded tail's gradients must be exactly 0"
    want = {(b, a) for b, a in backward.kernel_specs(Hk, Hv, Kp, Vp, dtype, l2, has_h0, has_dht, scale=K ** -0.5)}
    names = {b.__name__ for b, _ in asked}
    assert set(asked) <= want and "build_bwd_walk" in names
    assert not names & {"build_bwd_dqkwg", "build_bwd_dqkwg_group", "build_bwd_wy", "build_bwd_wy_group"}
    walks = {a for b, a in asked if b.__name__ == "build_bwd_walk"}
    assert {a[6] for a in walks} == ({has_dht, True}) and {a[7] for a in walks} == {has_h0}


def test_gpu_test_cases_are_all_precompiled():
    from tests.flashqla_kernels.test_hopper_bwd_gpu import CASES, case_layout

    assert {case_layout(name) for name in CASES} <= set(backward.TESTED_LAYOUTS)


def test_importing_backward_does_not_import_tilelang():
    code = ("import sys, flashqla_kernels.gated_delta_rule.hopper.backward as b; "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'; print(b.chunk_gated_delta_rule_bwd.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
