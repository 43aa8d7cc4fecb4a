"""The Hopper forward (``hopper/forward.py``): the schedule is exact in float64 emulation, the kkt_solve inverse
writes every entry, and the launcher wires the stages (each replaced by its torch formulation) so the result
equals the float64 reference."""
from __future__ import annotations

import itertools

import pytest
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.gated_delta_rule.hopper import plan
from tests.flashqla_kernels.test_hopper_plan import _kernel_starts, _table_starts


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
    """The kernels' decomposition (gated A, segment maps with the exp(-20) shortcut, scan, chunk walk)
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


def _torch_kkt_solve(k, g, beta, chunks, Hv, q=None):
    """kkt_solve's contract in float64 torch: gamma [T, Hv] chunk-local cumsum, Ag = Gamma * A0 * beta_col per chunk
    [T, Hv, 64] (zero above the diagonal and past a ragged chunk's end); with q, the kernel's l2norm: the inverse norms
    rn [T, Hk, 2] from the diagonals of Q Q^T and K K^T, and K K^T scaled by them."""
    group = Hv // k.shape[1]
    g, beta = g.double(), beta.double()
    gamma, ag = torch.zeros_like(g), torch.zeros(g.shape[0], Hv, 64, dtype=g.dtype)
    rn = None
    if q is not None:
        rn = torch.stack([torch.rsqrt(torch.einsum("thk,thk->th", x.double(), x.double()) + 1e-6) for x in (q, k)], -1)
    for s, e in chunks.tolist():
        kh = k[s:e].repeat_interleave(group, dim=1).double()
        gamma[s:e] = g[s:e].cumsum(0)
        eye = torch.eye(e - s, dtype=torch.float64).expand(Hv, -1, -1)
        kk = torch.einsum("ihk,jhk->hij", kh, kh)
        if rn is not None:
            rk = rn[s:e, :, 1].repeat_interleave(group, dim=1).T  # [Hv, n]
            kk = kk * rk[:, :, None] * rk[:, None, :]
        kk = kk * beta[s:e].T[:, :, None]
        a0 = torch.linalg.solve_triangular(eye + kk.tril(-1), eye, upper=False, unitriangular=True).transpose(0, 1)
        gm = gamma[s:e]
        dec = torch.exp(gm[:, None, :] - gm[None, :, :]).permute(0, 2, 1)  # [row, Hv, col]
        mask = torch.ones(e - s, e - s, dtype=torch.bool).tril()[:, None, :]
        ag[s:e, :, :e - s] = torch.where(mask, a0 * dec * beta[s:e].T[None], 0.0)
    return gamma, ag, rn


def _torch_chunk_fwd(q, k, v, ag, gamma, beta, h_init, segs, o, ht, *, scale, bDV, rn=None, states=None):
    """chunk_fwd's contract in float64 torch: segments from h_init rows, o and ht written in place; with rn, q and k
    normalised by folding the inverse norms into the row scalings as the kernel does; with states = (seg_chunk0, h,
    v_new) also each chunk's entering state and v_new."""
    group = v.shape[1] // k.shape[1]
    for seg, (s0, s1, init, fin) in enumerate(segs.tolist()):
        for h in range(v.shape[1]):
            S = h_init[init, h].double() if init >= 0 else torch.zeros_like(h_init[0, h]).double()
            for i, cs in enumerate(range(s0, s1, 64)):
                ce = min(cs + 64, s1)
                gm, kc, qc = gamma[cs:ce, h], k[cs:ce, h // group].double(), q[cs:ce, h // group].double()
                rq, rk = ((rn[cs:ce, h // group, 0], rn[cs:ce, h // group, 1]) if rn is not None
                          else (torch.ones_like(gm), torch.ones_like(gm)))
                log2e = 1.4426950408889634
                lq, lk = gm * log2e + torch.log2(rq), gm * log2e - torch.log2(rk)
                pg = torch.exp2(lq[:, None] - lk[None, :]).tril()
                vd = ag[cs:ce, h, :ce - cs] @ (v[cs:ce, h] - (gm.exp() * rk)[:, None] * (kc @ S))
                if states is not None:
                    states[1][int(states[0][seg]) + i, h] = S
                    states[2][cs:ce, h] = vd
                o[cs:ce, h] = scale * ((gm.exp() * rq)[:, None] * (qc @ S) + (pg * (qc @ kc.T)) @ vd)
                S = gm[-1].exp() * S + kc.T @ ((torch.exp(gm[-1] - gm) * rk)[:, None] * vd)
            if ht is not None and fin >= 0:
                ht[fin, h] = S


def _torch_segment_states(k, v, ag, gamma, beta, maps, *, bDV, rn=None, maps_only=False):
    """segment_states' contract in float64 torch, its decay shortcut included: per map and head the start table
    (the rule of ``_kernel_starts``), H walked from that start (the map's start where it is -1), M from the identity
    where the start is -1 and zero elsewhere, by the torch chunk stage on the map's token range."""
    R, Hv, K, V = maps.shape[0], v.shape[1], k.shape[2], v.shape[2]
    hs, ms = torch.zeros(R, Hv, K, V, dtype=torch.float64), torch.zeros(R, Hv, K, K, dtype=torch.float64)
    start = _kernel_starts(gamma.float(), maps.tolist(), 256)
    for r, (s0, s1) in enumerate(maps.tolist()):
        for first in set(start[r].tolist()):
            heads = (start[r] == first).nonzero().flatten()
            seg = torch.tensor([[first if first >= 0 else s0, s1, 0, 0]])
            zero = torch.zeros(1, Hv, K, V, dtype=torch.float64)
            h_end = torch.zeros(1, Hv, K, V, dtype=torch.float64)
            _torch_chunk_fwd(k, k, v, ag, gamma, beta, zero, seg, torch.empty_like(v), h_end, scale=1.0, bDV=bDV,
                             rn=rn)
            hs[r, heads] = h_end[0, heads]
        needed = (start[r] < 0).nonzero().flatten()
        if needed.numel():
            seg = torch.tensor([[s0, s1, 0, 0]])
            eye = torch.eye(K, dtype=torch.float64).expand(1, Hv, K, K).contiguous()
            m_end = torch.zeros(1, Hv, K, K, dtype=torch.float64)
            _torch_chunk_fwd(k, k, torch.zeros(v.shape[0], Hv, K, dtype=torch.float64), ag, gamma, beta, eye, seg,
                             torch.empty(v.shape[0], Hv, K, dtype=torch.float64), m_end, scale=1.0, bDV=bDV, rn=rn)
            ms[r, needed] = m_end[0, needed]
    return (None if maps_only else hs), ms, start


def _torch_state_scan(h0, hs, ms, mstart, seqs, num_segs):
    """state_scan's contract in float64 torch: S_0 = h0 (or 0), S_{i+1} = M_i S_i + H_i over each sequence's maps,
    M_i skipped where the start table says it is zero."""
    h_init = torch.zeros((num_segs,) + hs.shape[1:], dtype=torch.float64)
    for n, (first, count, first_map) in enumerate(seqs.tolist()):
        S = h0[n].double() if h0 is not None else torch.zeros_like(h_init[0])
        for i in range(count):
            h_init[first + i] = S
            if i < count - 1:
                needed = (mstart[first_map + i] < 0).to(torch.float64)[:, None, None]
                S = needed * (ms[first_map + i].double() @ S) + hs[first_map + i].double()
    return h_init


def _torch_tokens_major(buffer, Hk, K, Hv, V):
    """layout.tokens_major's contract in torch: the [B, C, T] buffer's channel slices as token-major q, k, v."""
    B, C, Tn = buffer.shape
    rows = buffer.transpose(1, 2).reshape(B * Tn, C)
    return (rows[:, :Hk * K].reshape(B * Tn, Hk, K).contiguous(),
            rows[:, Hk * K:2 * Hk * K].reshape(B * Tn, Hk, K).contiguous(),
            rows[:, 2 * Hk * K:].reshape(B * Tn, Hv, V).contiguous())


def _torch_slice_tokens_major(buffer, c_first, H, D):
    """layout.slice_tokens_major's contract in torch: one channel slice of the [B, C, T] buffer, token-major."""
    B, C, Tn = buffer.shape
    return buffer[:, c_first:c_first + H * D].transpose(1, 2).reshape(B * Tn, H, D).contiguous()


@pytest.fixture
def torch_stages(monkeypatch):
    """The launcher with every kernel swapped for its float64 torch twin (CPU); returns the recorded stage calls."""
    pytest.importorskip("tilelang")
    from flashqla_kernels.gated_delta_rule.hopper import (chunk_fwd, forward, kkt_solve, layout, segment_states,
                                                          state_scan)

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
    monkeypatch.setattr(layout, "tokens_major", record("layout", _torch_tokens_major))
    monkeypatch.setattr(layout, "slice_tokens_major", record("layout_slice", _torch_slice_tokens_major))
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


def test_launcher_makes_transformers_channels_first_inputs_token_major_in_one_pass(torch_stages):
    """q, k, v as transformers' layer passes them (channel slices of its convolution's [B, C, T] buffer) go through
    one layout pass, not three strided copies, and give the reference result; the same values laid out token-major
    skip it."""
    from flashqla_kernels.gated_delta_rule.hopper import forward
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    gen = torch.Generator().manual_seed(8)
    B, Tn, Hk, Hv, K, V = 2, 70, 1, 2, 64, 64
    buffer = torch.randn(B, 2 * Hk * K + Hv * V, Tn, generator=gen, dtype=torch.float64)
    q, k, v = torch.split(buffer.transpose(1, 2), [Hk * K, Hk * K, Hv * V], dim=-1)
    q, k, v = q.reshape(B, Tn, Hk, K), k.reshape(B, Tn, Hk, K), v.reshape(B, Tn, Hv, V)
    g = -torch.rand(B, Tn, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, Tn, Hv, generator=gen, dtype=torch.float64)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, segment_chunks=0)
    o, ht = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
    assert [name for name, _ in torch_stages] == ["layout", "kkt_solve", "chunk_fwd"]
    ro, rht = chunk_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _rel(o, ro) < 1e-6 and _rel(ht, rht) < 1e-6
    torch_stages.clear()
    o2, ht2 = forward.chunk_gated_delta_rule_fwd(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, **kw)
    assert [name for name, _ in torch_stages] == ["kkt_solve", "chunk_fwd"]
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.parametrize("B", [1, 2])
def test_launcher_makes_a_lone_channels_first_v_token_major_in_one_pass(torch_stages, B):
    """transformers < 5.23 with Hv > Hk repeats q and k to the value heads: q, k arrive contiguous and v alone is a
    channel slice of the convolution's buffer. v goes through the one-slice pass, not torch's strided copy, and the
    result equals the same values laid out token-major."""
    from flashqla_kernels.gated_delta_rule.hopper import forward

    gen = torch.Generator().manual_seed(9)
    Tn, Hk, Hv, K, V = 70, 1, 2, 64, 64
    buffer = torch.randn(B, 2 * Hk * K + Hv * V, Tn, generator=gen, dtype=torch.float64)
    q, k, v = torch.split(buffer.transpose(1, 2), [Hk * K, Hk * K, Hv * V], dim=-1)
    q, k = (x.reshape(B, Tn, Hk, K).repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    v = v.reshape(B, Tn, Hv, V)
    g = -torch.rand(B, Tn, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, Tn, Hv, generator=gen, dtype=torch.float64)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, segment_chunks=0)
    o, ht = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
    assert [name for name, _ in torch_stages] == ["layout_slice", "kkt_solve", "chunk_fwd"]
    torch_stages.clear()
    o2, ht2 = forward.chunk_gated_delta_rule_fwd(q, k, v.contiguous(), g, beta, **kw)
    assert [name for name, _ in torch_stages] == ["kkt_solve", "chunk_fwd"]
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.parametrize("l2norm", [False, True])
def test_launcher_wiring_hands_ag_to_the_segment_maps_and_the_scan(torch_stages, l2norm):
    """Ragged varlen split into 2-chunk segments with a padded tail after the last sequence: Ag (and, with l2norm, the
    inverse norms) reaches both consumers (the maps and chunk_fwd), the scan starts every segment, the result equals
    the reference and the tail's outputs are 0; block_v forces the V slice of every stage."""
    from flashqla_kernels import toolkit
    from flashqla_kernels.gated_delta_rule.hopper import forward
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    gen = torch.Generator().manual_seed(7)
    lens, pad = [300, 47], 5
    cu = torch.tensor([0, *itertools.accumulate(lens)])
    Tn, Hk, Hv, K, V = cu[-1].item() + pad, 1, 2, 16, 8
    q, k = (torch.randn(1, Tn, Hk, K, generator=gen, dtype=torch.float64) for _ in range(2))
    if not l2norm:  # the segment maps' decay shortcut assumes unit-norm keys
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(1, Tn, Hv, V, generator=gen, dtype=torch.float64)
    g = -0.1 * torch.rand(1, Tn, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, Tn, Hv, generator=gen, dtype=torch.float64)
    h0 = torch.randn(len(lens), Hv, K, V, generator=gen, dtype=torch.float64)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, segment_chunks=2,
              use_qk_l2norm_in_kernel=l2norm)
    with toolkit.poisoned_outputs():
        o, ht = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
    n = cu[-1].item()
    ro, rht = chunk_gated_delta_rule_ref(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], initial_state=h0,
                                         output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm)
    assert [name for name, _ in torch_stages] == ["kkt_solve", "segment_states", "state_scan", "chunk_fwd"]
    assert _rel(o[:, :n], ro) < 1e-6 and _rel(ht, rht) < 1e-6
    assert torch.equal(o[:, n:], torch.zeros_like(o[:, n:]))
    torch_stages.clear()
    forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw, block_v=4)
    assert torch_stages[1] == ("segment_states", 4) and torch_stages[-1] == ("chunk_fwd", 4)


@pytest.mark.parametrize("segment_chunks", [0, 1])
def test_launcher_saves_every_chunks_entering_state(torch_stages, segment_chunks):
    """``save_states``: h[c] is the state entering chunk c (the reference's final state over the sequence's tokens
    before it, from h0), for ragged varlen with and without segments (the scan's start states placed by
    ``seg_chunk0``), and the outputs are those of the plain forward."""
    from flashqla_kernels.gated_delta_rule.hopper import forward
    from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    gen = torch.Generator().manual_seed(11)
    lens, Hk, Hv, K, V = [1, 130, 64, 70], 1, 2, 16, 8
    T = sum(lens) + 3
    q, k = (torch.randn(1, T, Hk, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, Hv, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, Hv, generator=gen, dtype=torch.float64)
    h0 = torch.randn(len(lens), Hv, K, V, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
              segment_chunks=segment_chunks)
    with toolkit.poisoned_outputs():  # rows no chunk writes come back 0, not the NaN they were allocated with
        o, ht, h, v_new, gamma, ag = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, save_states=True, **kw)
    o_plain, ht_plain = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
    assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain)
    # saved at the kernel head dims (16 and 8 run zero-padded to 64): the padding stays zero
    Kp, Vp = forward.padded_head_dim(K), forward.padded_head_dim(V)
    assert h.shape == (forward.saved_chunks(1, T, len(lens)), Hv, Kp, Vp) and v_new.shape == (T, Hv, Vp)
    c = 0
    for n, (s, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        for cs in range(s, e, 64):
            if cs == s:
                want = h0[n]
            else:
                want = chunk_gated_delta_rule_ref(q[:, s:cs], k[:, s:cs], v[:, s:cs], g[:, s:cs], beta[:, s:cs],
                                                  initial_state=h0[n:n + 1], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)[1][0]
            assert _rel(h[c, :, :K, :V], want) < 1e-6, f"sequence {n}, chunk at {cs}"
            assert not h[c, :, K:].any() and not h[c, :, :, V:].any()
            c += 1
    # the spare rows (the shape-only bound on the chunk count) and the padded tail's v_new: zero, not left unwritten
    assert c < h.shape[0] and not h[c:].any()
    assert not v_new[sum(lens):].any() and not v_new.isnan().any()
    # kkt_solve's gamma (the chunk-local cumsum of g) and Ag, kept for the backward: the padded tail's rows zero too
    assert gamma.shape == (T, Hv) and ag.shape == (T, Hv, 64)
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        for cs in range(s, e, 64):
            torch.testing.assert_close(gamma[cs:min(cs + 64, e)], g[0, cs:min(cs + 64, e)].cumsum(0).to(gamma.dtype))
    assert not gamma[sum(lens):].any() and not ag[sum(lens):].any() and not ag.isnan().any()
