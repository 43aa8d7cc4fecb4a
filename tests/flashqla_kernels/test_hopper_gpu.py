"""The TileLang Hopper forward (``hopper/forward.py``'s launcher, and the public ``chunk_gated_delta_rule`` that
dispatches to it) against the float64 reference, on an sm_90 GPU (skipped elsewhere).

Every case: fresh random inputs, every kernel output poisoned with NaN before the kernels run (so an unwritten element
fails), relative L2 <= 0.5% for o and the final state, no NaN, bit-identical on a second run. The launcher also runs
every case with 128-wide V slices forced (``block_v=128``), the width the plan picks only for split sequences.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from flashqla_kernels import chunk_gated_delta_rule, explain_backend, toolkit
from flashqla_kernels.gated_delta_rule.hopper import forward
from flashqla_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_ref

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

RTOL_L2 = 5e-3


def _inputs(Hk, Hv, K, V, lens, dtype, *, dense_batch=None, h0=True, gates="mixed", normalized=True, pad=0,
            gate_dtype=torch.float32):
    """pad: tokens after the last sequence (cu_seqlens[-1] < T); gate_dtype: g's and beta's dtype."""
    dev = torch.device("cuda")
    B, T = (dense_batch, lens[0]) if dense_batch else (1, sum(lens) + pad)
    N = dense_batch or len(lens)
    q = torch.randn(B, T, Hk, K, device=dev)
    k = torch.randn(B, T, Hk, K, device=dev)
    if normalized:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    v = torch.randn(B, T, Hv, V, device=dev)
    # FlashQLA's test gates: per-head A from 0 (g == 0: no decay) to 16 (very strong decay)
    A = torch.linspace(0, 16, Hv, device=dev) if gates == "mixed" else torch.full((Hv,), 1 / 16, device=dev)
    g = -A * torch.nn.functional.softplus(0.5 * torch.randn(B, T, Hv, device=dev) + 1)
    beta = torch.sigmoid(torch.randn(B, T, Hv, device=dev))
    s0 = torch.randn(N, Hv, K, V, device=dev) if h0 else None
    cu = None
    if not dense_batch:
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    return q.to(dtype), k.to(dtype), v.to(dtype), g.to(gate_dtype), beta.to(gate_dtype), s0, cu


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


CASES = {
    # name: (Hk, Hv, K, V, lens, dtype, extra)
    "varlen_ragged_gva2_bf16": (2, 4, 128, 128, [1, 47, 300, 64, 1000, 130], torch.bfloat16, {}),
    "varlen_ragged_gva2_bf16_cp": (2, 4, 128, 128, [1, 47, 300, 64, 1000, 130], torch.bfloat16,
                                   {"segment_chunks": 2}),
    "long_gva4_fp16_cp3": (1, 4, 128, 128, [700, 5, 129], torch.float16, {"segment_chunks": 3}),
    "one_seq_4096_gva4_auto": (4, 16, 128, 128, [4096], torch.bfloat16, {}),
    "dim64_gva2_fp16": (2, 4, 64, 64, [100, 47, 190], torch.float16, {}),
    "dim64_cp_bf16": (2, 4, 64, 64, [400, 63], torch.bfloat16, {"segment_chunks": 2}),
    "dim256_gva1_bf16_no_h0": (2, 2, 256, 256, [100, 47, 190], torch.bfloat16, {"h0": False}),
    "dim256_cp_fp16": (1, 2, 256, 256, [333], torch.float16, {"segment_chunks": 2}),
    "dense_batch_l2norm": (2, 4, 128, 128, [200], torch.bfloat16, {"dense_batch": 2, "normalized": False,
                                                                  "l2norm": True}),
    "single_token": (1, 1, 128, 128, [1], torch.bfloat16, {}),
    # use_qk_l2norm_in_kernel on the kernels (transformers' call): ragged varlen, split, a padded tail, bf16 gates
    "varlen_cp_l2norm_padded_tail": (2, 4, 128, 128, [1, 47, 300, 1000], torch.bfloat16,
                                     {"segment_chunks": 2, "normalized": False, "l2norm": True, "pad": 37}),
    "gva4_l2norm_bf16_gates_auto": (4, 16, 128, 128, [4096, 130], torch.bfloat16,
                                    {"normalized": False, "l2norm": True, "gate_dtype": torch.bfloat16}),
    "dim64_l2norm_fp16_gates_padded": (2, 4, 64, 64, [100, 47], torch.float16,
                                       {"normalized": False, "l2norm": True, "gate_dtype": torch.float16, "pad": 20}),
    "mild_gates_65": (2, 2, 128, 128, [65, 64, 63], torch.bfloat16, {"gates": "mild"}),
    # other head dims run zero-padded to the next kernel dim (96 -> 128; 48, 40 -> 64)
    "dim96_padded_gva2_bf16": (2, 4, 96, 96, [1, 47, 300], torch.bfloat16, {}),
    "dim48x40_padded_l2norm_fp16": (2, 4, 48, 40, [100, 47], torch.float16, {"normalized": False, "l2norm": True}),
}


def _check(name, run, q, k, v, g, beta, s0, cu, l2):
    with toolkit.poisoned_outputs():
        o, ht = run()
        o2, ht2 = run()
    d = (lambda x: None if x is None else x.double())
    ro, rht = chunk_gated_delta_rule_ref(d(q), d(k), d(v), d(g), d(beta), initial_state=d(s0),
                                         output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    assert o.dtype == q.dtype and o.shape == v.shape
    assert ht.dtype == torch.float32 and ht.shape == rht.shape
    assert not o.isnan().any() and not ht.isnan().any(), f"{name}: an output element was never written (or is NaN)"
    assert _rel(o, ro) <= RTOL_L2, f"{name}: o relative L2 {_rel(o, ro):.2e}"
    assert _rel(ht, rht) <= RTOL_L2, f"{name}: final state relative L2 {_rel(ht, rht):.2e}"
    assert torch.equal(o, o2) and torch.equal(ht, ht2), f"{name}: two runs on the same inputs differ (a race?)"
    if cu is not None and cu[-1] < q.shape[1]:
        assert not o[:, int(cu[-1]):].any(), f"{name}: the padded tail's outputs are not 0"


def _case(name):
    Hk, Hv, K, V, lens, dtype, extra = CASES[name]
    extra = dict(extra)
    seg = extra.pop("segment_chunks", None)
    l2 = extra.pop("l2norm", False)
    return _inputs(Hk, Hv, K, V, lens, dtype, **extra), seg, l2


@pytest.mark.parametrize("block_v", [None, 128], ids=["plan_slices", "slices_128"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_hopper_forward_matches_float64_reference(name, block_v):
    (q, k, v, g, beta, s0, cu), seg, l2 = _case(name)
    assert forward.unsupported_reason(q, k, v, g, beta, s0, cu) is None

    def run():
        return forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=s0,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                                  cu_seqlens=cu, segment_chunks=seg, block_v=block_v)

    _check(name, run, q, k, v, g, beta, s0, cu, l2)


@pytest.mark.parametrize("name", sorted(c for c in CASES if "segment_chunks" not in CASES[c][-1]))
def test_public_op_runs_the_kernels_and_matches_float64_reference(name):
    """The public op as users call it (the plan's own split), forced onto the kernels so a fallback fails."""
    (q, k, v, g, beta, s0, cu), _, l2 = _case(name)
    assert explain_backend(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu).startswith(
        "chunk_gated_delta_rule: backend tilelang")

    def run():
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, backend="tilelang")

    with torch.no_grad():
        _check(name, run, q, k, v, g, beta, s0, cu, l2)


def test_hopper_context_parallel_equals_unsplit():
    """Splitting a long sequence into segments is exact: same result as the unsplit walk up to rounding."""
    q, k, v, g, beta, s0, cu = _inputs(2, 4, 128, 128, [2048, 100], torch.bfloat16, gates="mild")
    kw = dict(scale=None, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu)
    o0, h0 = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, segment_chunks=0, **kw)
    for L in (1, 4, 8):
        o1, h1 = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, segment_chunks=L, **kw)
        assert _rel(o1, o0.double()) < 5e-3 and _rel(h1, h0.double()) < 5e-3


def test_hopper_no_final_state_returns_none():
    q, k, v, g, beta, s0, cu = _inputs(1, 2, 128, 128, [70], torch.bfloat16)
    o, ht = forward.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=0.5, initial_state=s0,
                                              output_final_state=False, use_qk_l2norm_in_kernel=False,
                                              cu_seqlens=cu)
    ro, _ = chunk_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(), beta.double(), scale=0.5,
                                       initial_state=s0.double(), cu_seqlens=cu)
    assert ht is None and _rel(o, ro) <= RTOL_L2


def _without_host_sync(fn):
    """fn() with every host synchronisation an error (torch's sync debug mode), after the queue has drained."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_public_op_makes_no_host_sync_once_cu_seqlens_is_known():
    """The call a model makes per layer: after the first call with a cu_seqlens tensor (its offsets are read once and
    cached on the tensor), the public op validates, plans and launches without synchronising with the host."""
    q, k, v, g, beta, s0, cu = _inputs(2, 4, 128, 128, [300, 1000, 47], torch.bfloat16, normalized=False)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    with torch.no_grad():
        o_first, _ = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        o, ht = _without_host_sync(lambda: chunk_gated_delta_rule(q, k, v, g, beta, **kw))
    assert torch.equal(o, o_first)
    cu.add_(0)  # an in-place edit bumps the version: the offsets are read again, not served stale
    with torch.no_grad():
        o_again, _ = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert torch.equal(o_again, o_first)


@pytest.mark.parametrize("B,T,Hk,Hv,D,dtype", [(2, 130, 2, 4, 128, torch.bfloat16),
                                               (1, 4096, 16, 16, 128, torch.bfloat16),
                                               (3, 65, 1, 2, 64, torch.float16)])
def test_channels_first_inputs_run_token_major_in_one_pass(B, T, Hk, Hv, D, dtype):
    """q, k, v as transformers' layer passes them (channel slices of its convolution's [B, C, T] buffer): the layout
    kernel gives exactly the token-major copies (tail tiles too, nothing written past a sequence), and the public op
    gives bit for bit what it gives on contiguous copies, without a host sync."""
    from flashqla_kernels.gated_delta_rule.hopper import layout

    buffer = torch.randn(B, (2 * Hk + Hv) * D, T, device="cuda").to(dtype)
    q, k, v = torch.split(buffer.transpose(1, 2), [Hk * D, Hk * D, Hv * D], dim=-1)
    q, k, v = q.reshape(B, T, Hk, D), k.reshape(B, T, Hk, D), v.reshape(B, T, Hv, D)
    assert layout.channels_first_buffer(q, k, v) is not None
    with toolkit.poisoned_outputs():
        q3, k3, v3 = layout.tokens_major(buffer, Hk, D, Hv, D)
    for got, want in ((q3, q), (k3, k), (v3, v)):
        assert torch.equal(got, want.reshape(B * T, *want.shape[2:]))
    g = -torch.nn.functional.softplus(torch.randn(B, T, Hv, device="cuda"))
    beta = torch.sigmoid(torch.randn(B, T, Hv, device="cuda")).to(dtype)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        want_o, want_h = chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, **kw)
        chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        o, ht = _without_host_sync(lambda: chunk_gated_delta_rule(q, k, v, g, beta, **kw))
    assert torch.equal(o, want_o) and torch.equal(ht, want_h)


@pytest.mark.parametrize("B,T,Hk,Hv,D,dtype", [(2, 130, 2, 4, 128, torch.bfloat16),
                                               (1, 4096, 16, 32, 128, torch.bfloat16),
                                               (3, 65, 1, 2, 64, torch.float16)])
def test_a_lone_channels_first_v_runs_token_major_in_one_pass(B, T, Hk, Hv, D, dtype):
    """transformers < 5.23 with Hv > Hk: q and k repeated to the value heads (contiguous), v alone a channel slice
    of the convolution's buffer. The one-slice kernel gives exactly v's token-major copy (tail tiles too), and the
    public op gives bit for bit what it gives on a contiguous v, without a host sync."""
    from flashqla_kernels.gated_delta_rule.hopper import layout

    buffer = torch.randn(B, (2 * Hk + Hv) * D, T, device="cuda").to(dtype)
    q, k, v = torch.split(buffer.transpose(1, 2), [Hk * D, Hk * D, Hv * D], dim=-1)
    q, k = (x.reshape(B, T, Hk, D).repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    v = v.reshape(B, T, Hv, D)
    found = layout.channels_first_slice(v)
    assert found is not None and layout.channels_first_buffer(q, k, v) is None
    with toolkit.poisoned_outputs():
        v3 = layout.slice_tokens_major(*found, Hv, D)
    assert torch.equal(v3, v.reshape(B * T, Hv, D))
    g = -torch.nn.functional.softplus(torch.randn(B, T, Hv, device="cuda"))
    beta = torch.sigmoid(torch.randn(B, T, Hv, device="cuda")).to(dtype)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        want_o, want_h = chunk_gated_delta_rule(q, k, v.contiguous(), g, beta, **kw)
        chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        o, ht = _without_host_sync(lambda: chunk_gated_delta_rule(q, k, v, g, beta, **kw))
    assert torch.equal(o, want_o) and torch.equal(ht, want_h)
