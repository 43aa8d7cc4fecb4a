"""The Hopper backward's launcher logic on CPU (``backward`` and ``plan.make_bwd_plan``), with every kernel replaced
by a float64 torch emulation of its contract (the same tables, rows and arguments; the forward's segment maps and
scan as ``test_hopper_forward`` emulates them, the chunk-parallel stages through their ``reference_bwd`` stage
references): context parallelism (segments walked at once, the state and its gradient carried across segments by
the segment maps) gives exactly the whole-sequence walks, and the launcher composes the stages into
``chunk_gated_delta_rule_bwd_ref``'s gradients. The kernels themselves are checked against the float64 reference on
a GPU (``test_hopper_bwd_gpu.py``)."""
from __future__ import annotations

import pytest
import torch

from flashqla_kernels.gated_delta_rule import reference, reference_bwd
from flashqla_kernels.gated_delta_rule.hopper import backward, plan
from tests.flashqla_kernels.test_hopper_forward import _torch_kkt_solve, _torch_segment_states, _torch_state_scan

pytest.importorskip("tilelang")  # the stage modules import it; their kernels are replaced below

C = plan.CHUNK


def _chunks(s, e):
    return [(c, min(c + C, e)) for c in range(s, e, C)]


def _step(k, v, x, gm, S):
    """One chunk of the state walk: (v_new, the state leaving it)."""
    n = k.shape[0]
    w = v - gm.exp()[:, None] * (k @ S)
    vn = x[:, :n] @ w
    return vn, gm[-1].exp() * S + k.T @ ((gm[-1] - gm).exp()[:, None] * vn)


def _states(k, v, ag, gamma, h0, walks, num_chunks):
    T, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    h = torch.full((num_chunks, Hv, K, V), float("nan"), dtype=k.dtype)
    v_new = torch.full((T, Hv, V), float("nan"), dtype=k.dtype)
    for w, (s, e, c0) in enumerate(walks.tolist()):
        for hv in range(Hv):
            S = h0[w, hv].to(k.dtype) if h0 is not None else torch.zeros(K, V, dtype=k.dtype)
            for i, (cs, ce) in enumerate(_chunks(s, e)):
                h[c0 + i, hv] = S
                v_new[cs:ce, hv], S = _step(k[cs:ce, hv * Hk // Hv], v[cs:ce, hv], ag[cs:ce, hv], gamma[cs:ce, hv], S)
    return h, v_new


def _chunk_states(k, v, ag, gamma, beta, h_init, segs, seg_chunk0, num_chunks, *, bDV):
    """``chunk_fwd.chunk_states``' contract: the forward plan's segments, each from its ``h_init`` row (or zeros)."""
    walks = torch.tensor([(s, e, c0) for (s, e, _, _), c0 in zip(segs.tolist(), seg_chunk0.tolist())])
    inits = [init for _, _, init, _ in segs.tolist()]
    starts = torch.stack([h_init[i] if i >= 0 else torch.zeros_like(h_init[0]) for i in inits])
    return _states(k, v, ag, gamma, starts, walks, num_chunks)


def _dh(q, k, do, ag, gamma, dht, walks, num_chunks, *, scale, store_dh0, store_grads=True):
    T, Hk, K = k.shape
    Hv, V = do.shape[1], do.shape[2]
    dh = torch.full((num_chunks, Hv, K, V), float("nan"), dtype=k.dtype)
    dv = torch.full((T, Hv, V), float("nan"), dtype=k.dtype)
    dh0 = torch.full((walks.shape[0], Hv, K, V), float("nan"), dtype=k.dtype)
    for w, (s, e, c0) in enumerate(walks.tolist()):
        for hv in range(Hv):
            dS = dht[w, hv].to(k.dtype) if dht is not None else torch.zeros(K, V, dtype=k.dtype)
            for i, (cs, ce) in reversed(list(enumerate(_chunks(s, e)))):
                qq, kk, gm, x = q[cs:ce, hv * Hk // Hv], k[cs:ce, hv * Hk // Hv], gamma[cs:ce, hv], ag[cs:ce, hv]
                n = ce - cs
                dh[c0 + i, hv] = dS
                gate = torch.triu(torch.ones(n, n, dtype=k.dtype)) * (gm[None, :] - gm[:, None]).clamp(max=0).exp()
                d = (gm[-1] - gm).exp()[:, None] * (kk @ dS) + (scale * (kk @ qq.T) * gate) @ do[cs:ce, hv]
                dv[cs:ce, hv] = d
                dS = (gm[-1].exp() * dS + scale * (gm.exp()[:, None] * qq).T @ do[cs:ce, hv]
                      - kk.T @ (gm.exp()[:, None] * (x[:, :n].T @ d)))
            dh0[w, hv] = dS
    return (dh, dv, dh0 if store_dh0 else None) if store_grads else (None, None, dh0)


def _bwd_scan(dht, cs, ms, mstart, rscan, num_segs):
    Hv, K, V = ms.shape[1], ms.shape[2], cs.shape[3]
    d_end = torch.full((num_segs, Hv, K, V), float("nan"), dtype=ms.dtype)
    for n, (first, count, first_c) in enumerate(rscan.tolist()):
        dS = dht[n].to(ms.dtype) if dht is not None else torch.zeros(Hv, K, V, dtype=ms.dtype)
        for j in range(count - 1, 0, -1):
            d_end[first + j] = dS
            needed = (mstart[first + j] < 0).to(ms.dtype)[:, None, None]
            dS = needed * (ms[first + j].transpose(-1, -2) @ dS) + cs[first_c + j - 1]
        d_end[first] = dS
    return d_end


@pytest.fixture
def emulated_stages(monkeypatch):
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dh, chunk_fwd, segment_states, state_scan

    monkeypatch.setattr(chunk_fwd, "chunk_states", _chunk_states)
    monkeypatch.setattr(bwd_dh, "bwd_dh", _dh)
    monkeypatch.setattr(segment_states, "segment_states", _torch_segment_states)
    monkeypatch.setattr(state_scan, "state_scan", _torch_state_scan)
    monkeypatch.setattr(state_scan, "state_scan_bwd", _bwd_scan)


def _inputs(lens, Hk=1, Hv=2, K=4, V=3, pad=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens) + pad
    q, k = (torch.nn.functional.normalize(torch.randn(T, Hk, K, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v, do = (torch.randn(T, Hv, V, generator=gen, dtype=torch.float64) for _ in range(2))
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    g = -torch.rand(T, Hv, generator=gen, dtype=torch.float64) / 4
    beta = torch.rand(T, Hv, generator=gen, dtype=torch.float64)
    # the gated inverse of these keys and gates (unit-norm keys, beta <= 1): the segment maps' decay shortcut holds
    chunks = torch.tensor([c for s, e in zip(cu, cu[1:]) for c in _chunks(s, e)], dtype=torch.int32)
    gamma, ag, _ = _torch_kkt_solve(k, g, beta, chunks, Hv)
    N = len(lens)
    h0 = torch.randn(N, Hv, K, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(N, Hv, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, do, ag, gamma, beta, h0, dht, tuple(cu)


@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
@pytest.mark.parametrize("with_h0,with_dht", [(True, True), (False, True), (True, False)])
def test_context_parallel_walks_equal_whole_sequence_walks(emulated_stages, segment_chunks, with_h0, with_dht):
    # lengths: one chunk, several, a ragged tail, length 1, and one split into many segments
    q, k, v, do, ag, gamma, beta, h0, dht, cu = _inputs([64, 1, 200, 130, 520], Hk=1, Hv=2)
    h0, dht = (h0 if with_h0 else None), (dht if with_dht else None)

    def run(states_L, dh_L):
        # the states recomputed over the forward's plan (its own split), the dh walk over the backward's
        fpl = plan.make_plan(list(cu), v.shape[1], 1, h0 is not None, torch.device("cpu"), states_L)
        pl = plan.make_bwd_plan(cu, dh_L, torch.device("cpu"))
        return backward.sequential_stages(q, k, v, do, ag, gamma, beta, h0, dht, pl, 0.5, fpl, v.shape[2])

    whole = run(0, 0)
    assert plan.make_bwd_plan(cu, segment_chunks, torch.device("cpu")).walks.shape[0] > len(cu) - 1
    for other in (run(segment_chunks, segment_chunks), run(0, segment_chunks), run(segment_chunks, 0)):
        for label, a, b in zip(("h", "v_new", "dh", "dv", "dh0"), whole, other):
            if label == "dh0" and h0 is None:
                assert a is None and b is None
                continue
            n = cu[-1] if label in ("v_new", "dv") else a.shape[0]
            assert not b[:n].isnan().any(), f"{label}: an element no walk wrote"
            # float64 throughout: what differs is only the maps' decay shortcut, terms below exp(-20) of the state
            torch.testing.assert_close(b[:n], a[:n], rtol=1e-7, atol=1e-7, msg=f"{label} differs")


def test_backward_plan_tables():
    pl = plan.make_bwd_plan((0, 64, 65, 265), 2, torch.device("cpu"))
    # chunks of each sequence in order; segments of 2 chunks; walks (start, end, first chunk)
    assert pl.chunks.tolist() == [[0, 64], [64, 65], [65, 129], [129, 193], [193, 257], [257, 265]]
    assert pl.walks.tolist() == [[0, 64, 0], [64, 65, 1], [65, 193, 2], [193, 265, 4]]
    assert pl.maps.tolist() == [[0, 64], [64, 65], [65, 193], [193, 265]]
    assert pl.rest.tolist() == [[193, 265, 4]] and pl.rscan.tolist() == [[0, 1, 0], [1, 1, 0], [2, 2, 0]]
    assert pl.first.tolist() == [0, 1, 2]
    whole = plan.make_bwd_plan((0, 64, 65, 265), 0, torch.device("cpu"))
    assert whole.segment_chunks == 0 and whole.maps is None and whole.walks.tolist() == [[0, 64, 0], [64, 65, 1],
                                                                                         [65, 265, 2]]


@pytest.mark.parametrize("seq_chunks,Hv,want", [
    ([128], 32, 0),           # 16/32 8192x1: 64 walks, half the SMs: whole
    ([512], 32, 0),           # 16/32 32768x1: the same walks, 4x longer: still whole
    ([512], 16, 128),         # 16/16 32768x1: 32 walks -> 4 segments each
    ([512], 8, 64),           # 4/8 32768x1: 16 walks -> 8 segments each
    ([64] * 8, 32, 0),        # 4096x8: 512 walks fill the SMs twice
    ([16], 8, 0),             # short: no segment shorter than the minimum
])
def test_backward_split_rule(seq_chunks, Hv, want):
    assert plan.choose_bwd_segment_chunks(seq_chunks, Hv, 2, 132) == want


@pytest.mark.parametrize("seq_chunks,Hv,walk", [
    ([128], 32, True),        # 16/32 8192x1: 32 walks, split 4 ways (a tie between runs)
    ([512], 32, True),        # 16/32 32768x1: the walk measured faster
    ([64] * 8, 32, True),     # 16/32 4096x8: 256 walks, whole
    ([512], 8, False),        # 4/8 32768x1: 8 walks would be cut 16 ways; the stages measured faster
    ([64] * 2, 16, True),     # the 2B layer's micro-batch, 16/16 2 x 4096
    ([64] * 2, 4, False),     # 8 walks
])
def test_backward_walk_rule(seq_chunks, Hv, walk):
    assert plan.walk_pays(seq_chunks, Hv, 132) is walk
    assert plan.walk_pays(seq_chunks, Hv, 0)  # no GPU to fill: the walk, whose float64 step the CPU tests check


def test_launcher_picks_the_walk_by_the_rule_unless_forced(emulated_backward, monkeypatch):
    """``WALK`` None follows ``plan.walk_pays``; True and False force either path."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_walk

    class WalkRan(Exception):
        pass

    def walk(*a, **kw):
        raise WalkRan

    q, k, v, g, beta, do, h0, dht, cu, _ = _launcher_case(0, False, 4, 3, 1, 2)
    monkeypatch.setattr(bwd_walk, "bwd_walk", walk)
    for setting, pays, want in ((None, True, "walk"), (None, False, "staged"), (True, False, "walk"),
                                (False, True, "staged")):
        monkeypatch.setattr(backward, "WALK", setting)
        monkeypatch.setattr(plan, "walk_pays", lambda *a, p=pays: p)
        try:
            backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu)
            ran = "staged"
        except WalkRan:
            ran = "walk"
        assert ran == want, (setting, pays)


# The chunk-parallel stages, each on one chunk through its float64 stage reference (a lone chunk is one sequence).

def _one(x, cs, ce):
    return x[cs:ce][None]


def _kkt_solve(k, g, beta, chunks, Hv, q=None):
    gamma = torch.full_like(g, float("nan"))
    ag = torch.zeros(g.shape[0], Hv, C, dtype=k.dtype)
    for cs, ce in chunks.tolist():
        gamma[cs:ce] = g[cs:ce].cumsum(0)
        A = reference.kkt_inverse_ref(_one(k, cs, ce), _one(beta, cs, ce), gamma[cs:ce][None])[0]
        # X = A diag(beta): column j scaled by beta_j (columns past a tail chunk's length stay 0)
        ag[cs:ce] = A * torch.cat([beta[cs:ce], beta.new_zeros(C - (ce - cs), Hv)]).T[None]
    return gamma, ag, None


def _dqkwg(q, k, v_new, do, dv, h, dh, gamma, chunks, *, scale):
    # the kernels' shape contract: h and dh have one row per chunk
    assert h.shape[0] == dh.shape[0] == chunks.shape[0], (h.shape, dh.shape, chunks.shape)
    T, Hv, K = q.shape[0], v_new.shape[1], q.shape[2]
    dq, dk, dw = (torch.full((T, Hv, K), float("nan"), dtype=q.dtype) for _ in range(3))
    dgp = torch.zeros(K // 64 if K >= 64 else 1, T, Hv, dtype=q.dtype)
    for c, (cs, ce) in enumerate(chunks.tolist()):
        out = reference_bwd.chunk_bwd_dqkwg_ref(
            _one(q, cs, ce), _one(k, cs, ce), _one(v_new, cs, ce), torch.zeros(1, ce - cs, Hv, K, dtype=q.dtype),
            h[c][None, None], dh[c][None, None], _one(do, cs, ce), _one(dv, cs, ce), _one(gamma, cs, ce), scale)
        dq[cs:ce], dk[cs:ce], dw[cs:ce], dgp[0, cs:ce] = (x[0] for x in out)
    return dq, dk, dw, dgp


def _dqkwg_group(q, k, v_new, do, dv, h, dh, gamma, chunks, *, scale, xq=None, rq=None):
    Hk = q.shape[1]
    dq, dk, dw, dgp = _dqkwg(q, k, v_new, do, dv, h, dh, gamma, chunks, scale=scale)
    dq, dk = (reference_bwd.gva_reduce_ref(x[None], Hk)[0] for x in (dq, dk))
    if xq is not None:
        dq = reference_bwd.l2norm_bwd_ref(xq[None], dq[None])[0]
    return dq, dk, dw, torch.cat([dgp[:1], torch.zeros_like(dgp[:1])])


def _wy(k, v, beta, gamma, ag, dw, du, dgp, chunks):
    T, Hv, K = k.shape[0], v.shape[1], k.shape[2]
    dk = torch.full((T, Hv, K), float("nan"), dtype=k.dtype)
    dv = torch.full_like(v, float("nan"))
    dbeta, dgamma, dg = (torch.full((T, Hv), float("nan"), dtype=k.dtype) for _ in range(3))
    for cs, ce in chunks.tolist():
        A = reference.kkt_inverse_ref(_one(k, cs, ce), _one(beta, cs, ce), _one(gamma, cs, ce))
        out = reference_bwd.chunk_bwd_wy_ref(_one(k, cs, ce), _one(v, cs, ce), _one(beta, cs, ce), A,
                                             _one(gamma, cs, ce), _one(dw, cs, ce), _one(du, cs, ce))
        dk[cs:ce], dv[cs:ce], dbeta[cs:ce], dgamma[cs:ce] = (x[0] for x in out)
        dg[cs:ce] = (dgamma[cs:ce] + dgp[:, cs:ce].sum(0)).flip(0).cumsum(0).flip(0)
    return dk, dv, dbeta, dgamma, dg


def _l2norm_fwd(x, chunks):
    r = (x.pow(2).sum(-1) + 1e-6).rsqrt()
    return x * r[..., None], r


def _wy_group(k, v, beta, gamma, ag, dw, du, dgp, dk_part, chunks, xk=None, rk=None):
    # the grouped kernel reads whole tiles: the launcher must leave a padded tail's rows finite
    end = int(chunks[-1, 1])
    assert torch.isfinite(dw[end:]).all() and torch.isfinite(du[end:]).all(), "padded tail of dw / du not zeroed"
    dk, dv, dbeta, dgamma, dg = _wy(k, v, beta, gamma, ag, dw, du, dgp, chunks)
    dk = reference_bwd.gva_reduce_ref(dk[None], k.shape[1])[0] + dk_part
    if xk is not None:
        dk = reference_bwd.l2norm_bwd_ref(xk[None], dk[None])[0]
    return dk, dv, dbeta, dgamma, dg


def _gva(a, b, chunks, Hk, dtype, x=None, r=None):
    dy = reference_bwd.gva_reduce_ref((a if b is None else a + b)[None], Hk)[0]
    return dy if x is None else reference_bwd.l2norm_bwd_ref(x[None], dy[None])[0]


@pytest.fixture
def emulated_backward(emulated_stages, monkeypatch):
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dqkwg, bwd_wy, chunk_bwd, forward, kkt_solve

    monkeypatch.setattr(forward, "unsupported_reason", lambda *a: None)  # float64 CPU inputs into the launcher
    monkeypatch.setattr(backward, "WALK", False)  # the staged path (the fused walk's own test turns it on)
    monkeypatch.setattr(kkt_solve, "kkt_solve", _kkt_solve)
    monkeypatch.setattr(bwd_dqkwg, "bwd_dqkwg", _dqkwg)
    monkeypatch.setattr(bwd_dqkwg, "bwd_dqkwg_group", _dqkwg_group)
    monkeypatch.setattr(bwd_wy, "bwd_wy", _wy)
    monkeypatch.setattr(bwd_wy, "bwd_wy_group", _wy_group)
    monkeypatch.setattr(chunk_bwd, "l2norm_fwd", _l2norm_fwd)
    monkeypatch.setattr(chunk_bwd, "gva_bwd", _gva)


def _launcher_matches_reference(q, k, v, g, beta, do, dht, h0, cu, l2norm, segment_chunks):
    """The launcher's gradients against ``chunk_gated_delta_rule_bwd_ref``'s; returns them."""
    got = backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu,
                                              use_qk_l2norm_in_kernel=l2norm, segment_chunks=segment_chunks)
    want = reference_bwd.chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, initial_state=h0,
                                                        use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    for label, x, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert x.shape == ref.shape, label
        # the launcher hands the kernels g, beta and the states in fp32: agreement to fp32 rounding, where a wiring
        # mistake is off by O(1)
        torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5, msg=f"{label} differs from the reference")
    return got


def _launcher_case(seed, l2norm, K, V, Hk, Hv):
    """Ragged float64 inputs for the launcher tests (a length-1 sequence, a padded tail): (q, k, v, g, beta, do, h0,
    dht, cu, tokens in sequences); q and k unit rows unless the op normalises them."""
    gen = torch.Generator().manual_seed(seed)
    lens, pad = [1, 130, 64, 200], 5
    T = sum(lens) + pad
    rand = (lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64))
    q, k = rand(1, T, Hk, K), rand(1, T, Hk, K)
    if not l2norm:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v, do = rand(1, T, Hv, V), rand(1, T, Hv, V)
    g = torch.nn.functional.logsigmoid(rand(1, T, Hv)) / 4
    beta = torch.sigmoid(rand(1, T, Hv))
    h0, dht = rand(len(lens), Hv, K, V), rand(len(lens), Hv, K, V)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, do, h0, dht, cu, sum(lens)


@pytest.mark.parametrize("kernel", ["blocked", "group"])
@pytest.mark.parametrize("segment_chunks", [0, 1, 3])
@pytest.mark.parametrize("l2norm,K,V,Hk,Hv", [(True, 64, 64, 1, 2), (False, 48, 40, 2, 4)])
def test_launcher_composes_the_stages_into_the_reference_backward(emulated_backward, segment_chunks, l2norm, K, V,
                                                                  Hk, Hv, kernel, monkeypatch):
    """The launcher's wiring (l2norm, gamma and Ag, the walks with or without a split, dqkwg per value head or
    grouped per key head, WY, dg's partial sums, the GVA sum and l2norm backward, padded head dims, the padded
    tail) with every kernel replaced by its float64 stage reference gives ``chunk_gated_delta_rule_bwd_ref``'s
    gradients."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dqkwg

    monkeypatch.setattr(bwd_dqkwg, "KERNEL", kernel)
    q, k, v, g, beta, do, h0, dht, cu, _ = _launcher_case(3, l2norm, K, V, Hk, Hv)
    _launcher_matches_reference(q, k, v, g, beta, do, dht, h0, cu, l2norm, segment_chunks)


def test_grouped_wy_kernel_algebra_reproduces_the_reference_with_foreign_rows_in_its_tiles():
    """``bwd_wy.build_bwd_wy_group``'s steps in float64 on one ragged chunk whose whole tiles hold the next
    sequence's rows past the chunk's end (dw, du, v, X) and k's rows zeroed: the column scalings of dw K^T and
    du V^T, and the masks in dA and A alone keep those rows out of every gradient of the chunk's rows."""
    gen = torch.Generator().manual_seed(0)
    rand = (lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64))
    K, V, n = 32, 24, 45
    k = torch.nn.functional.normalize(rand(1, n, 1, K), dim=-1)
    v, dw, du = rand(1, n, 1, V), rand(1, n, 1, K), rand(1, n, 1, V)
    beta = torch.sigmoid(rand(1, n, 1))
    g = (torch.nn.functional.logsigmoid(rand(1, n, 1)) / 2).cumsum(1)
    A = reference.kkt_inverse_ref(k, beta, g)
    want = reference_bwd.chunk_bwd_wy_ref(k, v, beta, A, g, dw, du)

    foreign = (lambda x, w: torch.cat([x[0, :, 0], 3 * rand(C - n, w)]))
    k_sh = torch.cat([k[0, :, 0], torch.zeros(C - n, K, dtype=torch.float64)])
    dw_sh, du_sh, v_sh = foreign(dw, K), foreign(du, V), foreign(v, V)
    b = torch.cat([beta[0, :, 0], torch.zeros(C - n, dtype=torch.float64)])
    x_sh = torch.cat([A[0, :, 0] * b[None, :], rand(C - n, C)])  # X = A diag(beta), as kkt_solve writes it
    gam = torch.cat([g[0, :, 0], g[0, n - 1, 0].repeat(C - n)])
    e = gam.exp()
    i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
    gamma_ij = (gam[:, None] - gam[None, :]).exp()
    dA = torch.where((i < n) & (j < n), ((dw_sh @ k_sh.T) * e[None, :] + du_sh @ v_sh.T) * b[None, :], 0.0)
    kkg = torch.where(j < i, (k_sh @ k_sh.T) * gamma_ij, 0.0)
    a = torch.where((i < n) & (j <= i), (i == j).double() - x_sh @ kkg, 0.0)
    dM = torch.where(j < i, -(a.T @ (dA @ a.T)), 0.0)
    rowf, cole = (dM * kkg).sum(1), (dM * kkg * b[:, None]).sum(0)
    D = torch.where(j < i, dM * b[:, None] * gamma_ij, 0.0)
    rk, rv = a.T @ dw_sh, a.T @ du_sh
    dk = rk * (b * e)[:, None] + D @ k_sh + D.T @ k_sh
    dbeta = (rk * k_sh).sum(1) * e + (rv * v_sh).sum(1) + rowf
    dgamma = (rk * k_sh).sum(1) * e * b + b * rowf - cole
    for label, got, ref in zip(("dk", "dv", "dbeta", "dgamma"), (dk, rv * b[:, None], dbeta, dgamma), want):
        torch.testing.assert_close(got[:n], ref[0, :, 0], rtol=1e-12, atol=1e-12, msg=label)


@pytest.mark.parametrize("segment_chunks", [0, 1])
def test_launcher_reads_the_forwards_saved_states_as_recomputed(emulated_backward, segment_chunks, monkeypatch):
    """``states``: the forward's h (with its spare rows past the last chunk, as ``forward.saved_chunks`` sizes it),
    v_new, gamma and Ag replace the recompute; the gradients are those of the recomputing launcher, neither of whose
    recomputes (kkt_solve, the states) is called."""
    from flashqla_kernels.gated_delta_rule.hopper import forward, kkt_solve

    gen = torch.Generator().manual_seed(4)
    lens, pad, Hk, Hv, K, V = [1, 130, 64, 70], 3, 1, 2, 64, 64
    T = sum(lens) + pad
    rand = (lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64))
    q, k = (torch.nn.functional.normalize(rand(1, T, Hk, K), dim=-1) for _ in range(2))
    v, do = rand(1, T, Hv, V), rand(1, T, Hv, V)
    g = torch.nn.functional.logsigmoid(rand(1, T, Hv)) / 4
    beta = torch.sigmoid(rand(1, T, Hv))
    h0, dht = rand(len(lens), Hv, K, V), rand(len(lens), Hv, K, V)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(initial_state=h0, cu_seqlens=cu, segment_chunks=segment_chunks)
    recomputed, solved = [], []
    real, real_kkt = backward.recompute_states, kkt_solve.kkt_solve
    monkeypatch.setattr(backward, "recompute_states", lambda *a: recomputed.append(real(*a)) or recomputed[-1])
    monkeypatch.setattr(kkt_solve, "kkt_solve", lambda *a: solved.append(real_kkt(*a)) or solved[-1])
    want = backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, **kw)
    (h, v_new), = recomputed
    (gamma, ag, _), = solved
    saved = torch.full((forward.saved_chunks(1, T, len(lens)), Hv, K, V), float("nan"), dtype=h.dtype)
    saved[:h.shape[0]] = h
    got = backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, states=(saved, v_new, gamma, ag), **kw)
    assert len(recomputed) == 1 and len(solved) == 1, "the saved states were recomputed"
    for label, x, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        torch.testing.assert_close(x, ref, rtol=0, atol=0, msg=label)
    for bad in ((h[:-1], v_new, gamma, ag), (saved, v_new), (saved, v_new, gamma, ag[:, :1]), (saved, v_new, None, ag)):
        with pytest.raises(ValueError, match="states must be the forward's"):
            backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, states=bad, **kw)


def _walk(q, k, v, do, v_new, h, ag, gamma, beta, dht, walks, *, scale, store_dh0):
    """``bwd_walk.bwd_walk``'s contract: ``reference_bwd.chunk_bwd_step_ref`` walked back over every walk's chunks
    per value head from ``dht`` (or zeros), on the saved states h; dq and dk per value head."""
    T, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    dq, dk = (torch.full((T, Hv, K), float("nan"), dtype=k.dtype) for _ in range(2))
    dv = torch.full_like(v, float("nan"))
    dbeta, dg = (torch.full((T, Hv), float("nan"), dtype=k.dtype) for _ in range(2))
    dh0 = torch.full((walks.shape[0], Hv, K, V), float("nan"), dtype=k.dtype) if store_dh0 else None
    for w, (s, e, c0) in enumerate(walks.tolist()):
        chunks = _chunks(s, e)
        for hv in range(Hv):
            hk = hv * Hk // Hv
            dS = dht[w, hv].to(k.dtype) if dht is not None else torch.zeros(K, V, dtype=k.dtype)
            for i in reversed(range(len(chunks))):
                cs, ce = chunks[i]
                out = reference_bwd.chunk_bwd_step_ref(
                    q[cs:ce, hk], k[cs:ce, hk], v[cs:ce, hv], gamma[cs:ce, hv], beta[cs:ce, hv], h[c0 + i, hv], dS,
                    do[cs:ce, hv], scale)
                dq[cs:ce, hv], dk[cs:ce, hv], dv[cs:ce, hv], dg[cs:ce, hv], dbeta[cs:ce, hv], dS = out
            if store_dh0:
                dh0[w, hv] = dS
    return dq, dk, dv, dbeta, dg, dh0


@pytest.mark.parametrize("segment_chunks", [0, 1, 3])
@pytest.mark.parametrize("l2norm,K,V,Hk,Hv,with_dht", [(True, 64, 64, 1, 2, True), (False, 48, 40, 2, 4, True),
                                                       (True, 64, 64, 2, 2, False)])
def test_fused_walk_launcher_composes_into_the_reference_backward(emulated_backward, segment_chunks, l2norm, K, V, Hk,
                                                                  Hv, with_dht, monkeypatch):
    """``backward.WALK``: the launcher's wiring of the fused walk (the recomputed states, each segment's end gradient
    from the maps and the reverse scan, dh0 from each sequence's first segment, the GVA sum and l2norm backward of
    dq and dk, padded head dims and tail) with the walk replaced by its float64 step gives
    ``chunk_gated_delta_rule_bwd_ref``'s gradients, and the staged dqkwg and WY stages never run."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dqkwg, bwd_walk, bwd_wy

    monkeypatch.setattr(backward, "WALK", True)
    monkeypatch.setattr(bwd_walk, "bwd_walk", _walk)
    for module, name in ((bwd_dqkwg, "bwd_dqkwg"), (bwd_dqkwg, "bwd_dqkwg_group"), (bwd_wy, "bwd_wy"),
                         (bwd_wy, "bwd_wy_group")):
        monkeypatch.setattr(module, name, lambda *a, **kw: pytest.fail("a staged stage ran under WALK"))
    q, k, v, g, beta, do, h0, dht, cu, n = _launcher_case(5, l2norm, K, V, Hk, Hv)
    dht = dht if with_dht else None
    got = _launcher_matches_reference(q, k, v, g, beta, do, dht, h0, cu, l2norm, segment_chunks)
    for x in got[:5]:
        assert not x[:, n:].any(), "the padded tail's gradients must be exactly 0"
