"""The TileLang Hopper backward (``hopper/backward.py`` and its stages) against the float64 reference of the backward
(``reference_bwd.py``), on an sm_90 GPU (skipped elsewhere).

Each stage runs on its float64 stage reference's inputs and is compared with that reference's outputs; the whole
launcher against ``chunk_gated_delta_rule_bwd_ref`` with FLA's RMSE-ratio tolerances (dq, dk, dv, dh0 <= 0.008; dg,
dbeta <= 0.02). Every kernel output is poisoned with NaN before the run (an unwritten element fails), a padded tail
gets exactly 0, and a second run is bit-identical. ``backward.precompile()`` builds every kernel these cases use.
"""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper import backward, bwd_walk, forward
from flashqla_kernels.gated_delta_rule.reference import l2norm
from flashqla_kernels.gated_delta_rule.reference_bwd import (
    chunk_bwd_dh_ref, chunk_bwd_dqkwg_ref, chunk_bwd_dv_local_ref, chunk_bwd_recompute_ref, chunk_bwd_wy_ref,
    chunk_gated_delta_rule_bwd_ref, chunk_local_cumsum_bwd_ref, gva_reduce_ref, l2norm_bwd_ref,
)
from tests.flashqla_kernels.test_hopper_gpu import _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# FLA's test tolerances for its chunk backward (ratio of RMSEs, bf16 inputs)
RMSE_RATIO = {"dq": 0.008, "dk": 0.008, "dv": 0.008, "dh0": 0.008, "dg": 0.02, "dbeta": 0.02}
STAGE_RATIO = 0.01

CASES = {
    # name: (Hk, Hv, K, V, lens, dtype, extra); gates: per-head A from 0 (g == 0) to 16 (strong decay)
    "qwen_layout_l2norm_varlen": (16, 32, 128, 128, [1000, 1, 300], torch.bfloat16,
                                  {"normalized": False, "l2norm": True}),
    "ragged_gva2_l2norm_padded_tail": (2, 4, 128, 128, [1, 47, 300, 64, 130, 1], torch.bfloat16,
                                       {"normalized": False, "l2norm": True, "pad": 37}),
    "dense_gva4_T200_no_dht": (1, 4, 128, 128, [200], torch.bfloat16, {"dense_batch": 2, "dht": False}),
    "gva1_fp16_l2norm_no_h0": (4, 4, 128, 128, [65, 1, 63], torch.float16,
                               {"normalized": False, "l2norm": True, "h0": False}),
    "dim64_l2norm": (2, 4, 64, 64, [100, 47, 190], torch.bfloat16, {"normalized": False, "l2norm": True}),
    "dim256_gva1": (2, 2, 256, 256, [100, 47, 190], torch.bfloat16, {}),
}


def case_layout(name):
    """The (Hk, Hv, K, V, dtype, l2norm, has_h0, has_dht) a case compiles for (``backward.TESTED_LAYOUTS``)."""
    Hk, Hv, K, V, _, dtype, extra = CASES[name]
    return (Hk, Hv, K, V, str(dtype).removeprefix("torch."), extra.get("l2norm", False), extra.get("h0", True),
            extra.get("dht", True))


def _case(name):
    """The inputs of a case, the same on every call (seeded)."""
    torch.manual_seed(0)
    Hk, Hv, K, V, lens, dtype, extra = CASES[name]
    extra = dict(extra)
    l2, has_dht = extra.pop("l2norm", False), extra.pop("dht", True)
    q, k, v, g, beta, h0, cu = _inputs(Hk, Hv, K, V, lens, dtype, **extra)
    N = extra.get("dense_batch") or len(lens)
    do = torch.randn_like(v)
    dht = torch.randn(N, Hv, K, V, device=v.device) if has_dht else None
    return q, k, v, g, beta, do, dht, h0, cu, l2


def _ratio(x, ref):
    """FLA's ``get_err_ratio``: RMSE(x - ref) / RMSE(ref)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _where_differs(a, b, cu=None):
    """Where two runs' outputs differ: how many elements, the first few (token, head) with the token's position in
    its chunk of 64, and the values, so a race names its rows (a chunk's last token, a ragged chunk, a head)."""
    diff = (a != b) & ~(a.isnan() & b.isnan())
    idx = diff.nonzero()
    starts = [0] if cu is None else [int(x) for x in cu[:-1]]
    parts = []
    for row in idx[:6].tolist():
        t = row[1] if a.dim() >= 3 else row[0]  # [B, T, ...] token-major gradients; dense rows start at 0
        seq_start = max([s for s in starts if s <= t], default=0)
        parts.append(f"{tuple(row)} (position {(t - seq_start) % 64} in its chunk): {a[tuple(row)].item():.6g} vs "
                     f"{b[tuple(row)].item():.6g}")
    return f"{len(idx)} of {a.numel()} elements differ; first: " + "; ".join(parts)


def _d(x):
    return None if x is None else x.double()


@pytest.mark.parametrize("name", sorted(CASES))
def test_hopper_backward_matches_float64_reference(name):
    q, k, v, g, beta, do, dht, h0, cu, l2 = _case(name)

    def run():
        return backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=l2)

    with toolkit.poisoned_outputs():
        got, again = run(), run()
    want = chunk_gated_delta_rule_bwd_ref(_d(q), _d(k), _d(v), _d(g), _d(beta), _d(do), _d(dht),
                                          initial_state=_d(h0), use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    for label, x, ref, x2, like in zip(NAMES, got, want, again, (q, k, v, g, beta, h0)):
        if ref is None:
            assert x is None, f"{name}: {label} should be None without initial_state"
            continue
        assert x.shape == ref.shape and x.dtype == (like.dtype if label != "dh0" else torch.float32), label
        assert not x.isnan().any(), f"{name}: {label} has an unwritten (NaN) element"
        assert _ratio(x, ref) <= RMSE_RATIO[label], f"{name}: {label} RMSE ratio {_ratio(x, ref):.2e}"
        assert torch.equal(x, x2), f"{name}: two runs differ in {label} (a race, or a non-deterministic sum)"
    if cu is not None and int(cu[-1]) < q.shape[1]:
        for label, x in zip(NAMES[:5], got[:5]):
            assert not x[:, int(cu[-1]):].any(), f"{name}: {label} of the padded tail is not 0"


def _check_variant(name, case, run, variant, baseline, what):
    """``run(variant)`` twice and ``run(baseline)`` under NaN-poisoned outputs, all on ``case`` (the inputs ``run``
    closes over): the variant's gradients within FLA's RMSE ratios of the float64 reference and of the baseline's,
    every element written, two runs bit-identical."""
    q, k, v, g, beta, do, dht, h0, cu, l2 = case
    with toolkit.poisoned_outputs():
        got, again, base = run(variant), run(variant), run(baseline)
    want = chunk_gated_delta_rule_bwd_ref(_d(q), _d(k), _d(v), _d(g), _d(beta), _d(do), _d(dht),
                                          initial_state=_d(h0), use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    for label, x, ref, x2, xb in zip(NAMES, got, want, again, base):
        if ref is None:
            assert x is None, label
            continue
        assert not x.isnan().any(), f"{name}: {label} has an unwritten (NaN) element"
        assert _ratio(x, ref) <= RMSE_RATIO[label], f"{name}: {label} RMSE ratio {_ratio(x, ref):.2e}"
        assert _ratio(x, xb) <= RMSE_RATIO[label], f"{name}: {label} {what} {_ratio(x, xb):.2e}"
        assert torch.equal(x, x2), f"{name}: two runs differ in {label}: {_where_differs(x, x2, cu)}"


@pytest.mark.parametrize("name,segment_chunks", [("qwen_layout_l2norm_varlen", 2), ("ragged_gva2_l2norm_padded_tail", 1),
                                                  ("dense_gva4_T200_no_dht", 1), ("gva1_fp16_l2norm_no_h0", 1),
                                                  ("dim256_gva1", 1)])
def test_context_parallel_backward_matches_float64_reference(name, segment_chunks):
    """Sequences split into segments (the sequential stages per segment, the state gradient carried back across
    them by the segment maps) give the reference's gradients, deterministically; the split changes only where the
    carried gradient is rounded (bf16 scan operands)."""
    case = q, k, v, g, beta, do, dht, h0, cu, l2 = _case(name)

    def run(segments):
        return backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=l2, segment_chunks=segments)

    _check_variant(name, case, run, segment_chunks, 0, "split vs whole")


@pytest.mark.parametrize("name,segment_chunks", [(n, None) for n in sorted(CASES)]
                         + [("qwen_layout_l2norm_varlen", 2), ("ragged_gva2_l2norm_padded_tail", 1)])
def test_states_saved_by_the_forward_give_the_reference_gradients(name, segment_chunks):
    """The backward on the states the forward saved (``save_states``: h and v_new written by the forward's own
    step, split into segments as the forward's plan splits them, and its kkt_solve's gamma and Ag) against the backward that recomputes them and the
    float64 reference; saving leaves the forward's outputs bit-identical."""
    case = q, k, v, g, beta, do, dht, h0, cu, l2 = _case(name)

    def fwd(save):
        return forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                                                  segment_chunks=segment_chunks, save_states=save)

    with toolkit.poisoned_outputs():
        o, ht, *_ = fwd(True)
        o_plain, ht_plain = fwd(False)
    assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain), f"{name}: saving the states changed the forward"

    def run(choice):
        states = fwd(True)[2:] if choice == "saved" else None
        return backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=l2, segment_chunks=segment_chunks,
                                                   states=states)

    _check_variant(name, case, run, "saved", "recomputed", "saved vs recomputed states")


@pytest.mark.parametrize("name,segment_chunks", [
    ("qwen_layout_l2norm_varlen", None), ("ragged_gva2_l2norm_padded_tail", 1), ("gva1_fp16_l2norm_no_h0", 1),
    ("dim64_l2norm", None), ("dense_gva4_T200_no_dht", None)])
def test_grouped_and_per_value_head_paths_give_the_reference_gradients(name, segment_chunks, monkeypatch):
    """The whole backward on the grouped kernels (``bwd_dqkwg.KERNEL = "group"``: dq and dk summed per key head on
    chip, the grouped WY kernel finishing dk) against the per-value-head path (the per-K-block dqkwg, WY and the GVA
    pass) and the float64 reference."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dqkwg

    case = q, k, v, g, beta, do, dht, h0, cu, l2 = _case(name)

    def run(choice):
        monkeypatch.setattr(bwd_dqkwg, "KERNEL", choice)
        return backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=l2, segment_chunks=segment_chunks)

    _check_variant(name, case, run, "group", "blocked", "grouped vs per-value-head path")


WALK_CASES = [(n, None) for n in sorted(CASES) if CASES[n][2] <= 128 and CASES[n][3] <= 128] + [
    ("qwen_layout_l2norm_varlen", 2), ("ragged_gva2_l2norm_padded_tail", 1), ("gva1_fp16_l2norm_no_h0", 1)]


@pytest.mark.parametrize("kernel", ["plain", "ws"])
@pytest.mark.parametrize("name,segment_chunks", WALK_CASES)
def test_fused_walk_gives_the_reference_gradients(name, segment_chunks, kernel, monkeypatch):
    """The fused walk (``backward.WALK``: dh, dqkwg and WY in one walk per (walk, value head)), each of
    ``bwd_walk.KERNELS``' kernels, on the states the forward saved, against the staged kernels on the same states and
    the float64 reference: FLA's tolerances, every element written, two runs bit-identical; whole sequences and split
    into segments."""
    monkeypatch.setattr(bwd_walk, "KERNEL", kernel)
    case = q, k, v, g, beta, do, dht, h0, cu, l2 = _case(name)
    states = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                                                segment_chunks=segment_chunks, save_states=True)[2:]

    def run(walk):
        monkeypatch.setattr(backward, "WALK", walk)
        return backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=l2, segment_chunks=segment_chunks,
                                                   states=states)

    _check_variant(name, case, run, True, False, "fused walk vs staged")


class _Stages:
    """The float64 stage references of one case, and the kernel-side tables and tensors of its inputs."""

    def __init__(self, name):
        from flashqla_kernels.gated_delta_rule import checks
        from flashqla_kernels.gated_delta_rule.hopper import kkt_solve, plan

        q, k, v, g, beta, do, dht, h0, cu, l2 = _case(name)
        self.raw_q, self.raw_k, self.dtype, self.Hk = q, k, q.dtype, q.shape[2]
        qd, kd = _d(q), _d(k)
        qn, kn = (l2norm(qd), l2norm(kd)) if l2 else (qd, kd)
        self.scale = q.shape[-1] ** -0.5
        fwd = chunk_bwd_recompute_ref(kn, _d(v), _d(g), _d(beta), _d(h0), cu)
        dv_local = chunk_bwd_dv_local_ref(qn, kn, _d(do), fwd.gamma, self.scale, cu)
        dh, dv, dh0 = chunk_bwd_dh_ref(qn, kn, fwd.w, _d(do), dv_local, fwd.gamma, self.scale, _d(dht), cu)
        dq, dk, dw, dgam = chunk_bwd_dqkwg_ref(qn, kn, fwd.v_new, fwd.w, fwd.h, dh, _d(do), dv, fwd.gamma,
                                               self.scale, cu)
        wy = chunk_bwd_wy_ref(kn, _d(v), _d(beta), fwd.A, fwd.gamma, dw, dv, cu)
        self.ref = dict(fwd=fwd, dh=dh, dv=dv, dh0=dh0, dq=dq, dk=dk, dw=dw, dgam=dgam, wy=wy,
                        dg=chunk_local_cumsum_bwd_ref(dgam + wy[3], cu), qn=qn)
        self.n = int(cu[-1]) if cu is not None else q.shape[1]
        self.cu = cu
        pl = plan.make_bwd_plan(tuple(checks.host_offsets(cu)), 0, q.device)
        self.chunks, self.seqs = pl.chunks, pl.walks
        flat = (lambda x, dt=None: x[0].to(dt or x.dtype).contiguous())
        self.q, self.k = flat(qn, self.dtype), flat(kn, self.dtype)
        self.v, self.do = flat(v), flat(do.to(self.dtype))
        self.g, self.beta = flat(g, torch.float32), flat(beta, torch.float32)
        self.h0 = None if h0 is None else h0.float().contiguous()
        self.dht = None if dht is None else dht.float().contiguous()
        self.gamma, self.ag, _ = kkt_solve.kkt_solve(self.k, self.g, self.beta, self.chunks, v.shape[2])
        self.flat = flat

    def check(self, label, x, ref, tol=STAGE_RATIO):
        """Tokens (or chunks) of every sequence only: a padded tail is never written."""
        x = x[:self.n] if x.shape[0] >= self.n and ref.shape[0] >= self.n else x
        ref = ref[:self.n] if ref.shape[0] >= self.n else ref
        assert not x.isnan().any(), f"{label}: an unwritten (NaN) element"
        assert _ratio(x, ref) <= tol, f"{label}: RMSE ratio {_ratio(x, ref):.2e}"


STAGE_CASES = ["ragged_gva2_l2norm_padded_tail", "dim64_l2norm", "dim256_gva1"]


@pytest.mark.parametrize("name", STAGE_CASES)
def test_states_stage_matches_its_reference(name):
    """h and v_new recomputed on the forward's step over the forward's plan, split into segments as the forward
    splits (the maps, the scan, the segments walked at once) and whole."""
    from flashqla_kernels.gated_delta_rule import checks
    from flashqla_kernels.gated_delta_rule.hopper import plan

    s = _Stages(name)
    cu = checks.host_offsets(s.cu)
    Hv, K, V = s.v.shape[1], s.k.shape[2], s.v.shape[2]
    bdv = min(V, 32 if K > 128 else 64)
    for L in (0, 1):
        fpl = plan.make_plan(cu, Hv, V // bdv, s.h0 is not None, s.k.device, L)
        with toolkit.poisoned_outputs():
            h, v_new = backward.recompute_states(s.k, s.v, s.ag, s.gamma, s.beta, s.h0, s.chunks.shape[0], fpl, bdv)
        split = f"segments of {L} chunk" if L else "whole sequences"
        s.check(f"h ({split})", h, s.ref["fwd"].h[0])
        s.check(f"v_new ({split})", v_new, s.ref["fwd"].v_new[0])


@pytest.mark.parametrize("name", STAGE_CASES)
def test_dh_stage_matches_its_reference(name):
    """The dh walk against the float64 stage reference, every element written, two runs bit-identical."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dh

    s = _Stages(name)

    def run():
        return bwd_dh.bwd_dh(s.q, s.k, s.do, s.ag, s.gamma, s.dht, s.seqs, s.chunks.shape[0], scale=s.scale,
                             store_dh0=True)

    with toolkit.poisoned_outputs():
        (dh, dv, dh0), again = run(), run()
    s.check("dh", dh, s.ref["dh"][0])
    s.check("dv", dv, s.ref["dv"][0])
    s.check("dh0", dh0, s.ref["dh0"])
    # dv's rows of a padded tail stay NaN-poisoned in both runs (no sequence owns them): compared as equal
    for label, x, x2 in zip(("dh", "dv", "dh0"), (dh, dv, dh0), again):
        assert torch.equal(x.nan_to_num(), x2.nan_to_num()) and torch.equal(x.isnan(), x2.isnan()), \
            f"{name}: two runs differ in {label}"


@pytest.mark.parametrize("name", STAGE_CASES)
def test_dqkwg_stage_matches_its_reference(name):
    """The per-K-block dqkwg kernel against the float64 stage reference, every element written, two runs
    bit-identical."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dqkwg

    s = _Stages(name)
    r, f = s.ref, s.flat

    def run():
        return bwd_dqkwg.bwd_dqkwg(s.q, s.k, f(r["fwd"].v_new, s.dtype), s.do, f(r["dv"], s.dtype),
                                   f(r["fwd"].h, s.dtype), f(r["dh"], s.dtype), s.gamma, s.chunks, scale=s.scale)

    with toolkit.poisoned_outputs():
        (dq, dk, dw, dgp), again = run(), run()
    for label, x, x2 in zip(("dq", "dk", "dw", "dgp"), (dq, dk, dw, dgp), again):
        assert torch.equal(x.nan_to_num(), x2.nan_to_num()) and torch.equal(x.isnan(), x2.isnan()), \
            f"{name}: two runs differ in {label}"
    for label, x, ref in (("dq", dq, r["dq"]), ("dk", dk, r["dk"]), ("dw", dw, r["dw"])):
        s.check(label, x, ref[0])
    s.check("dgamma", dgp[:, :s.n].sum(0), r["dgam"][0], tol=0.02)


@pytest.mark.parametrize("name", [n for n in STAGE_CASES if CASES[n][2] <= 128])
def test_grouped_dqkwg_stage_matches_its_reference(name):
    """The grouped kernel (one CTA per chunk and key head) against the float64 stage reference summed over each key
    head's value heads, with the l2norm backward applied to dq, every element written, two runs bit-identical."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dqkwg, chunk_bwd

    s = _Stages(name)
    r, f = s.ref, s.flat
    l2 = CASES[name][6].get("l2norm", False)
    norm = dict(xq=f(s.raw_q), rq=chunk_bwd.l2norm_fwd(f(s.raw_q), s.chunks)[1]) if l2 else {}

    def run():
        return bwd_dqkwg.bwd_dqkwg_group(s.q, s.k, f(r["fwd"].v_new, s.dtype), s.do, f(r["dv"], s.dtype),
                                         f(r["fwd"].h, s.dtype), f(r["dh"], s.dtype), s.gamma, s.chunks,
                                         scale=s.scale, **norm)

    with toolkit.poisoned_outputs():
        (dq, dk, dw, dgp), again = run(), run()
    for label, x, x2 in zip(("dq", "dk", "dw", "dgp"), (dq, dk, dw, dgp), again):
        assert torch.equal(x.nan_to_num(), x2.nan_to_num()) and torch.equal(x.isnan(), x2.isnan()), \
            f"{name}: two runs differ in {label}"
    dq_ref = gva_reduce_ref(r["dq"], s.Hk)
    s.check("dq", dq, (l2norm_bwd_ref(_d(s.raw_q), dq_ref) if l2 else dq_ref)[0])
    s.check("dk", dk, gva_reduce_ref(r["dk"], s.Hk)[0])
    s.check("dw", dw, r["dw"][0])
    s.check("dgamma", dgp[:, :s.n].sum(0), r["dgam"][0], tol=0.02)


@pytest.mark.parametrize("name", STAGE_CASES)
def test_wy_stage_and_the_reverse_cumsum_match_their_references(name):
    from flashqla_kernels.gated_delta_rule.hopper import bwd_wy

    s = _Stages(name)
    r, f = s.ref, s.flat
    K = s.k.shape[-1]
    # dqkwg's partial dgamma: the reference's, all in the first K block
    dgp = torch.zeros(K // 64, *s.gamma.shape, device=s.k.device)
    dgp[0] = f(r["dgam"], torch.float32)
    with toolkit.poisoned_outputs():
        dk, dv, dbeta, dgamma, dg = bwd_wy.bwd_wy(s.k, s.v, s.beta, s.gamma, s.ag, f(r["dw"], s.dtype),
                                                  f(r["dv"], s.dtype), dgp, s.chunks)
    dk_r, dv_r, dbeta_r, dgamma_r = r["wy"]
    s.check("dk", dk, dk_r[0])
    s.check("dv", dv, dv_r[0])
    s.check("dbeta", dbeta, dbeta_r[0], tol=0.02)
    s.check("dgamma", dgamma, dgamma_r[0], tol=0.02)
    s.check("dg", dg, r["dg"][0], tol=0.02)


@pytest.mark.parametrize("name", [n for n in STAGE_CASES if CASES[n][2] <= 128 and CASES[n][3] <= 128])
def test_grouped_wy_stage_finishes_dk(name):
    """The grouped WY kernel (one CTA per chunk and key head): dk summed over the value heads with the grouped
    dqkwg's part and the l2norm backward, dv, dbeta, dgamma and dg, against the float64 references."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_wy, chunk_bwd

    s = _Stages(name)
    r, f = s.ref, s.flat
    l2 = CASES[name][6].get("l2norm", False)
    norm = (f(s.raw_k), chunk_bwd.l2norm_fwd(f(s.raw_k), s.chunks)[1]) if l2 else ()
    dgp = torch.zeros(2, *s.gamma.shape, device=s.k.device)
    dgp[0] = f(r["dgam"], torch.float32)
    dk_part = f(gva_reduce_ref(r["dk"], s.Hk), torch.float32)
    with toolkit.poisoned_outputs():
        # a padded tail's rows of dw and du are zero, as the launcher leaves them
        dw, du = f(r["dw"], s.dtype), f(r["dv"], s.dtype)
        dw[s.n:], du[s.n:] = 0, 0
        dk, dv, dbeta, dgamma, dg = bwd_wy.bwd_wy_group(s.k, s.v, s.beta, s.gamma, s.ag, dw, du, dgp, dk_part,
                                                        s.chunks, *norm)
    dk_r, dv_r, dbeta_r, dgamma_r = r["wy"]
    dy = gva_reduce_ref(r["dk"] + dk_r, s.Hk)
    s.check("dk", dk, (l2norm_bwd_ref(_d(s.raw_k), dy) if l2 else dy)[0])
    s.check("dv", dv, dv_r[0])
    s.check("dbeta", dbeta, dbeta_r[0], tol=0.02)
    s.check("dgamma", dgamma, dgamma_r[0], tol=0.02)
    s.check("dg", dg, r["dg"][0], tol=0.02)


@pytest.mark.parametrize("name", ["ragged_gva2_l2norm_padded_tail", "dim64_l2norm"])
def test_gva_reduction_and_l2norm_backward_match_their_references(name):
    from flashqla_kernels.gated_delta_rule.hopper import chunk_bwd

    s = _Stages(name)
    r, f = s.ref, s.flat
    with toolkit.poisoned_outputs():
        qn, rq = chunk_bwd.l2norm_fwd(f(s.raw_q), s.chunks)
        _, rk = chunk_bwd.l2norm_fwd(f(s.raw_k), s.chunks)
        dq = chunk_bwd.gva_bwd(f(r["dq"], torch.float32), None, s.chunks, s.Hk, s.dtype, f(s.raw_q), rq)
        # two sources (dk's dqkwg and WY parts): here dqkwg's dq and dk stand in for them
        dk = chunk_bwd.gva_bwd(f(r["dq"], torch.float32), f(r["dk"], torch.float32), s.chunks, s.Hk, s.dtype,
                               f(s.raw_k), rk)
    s.check("qn", qn, r["qn"][0], tol=STAGE_RATIO)
    s.check("dq", dq, l2norm_bwd_ref(_d(s.raw_q), gva_reduce_ref(r["dq"], s.Hk))[0])
    s.check("dq + dk", dk, l2norm_bwd_ref(_d(s.raw_k), gva_reduce_ref(r["dq"] + r["dk"], s.Hk))[0])


def _public_grads(fn, case, strided=False):
    """Gradients of <o, do> + <final state, dht> through ``fn`` (the public op's signature), and o. ``strided``:
    "strided_qk" (q and k as slices of one fused projection) or "channels_first" (q, k, v as channel slices of one
    [B, C, T] buffer, as transformers' layer passes them)."""
    q, k, v, g, beta, do, dht, h0, cu, l2 = case
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    qq, kk, vv = leaves[0], leaves[1], leaves[2]
    if strided == "strided_qk":
        qk = torch.cat([leaves[0], leaves[1]], dim=-1)
        qq, kk = qk[..., :q.shape[-1]], qk[..., q.shape[-1]:]
    elif strided == "channels_first":
        buf = torch.cat([x.flatten(2) for x in leaves[:3]], dim=-1).transpose(1, 2).contiguous()
        parts = torch.split(buf.transpose(1, 2), [x[0, 0].numel() for x in (q, k, v)], dim=-1)
        qq, kk, vv = (p.reshape(x.shape) for p, x in zip(parts, (q, k, v)))
    o, ht = fn(qq, kk, vv, *leaves[3:5], initial_state=leaves[5], output_final_state=True,
               use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    torch.autograd.backward((o, ht), (do, dht))
    return o, [x.grad for x in leaves]


@pytest.mark.parametrize("strided", [False, "strided_qk", "channels_first"],
                         ids=["contiguous", "strided_qk", "channels_first"])
def test_public_op_under_grad_runs_the_backward_kernels_at_fla_tolerances(strided, monkeypatch):
    from flashqla_kernels import chunk_gated_delta_rule, explain_backend

    launches = []
    bwd = backward.chunk_gated_delta_rule_bwd
    monkeypatch.setattr(backward, "chunk_gated_delta_rule_bwd", lambda *a, **kw: launches.append(1) or bwd(*a, **kw))

    case = _case("ragged_gva2_l2norm_padded_tail")
    q, k, v, g, beta, do, dht, h0, cu, l2 = case
    assert explain_backend(q.requires_grad_(), k, v, g, beta, initial_state=h0, cu_seqlens=cu).startswith(
        "chunk_gated_delta_rule: backend tilelang")
    q.requires_grad_(False)
    o, grads = _public_grads(chunk_gated_delta_rule, case, strided)
    assert len(launches) == 1, "the backward did not run on the Hopper kernels"
    want = chunk_gated_delta_rule_bwd_ref(_d(q), _d(k), _d(v), _d(g), _d(beta), _d(do), _d(dht),
                                          initial_state=_d(h0), use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    for label, x, ref, like in zip(NAMES, grads, want, (q, k, v, g, beta, h0)):
        assert x is not None and x.dtype == like.dtype and x.shape == like.shape, label
        assert not x.isnan().any(), label
        assert _ratio(x, ref) <= RMSE_RATIO[label], f"{label}: RMSE ratio {_ratio(x, ref):.2e}"
    _, again = _public_grads(chunk_gated_delta_rule, case, strided)
    for label, x, x2 in zip(NAMES, grads, again):
        assert torch.equal(x, x2), f"two runs differ in {label}: {_where_differs(x, x2, case[8])}"


def test_public_op_compiles_with_torch_compile_and_passes_opcheck():
    from flashqla_kernels import chunk_gated_delta_rule

    case = _case("ragged_gva2_l2norm_padded_tail")
    q, k, v, g, beta, do, dht, h0, cu, l2 = case

    def step(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                       output_final_state=output_final_state,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
        return o * 1.5, ht

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    o_c, grads_c = _public_grads(compiled, case)
    o_e, grads_e = _public_grads(step, case)
    torch.testing.assert_close(o_c, o_e)
    for label, x_c, x_e in zip(NAMES, grads_c, grads_e):
        assert torch.equal(x_c, x_e), f"compiled and eager {label} differ"
    torch._dynamo.reset()
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    for save_states in (False, True):
        torch.library.opcheck(torch.ops.flashqla_kernels.chunk_gated_delta_rule.default,
                              (*xs[:5], xs[5], cu, q.shape[-1] ** -0.5, True, l2, save_states))


@pytest.mark.parametrize("name,segment_chunks", [("ragged_gva2_l2norm_padded_tail", 1), ("dense_gva4_T200_no_dht", None)])
def test_grouped_backward_stages_are_bit_reproducible(name, segment_chunks):
    """Each stage of the grouped path, run 16 times on the same inputs, gives bit-identical outputs on the rows it
    writes, and so does the whole launcher on fresh poisoned buffers. Two runs of the whole backward have differed in
    dg only, on each of these cases, while every stage alone repeated exactly: a failure names the rows."""
    from flashqla_kernels.gated_delta_rule import checks
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dh, bwd_dqkwg, bwd_wy, chunk_bwd, kkt_solve, plan

    q, k, v, g, beta, do, dht, h0, cu, l2 = _case(name)
    B, Tn, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    offsets = list(range(0, B * Tn + 1, Tn)) if cu is None else checks.host_offsets(cu)
    seq_chunks = [-(-(e - s) // plan.CHUNK) for s, e in zip(offsets, offsets[1:])]
    sms = plan.num_sms(q.device)
    L = segment_chunks if segment_chunks is not None else plan.choose_bwd_segment_chunks(
        seq_chunks, Hv, V // bwd_dh.block_v(K, V), sms)
    pl = plan.make_bwd_plan(tuple(offsets), L, q.device)
    bdv = plan.block_dv(seq_chunks, Hv, K, V, sms, segment_chunks)
    fL = segment_chunks if segment_chunks is not None else plan.choose_segment_chunks(seq_chunks, Hv, V // bdv, sms)
    fpl = plan.make_plan(offsets, Hv, V // bdv, h0 is not None, q.device, fL)
    q3, k3 = (x.reshape(B * Tn, Hk, K).contiguous() for x in (q, k))
    v3, do3 = (x.reshape(B * Tn, Hv, V).contiguous() for x in (v, do))
    g3, b3 = (x.reshape(B * Tn, Hv).float().contiguous() for x in (g, beta))
    h0f = None if h0 is None else h0.float().contiguous()
    dhtf = None if dht is None else dht.float().contiguous()
    qn, kn, norms = q3, k3, {}
    if l2:
        (qn, rq), (kn, rk) = chunk_bwd.l2norm_fwd(q3, pl.chunks), chunk_bwd.l2norm_fwd(k3, pl.chunks)
        norms = dict(xq=q3, rq=rq)
    runs, rows = 16, B * Tn

    def written(x):  # a padded tail's token rows are in no chunk: no kernel writes them
        if x.shape[0] == rows:
            return x[:offsets[-1]]
        return x[:, :offsets[-1]] if x.dim() > 1 and x.shape[1] == rows else x

    def same(stage, fn):
        first = fn()
        for r in range(1, runs):
            again = fn()
            for i, (a, b) in enumerate(zip(first, again)):
                assert a is None or torch.equal(written(a), written(b)), \
                    f"{name}: {stage} output {i} differs in run {r}: {_where_differs(written(a), written(b))}"
        return first

    gamma, ag, _ = same("kkt_solve", lambda: kkt_solve.kkt_solve(kn, g3, b3, pl.chunks, Hv))
    h, v_new, dh, du, _ = same("sequential stages", lambda: backward.sequential_stages(
        qn, kn, v3, do3, ag, gamma, b3, h0f, dhtf, pl, K ** -0.5, fpl, bdv))
    _, dk_k, dw, dgp = same("grouped dqkwg", lambda: bwd_dqkwg.bwd_dqkwg_group(
        qn, kn, v_new, do3, du, h, dh, gamma, pl.chunks, scale=K ** -0.5, **norms))
    if offsets[-1] < B * Tn:
        dw[offsets[-1]:], du[offsets[-1]:] = 0, 0
    same("grouped WY", lambda: bwd_wy.bwd_wy_group(kn, v3, b3, gamma, ag, dw, du, dgp, dk_k, pl.chunks,
                                                   *((k3, rk) if l2 else ())))
    # then the whole launcher, stages back to back on fresh NaN-poisoned buffers, as users run it
    with toolkit.poisoned_outputs():
        same("whole backward", lambda: backward.chunk_gated_delta_rule_bwd(
            q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2,
            segment_chunks=segment_chunks))
