"""fused_encode: the torch backend equals encode_sparse bit for bit; the kernel's candidate/merge algorithm (run on CPU
through its torch twin) equals encode_sparse up to ties, flagged rows included; the sync-free path (fixed-capacity
buffers, an overflow flag) gives the multi-pass path's codes without reading tensor data on the host, and fused_encode
falls back when it overflows; the TileLang kernel compiles for sm_90a without a GPU; on Hopper the kernel itself
matches encode_sparse on random and structured inputs."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from saes import SparseCodes, TopKSAE
from saes import fused as fe
from saes import hopper_topk as hk
from tests.factories import random_sae_state

BN = hk.BLOCK_N


def _sae(d_model=64, d_sae=1024, k=16, seed=0, dtype=torch.float32, device="cpu") -> TopKSAE:
    state = {key: t.to(device=device, dtype=dtype) for key, t in random_sae_state(d_model, d_sae, seed).items()}
    return TopKSAE.from_release_state(state, k=k)


def _true_acts(x, sae) -> torch.Tensor:
    """ReLU(pre-activations) in float64 from the exact (possibly bf16) operands: [N, d_sae]."""
    pre = x.double().reshape(-1, sae.d_model) @ sae.W_enc.double().T + sae.b_enc.double()
    return pre.clamp_min(0)


def assert_topk_up_to_ties(codes: SparseCodes, acts: torch.Tensor, k: int, rel: float = 2**-7, abs_: float = 1e-4):
    """Every index is distinct and carries its own activation; the values are the k largest; swaps are ties only."""
    values, indices = codes.values.reshape(-1, k).double().to(acts.device), codes.indices.reshape(-1, k).to(acts.device)
    assert not torch.isnan(values).any()
    assert ((indices >= 0) & (indices < acts.shape[1])).all()
    assert (indices.sort(dim=1).values.diff(dim=1) > 0).all(), "an index repeats within a row"
    assert (values.diff(dim=1) <= 0).all(), "values are not sorted descending"
    own = acts.gather(1, indices)
    tol = rel * own.abs() + abs_
    assert ((values - own).abs() <= tol).all(), "a value is not the activation of its index"
    best = acts.topk(k, dim=1).values
    assert ((values - best).abs() <= rel * best + abs_).all(), "the values are not the k largest"


def _kernel_twin(x, sae, c=None):
    """The TileLang path with the kernel replaced by its torch twin (same keys, same merge, same recompute)."""
    c = c or hk.candidates_per_tile(sae.k, sae.d_sae)
    flagged = hk.merge_candidates(hk.topk_candidates_reference(x, sae.W_enc, sae.b_enc, c), sae.k)[2]
    return fe._encode_tilelang(x, sae, c=c, candidates=hk.topk_candidates_reference), flagged


# ---------------------------------------------------------------------------------------------------- torch backend
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 64), (64,)])
def test_torch_backend_equals_encode_sparse_exactly(shape):
    sae = _sae()
    x = torch.randn(shape)
    ref = sae.encode_sparse(x)
    got = fe.fused_encode(x, sae)
    assert got.values.shape == ref.values.shape == (*shape[:-1], sae.k)
    assert torch.equal(got.values, ref.values) and torch.equal(got.indices, ref.indices)


def test_torch_backend_row_blocks_bound_memory_and_agree_to_fp32_rounding():
    sae = _sae()
    x = torch.randn(50, 64)
    # 1024 features * 4 bytes * 8 rows: blocks of 8 rows, the last one short.
    got = fe._encode_torch(x, sae, max_block_bytes=4 * 1024 * 8)
    # BLAS may round a row differently inside a smaller matmul: equal to the last fp32 bits, indices up to such ties.
    assert_topk_up_to_ties(got, _true_acts(x, sae), sae.k, rel=1e-5)
    ref = sae.encode_sparse(x)
    assert (got.values - ref.values).abs().max() <= 1e-5 * ref.values.abs().max()


def test_package_exports_the_function():
    import saes

    assert saes.fused_encode is fe.fused_encode and "fused_encode" in saes.__all__
    assert saes.fused_encode_async is fe.fused_encode_async and "fused_encode_async" in saes.__all__


def test_cpu_input_falls_back_to_torch_and_tilelang_request_explains_why():
    sae, x = _sae(), torch.randn(4, 64)
    assert fe.explain_backend(x, sae).splitlines() == [
        "fused_encode: backend torch",
        "  tilelang: not used: tensors are on cpu; the TileLang kernels run on CUDA tensors of an sm_90 GPU only",
        "  torch: runs every input the op accepts"]
    assert fe.explain_backend(x, sae, "torch") == "fused_encode: backend torch\n  torch: requested with backend='torch'"
    assert fe.explain_backend(x, sae, "tilelang").startswith("fused_encode: error: backend='tilelang' cannot run")
    with pytest.raises(ValueError, match=r"backend='tilelang' cannot run fused_encode on these inputs: tensors are "
                                         r"on cpu; the TileLang kernels run on CUDA"):
        fe.fused_encode(x, sae, backend="tilelang")
    with pytest.raises(ValueError, match="backend must be None"):
        fe.fused_encode(x, sae, backend="triton")
    with pytest.raises(ValueError, match=r"d_model=64\]"):
        fe.fused_encode(torch.randn(4, 32), sae)


# ---------------------------------------------------------------------------------------------------- the algorithm
@pytest.mark.parametrize("k", [1, 16, 40])
def test_candidate_merge_equals_encode_sparse_up_to_ties(k):
    sae = _sae(k=k)
    x = torch.randn(300, 64)
    codes, _ = _kernel_twin(x, sae)
    assert_topk_up_to_ties(codes, _true_acts(x, sae), k, rel=2**-14)


def test_keys_order_like_values_and_decode_to_column_and_truncated_value():
    sae = _sae(d_sae=BN, k=4)
    x = torch.randn(3, 64)
    cand = hk.topk_candidates_reference(x, sae.W_enc, sae.b_enc, c=BN)
    values, indices, flagged = hk.merge_candidates(cand, k=BN)
    pre = (x @ sae.W_enc.T + sae.b_enc)
    positive = values > 0
    own = pre.gather(1, indices)
    assert torch.equal(positive, own > 0)
    assert ((values - own)[positive].abs() <= own[positive] * 2**-15).all()
    assert (values[~positive] == 0).all()
    assert torch.equal(indices.sort(dim=1).values, torch.arange(BN).expand(3, BN))
    assert not flagged.any()


def test_rows_whose_topk_crowds_one_tile_are_flagged_rerun_wider_or_recomputed():
    sae = _sae(d_sae=16 * BN, k=8)
    with torch.no_grad():
        # 12 strong features in tile 1 for tokens whose first coordinate is positive: more than c of the top-k there.
        sae.b_enc[BN + 10 : BN + 22] = 0.0
        sae.W_enc[BN + 10 : BN + 22] = 0.0
        sae.W_enc[BN + 10 : BN + 22, 0] = 50.0
    x = torch.randn(200, 64)
    crowded = x[:, 0] > 0.2
    c = 4
    cand = hk.topk_candidates_reference(x, sae.W_enc, sae.b_enc, c)
    values, _, flagged = hk.merge_candidates(cand, sae.k)
    assert flagged[crowded].all()
    assert flagged[x[:, 0] < 0].float().mean() < 0.2
    # Unrecomputed, the crowded rows would be wrong: only c of their 8 strongest features survive the tile.
    best = _true_acts(x, sae).topk(sae.k, dim=1).values
    assert ((values[crowded] - best[crowded]).abs().amax(dim=1) > 1).all()
    # The wider re-run (4c = 16 per tile) certifies them all: encode_sparse is never needed.
    calls = []
    sae.encode_sparse = lambda rows: calls.append(rows) or TopKSAE.encode_sparse(sae, rows)
    codes, _ = _kernel_twin(x, sae, c=c)
    assert calls == []
    assert_topk_up_to_ties(codes, _true_acts(x, sae), sae.k, rel=2**-14)
    # A candidate source that cannot widen (always 2 per tile): the uncertain rows go to encode_sparse.
    codes = fe._encode_tilelang(x, sae, c=2, candidates=lambda xs, w, b, c: hk.topk_candidates_reference(xs, w, b, 2))
    assert len(calls) == 1 and len(calls[0]) >= crowded.sum()
    assert_topk_up_to_ties(codes, _true_acts(x, sae), sae.k, rel=2**-14)


def test_half_precision_inputs_keep_their_dtype_through_the_rerun_and_the_fallback():
    """bf16 activations (the GPU case): the wider re-run and the encode_sparse fallback write fp32 results into the
    bf16 output rows (index_put does not cast: this crashed the first H200 collection run)."""
    sae = _sae(d_sae=16 * BN, k=8)
    with torch.no_grad():
        sae.b_enc[BN + 10 : BN + 22] = 0.0
        sae.W_enc[BN + 10 : BN + 22] = 0.0
        sae.W_enc[BN + 10 : BN + 22, 0] = 50.0
    sae = sae.to(torch.bfloat16)
    x = torch.randn(200, 64).bfloat16()
    for c, source in ((4, hk.topk_candidates_reference),
                      (2, lambda xs, w, b, c: hk.topk_candidates_reference(xs, w, b, 2))):
        codes = fe._encode_tilelang(x, sae, c=c, candidates=source)
        assert codes.values.dtype == torch.bfloat16 and codes.indices.dtype == torch.long
        assert_topk_up_to_ties(codes, _true_acts(x, sae), sae.k)  # bf16 rounding of the values: rel 2^-7


def test_chunks_and_the_wider_rerun_give_the_codes_of_one_pass():
    sae = _sae(d_sae=16 * BN, k=8)
    with torch.no_grad():
        sae.b_enc[BN : BN + 12] = 0.0
        sae.W_enc[BN : BN + 12] = 0.0
        sae.W_enc[BN : BN + 12, 1] = 30.0
    x = torch.randn(150, 64)
    one = fe._encode_tilelang(x, sae, c=4, candidates=hk.topk_candidates_reference)
    chunked = fe._encode_tilelang(x, sae, chunk_tokens=37, c=4, candidates=hk.topk_candidates_reference)
    assert torch.equal(one.values, chunked.values) and torch.equal(one.indices, chunked.indices)
    assert_topk_up_to_ties(chunked, _true_acts(x, sae), sae.k, rel=2**-14)


# ---------------------------------------------------------------------------------------------------- sync-free path
def _crowded(dtype=torch.float32, n=200) -> tuple[TopKSAE, torch.Tensor]:
    """An SAE whose tile 1 holds 12 strong features for tokens with x[:, 0] > 0 (more than c = 4 of their top-8 in one
    tile), and ``n`` tokens, about 40 % of which are flagged by the merge."""
    sae = _sae(d_sae=16 * BN, k=8)
    with torch.no_grad():
        sae.b_enc[BN + 10 : BN + 22] = 0.0
        sae.W_enc[BN + 10 : BN + 22] = 0.0
        sae.W_enc[BN + 10 : BN + 22, 0] = 50.0
    return sae.to(dtype), torch.randn(n, 64).to(dtype)


def _narrow(xs, w, b, c):
    """A candidate source that cannot widen (2 per tile whatever c is asked): flagged rows stay flagged after the
    wider re-run and go to encode_sparse."""
    return hk.topk_candidates_reference(xs, w, b, 2)


def _one_row_at_a_time(fn):
    """``fn`` over the rows of its first argument one by one, results concatenated: a row's result then no longer
    depends on the batch it comes in (true of the kernel, not of a CPU matmul, which may round a row differently in a
    batch of another size)."""
    def rowwise(xs, *args):
        parts = [fn(xs[i : i + 1], *args) for i in range(xs.shape[0])] or [fn(xs, *args)]
        if isinstance(parts[0], SparseCodes):
            return SparseCodes(torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts]))
        return torch.cat(parts)

    return rowwise


def _assert_same_codes(got: SparseCodes, want: SparseCodes):
    assert got.values.dtype == want.values.dtype and got.indices.dtype == torch.long
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("narrow", [False, True], ids=["rerun-wider", "encode-sparse"])
def test_async_path_gives_the_codes_of_the_multipass_path(dtype, narrow):
    sae, x = _crowded(dtype)
    c, source = (2, _narrow) if narrow else (4, hk.topk_candidates_reference)
    n_flagged = int(hk.merge_candidates(source(x, sae.W_enc, sae.b_enc, c), sae.k)[2].sum())
    assert n_flagged >= 60
    want = fe._encode_tilelang(x, sae, c=c, candidates=source)
    # Capacities of exactly the rows to redo (the narrow source certifies none of them, 4c = 16 all of them): the
    # batches of the multi-pass path, so the same bits.
    got, overflow = fe._encode_tilelang_async(x, sae, c=c, candidates=source, capacity=n_flagged,
                                              capacity2=n_flagged if narrow else 0)
    assert overflow.dtype == torch.bool and overflow.shape == () and not overflow
    _assert_same_codes(got, want)
    # Room to spare, padded with unflagged rows, in chunks of 37 tokens: with sources whose rows do not depend on the
    # batch (like the kernel's), still the same bits.
    source = _one_row_at_a_time(source)
    sae.encode_sparse = _one_row_at_a_time(sae.encode_sparse)
    want = fe._encode_tilelang(x, sae, chunk_tokens=37, c=c, candidates=source)
    got, overflow = fe._encode_tilelang_async(x, sae, chunk_tokens=37, c=c, candidates=source, capacity=len(x),
                                              capacity2=len(x))
    assert not overflow
    _assert_same_codes(got, want)
    assert_topk_up_to_ties(got, _true_acts(x, sae), sae.k, rel=2**-14 if dtype == torch.float32 else 2**-7)


def test_overflow_says_when_the_buffers_were_too_small():
    sae, x = _crowded()
    twin = hk.topk_candidates_reference
    rows = hk.merge_candidates(twin(x, sae.W_enc, sae.b_enc, 4), sae.k)[2].nonzero().squeeze(1)
    want = fe._encode_tilelang(x, sae, c=4, candidates=twin)

    def run(**kw):
        return fe._encode_tilelang_async(x, sae, c=4, candidates=twin, **kw)

    # Defaults: rerun_capacity(200) = 128 rows re-run wider (more than are flagged), 64 for encode_sparse (none needed).
    assert fe.rerun_capacity(len(x)) == 128 > len(rows)
    codes, overflow = run()
    assert not overflow
    _assert_same_codes(codes, want)
    assert not run(capacity=len(rows))[1] and run(capacity=len(rows) - 1)[1]
    # Two slots for ~80 flagged rows: those two are certified, the others keep the first pass's uncertain codes.
    codes, overflow = run(capacity=2)
    assert overflow
    assert torch.equal(codes.values[rows[:2]], want.values[rows[:2]])
    assert (codes.values[rows[2:]] != want.values[rows[2:]]).any(dim=1).all()
    # Rows the wider re-run cannot certify overflow the encode_sparse buffer (the narrow source flags 2/tile rows, most
    # of them, and certifies none).
    still = int(hk.merge_candidates(_narrow(x, sae.W_enc, sae.b_enc, 2), sae.k)[2].sum())
    assert len(x) > still > fe.FALLBACK_ROWS
    narrow = {"c": 2, "candidates": _narrow, "capacity": len(x)}
    assert not fe._encode_tilelang_async(x, sae, **narrow, capacity2=still)[1]
    assert fe._encode_tilelang_async(x, sae, **narrow, capacity2=still - 1)[1]
    assert fe._encode_tilelang_async(x, sae, **narrow)[1]


@pytest.mark.parametrize("capacity,overflows", [(None, False), (2, True)])
def test_fused_encode_takes_the_multipass_path_and_async_the_fixed_capacity_one(monkeypatch, capacity, overflows):
    """fused_encode's TileLang route, with the kernel's twin: the multi-pass path (exact whatever the number of flagged
    rows), never the fixed-capacity one; fused_encode_async takes that one and reports its overflow."""
    sae, x = _crowded()
    twin = hk.topk_candidates_reference
    want = fe._encode_tilelang(x, sae, c=4, candidates=twin)
    real_async, real_multi = fe._encode_tilelang_async, fe._encode_tilelang
    calls = []
    monkeypatch.setattr(fe, "_verifiers", lambda x, sae: ())  # every verifier passes: the TileLang route
    monkeypatch.setattr(fe, "_encode_tilelang_async", lambda x, sae: calls.append("async")
                        or real_async(x, sae, c=4, candidates=twin, capacity=capacity))
    monkeypatch.setattr(fe, "_encode_tilelang", lambda x, sae: calls.append("multi")
                        or real_multi(x, sae, c=4, candidates=twin))
    got = fe.fused_encode(x.reshape(4, 50, 64), sae, backend="tilelang")
    assert calls == ["multi"]
    assert got.values.shape == got.indices.shape == (4, 50, sae.k)
    _assert_same_codes(SparseCodes(got.values.reshape(200, -1), got.indices.reshape(200, -1)), want)
    got, overflow = fe.fused_encode_async(x.reshape(4, 50, 64), sae)
    assert calls == ["multi", "async"]
    assert bool(overflow) is overflows and got.values.shape == (4, 50, sae.k)


def test_async_torch_backend_returns_encode_sparse_and_never_overflows():
    sae, x = _sae(), torch.randn(3, 5, 64)
    codes, overflow = fe.fused_encode_async(x, sae)
    ref = sae.encode_sparse(x)
    _assert_same_codes(codes, ref)
    assert overflow.dtype == torch.bool and overflow.shape == () and overflow.device == x.device and not overflow
    with pytest.raises(ValueError, match=r"backend='tilelang' cannot run fused_encode_async on these inputs: tensors"):
        fe.fused_encode_async(x, sae, backend="tilelang")
    with pytest.raises(ValueError, match="backend must be None"):
        fe.fused_encode_async(x, sae, backend="triton")


class _NoDataDependentOps(TorchDispatchMode):
    """Fails every aten op that reads tensor data on the host or sizes its output by the data (a sync on CUDA):
    ``item``/``bool``/``int`` (``_local_scalar_dense``), ``nonzero``, ``masked_select``, ``unique``, and indexing with
    a bool mask (``x[mask]``, which runs nonzero inside the index kernel)."""

    DATA_SIZED = {"_local_scalar_dense", "nonzero", "nonzero_numpy", "masked_select", "_unique2", "unique_dim",
                  "unique_consecutive"}
    INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.DATA_SIZED:
            raise AssertionError(f"host sync: aten.{name}")
        if name in self.INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
            raise AssertionError(f"host sync: aten.{name} with a bool mask")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _no_host_reads(monkeypatch):
    """Inside: reading tensor data on the host raises AssertionError, through the dispatcher (see
    ``_NoDataDependentOps``) or through the methods that copy a CPU tensor out without it (``tolist``, ``numpy``)."""
    def forbid(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host sync: {name}")

        return raiser

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "numpy", "nonzero", "__bool__"):
            patch.setattr(torch.Tensor, name, forbid(f"Tensor.{name}"))
        patch.setattr(torch, "nonzero", forbid("torch.nonzero"))
        with _NoDataDependentOps():
            yield


@pytest.mark.parametrize("narrow", [False, True], ids=["rerun-wider", "encode-sparse"])
def test_async_path_never_reads_tensor_data_on_the_host(monkeypatch, narrow):
    sae, x = _crowded(torch.bfloat16)
    c, source = (2, _narrow) if narrow else (4, hk.topk_candidates_reference)
    with _no_host_reads(monkeypatch):
        codes, overflow = fe._encode_tilelang_async(x, sae, chunk_tokens=64, c=c, candidates=source, capacity=len(x),
                                                    capacity2=len(x))
    assert not overflow
    _assert_same_codes(codes, fe._encode_tilelang(x, sae, chunk_tokens=64, c=c, candidates=source))
    # The public function too (validation, reshapes), on its TileLang route.
    real_async = fe._encode_tilelang_async
    monkeypatch.setattr(fe, "_verifiers", lambda x, sae: ())  # every verifier passes: the TileLang route
    monkeypatch.setattr(fe, "_encode_tilelang_async", lambda x, sae: real_async(x, sae, c=c, candidates=source))
    with _no_host_reads(monkeypatch):
        codes, overflow = fe.fused_encode_async(x.reshape(2, 100, 64), sae, backend="tilelang")
    assert codes.values.shape == (2, 100, sae.k) and bool(overflow) is narrow  # narrow: ~175 flagged rows > 128
    # The guard catches what it should: the multi-pass path syncs to find its rows.
    with pytest.raises(AssertionError, match="host sync"), _no_host_reads(monkeypatch):
        fe._encode_tilelang(x, sae, c=c, candidates=source)


class _CountHostReads(TorchDispatchMode):
    """Counts the aten ops that read tensor data on the host or size their output by it (each a sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in _NoDataDependentOps.INDEXING and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        if name in _NoDataDependentOps.DATA_SIZED or bool_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("crowded", [False, True], ids=["none-flagged", "flagged"])
def test_fused_encode_reads_the_device_once_when_no_row_is_flagged(monkeypatch, crowded):
    """One host read (``nonzero``: which rows to redo) when the merge certifies every row; one more (the rows still
    flagged after the wider re-run) when some were not."""
    sae, x = _crowded() if crowded else (_sae(d_sae=16 * BN, k=8), torch.randn(200, 64))
    c = 4 if crowded else hk.candidates_per_tile(sae.k, sae.d_sae)
    twin = hk.topk_candidates_reference
    flagged = bool(hk.merge_candidates(twin(x, sae.W_enc, sae.b_enc, c), sae.k)[2].any())
    assert flagged is crowded
    real_multi = fe._encode_tilelang
    monkeypatch.setattr(fe, "_verifiers", lambda x, sae: ())  # every verifier passes: the TileLang route
    monkeypatch.setattr(fe, "_encode_tilelang", lambda x, sae: real_multi(x, sae, c=c, candidates=twin))
    with _CountHostReads() as counter:
        codes = fe.fused_encode(x, sae, backend="tilelang")
    assert counter.reads == (["nonzero", "index"] if crowded else ["nonzero"])
    assert_topk_up_to_ties(codes, _true_acts(x, sae), sae.k, rel=2**-14)


def test_tokens_with_fewer_than_k_positives_pad_with_zeros_at_distinct_features():
    sae = _sae(d_sae=2 * BN, k=20)
    with torch.no_grad():
        sae.b_enc.fill_(-100.0)
        sae.b_enc[[3, 300, 301]] = 1.0
    x = torch.randn(5, 64) * 0.01
    codes, flagged = _kernel_twin(x, sae)
    assert not flagged.any()
    assert (codes.values[:, 3:] == 0).all() and (codes.values[:, :3] > 0).all()
    assert set(codes.indices[0, :3].tolist()) == {3, 300, 301}
    assert_topk_up_to_ties(codes, _true_acts(x, sae), sae.k)


def test_candidates_per_tile_grows_with_k_per_tile():
    assert hk.candidates_per_tile(100, 32768) == 8
    assert hk.candidates_per_tile(100, 65536) == 6
    assert hk.candidates_per_tile(50, 65536) == 5
    assert hk.candidates_per_tile(1, 32768) == 3
    assert hk.candidates_per_tile(200, 512) * 2 >= 200


# ---------------------------------------------------------------------------------------------------- the kernel
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_kernel_lowers_and_compiles_for_sm90a_without_a_gpu(dtype):
    pytest.importorskip("tilelang")
    kernel = hk.compile_topk_candidates(128, 1024, 5, dtype)
    src = kernel.get_kernel_source()
    assert "wgmma" in src and "tma_load" in src
    assert "AllReduce<tl::MaxOp, 4" in src  # row reductions stay within a quad of one warp (FullRow policy)
    assert "Cand[" in src and "keys" in src


@pytest.mark.slow
def test_unfused_epilogue_kernel_compiles_for_sm90a_without_a_gpu():
    pytest.importorskip("tilelang")
    src = hk.compile_topk_candidates_from_preacts(1024, 5).get_kernel_source()
    assert "AllReduce<tl::MaxOp" in src and "Cand[" in src


def _structured_inputs(n, d_model, d_sae, device):
    """Residual-stream-like data: a shared mean direction, heavy-tailed token norms, a few outlier dimensions; and
    SAE features with a spread of biases, some of them dense and adjacent (they crowd one tile)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    mean = torch.randn(d_model, generator=g)
    x = torch.randn(n, d_model, generator=g) + 2 * mean
    x = x * torch.empty(n, 1).exponential_(generator=g)
    x[:, :4] *= 20
    w = torch.randn(d_sae, d_model, generator=g) / d_model**0.5
    b = -0.5 + 0.3 * torch.randn(d_sae, generator=g)
    b[1000:1040] = 3.0
    return x.to(device), w.to(device), b.to(device)


@pytest.mark.hopper
@pytest.mark.parametrize("case", ["random", "structured"])
@pytest.mark.parametrize("n,d_model,d_sae,k", [(1000, 256, 2048, 16), (77, 256, 2048, 16), (4133, 2048, 32768, 100)])
def test_kernel_matches_encode_sparse_up_to_ties_on_hopper(case, n, d_model, d_sae, k):
    if case == "random":
        sae = _sae(d_model, d_sae, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(n, d_model, device="cuda").bfloat16()
    else:
        x, w, b = _structured_inputs(n, d_model, d_sae, "cuda")
        sae = TopKSAE(w, torch.zeros(d_model, d_sae, device="cuda"), b, torch.zeros(d_model, device="cuda"), k=k)
        sae = sae.to(torch.bfloat16)
        x = x.bfloat16()
    assert fe.explain_backend(x, sae).startswith("fused_encode: backend tilelang")
    got = fe.fused_encode(x, sae, backend="tilelang")
    assert got.values.dtype == torch.bfloat16 and got.indices.dtype == torch.long
    assert_topk_up_to_ties(got, _true_acts(x, sae), k, rel=2**-7, abs_=1e-3)
    # encode_sparse sums in another order: with large-norm tokens its fp32 sums may differ by a bf16 ulp or two.
    ref = sae.encode_sparse(x).values.float()
    assert ((got.values.float() - ref).abs() <= 2**-6 * ref.abs() + 1e-3).all()


@pytest.mark.hopper
def test_kernel_writes_every_candidate_and_chunks_agree():
    sae = _sae(256, 2048, 16, seed=3, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(333, 256, device="cuda").bfloat16()
    c = hk.candidates_per_tile(sae.k, sae.d_sae)
    kernel = hk.compile_topk_candidates(256, 2048, c, "bfloat16")
    cand = torch.full((333, 2048 // BN, c), -1, device="cuda", dtype=torch.int32)
    kernel(x, sae.W_enc.detach(), sae.b_enc.detach().float(), cand)
    assert (cand >= 0).all(), "a candidate slot was not written"
    twin = hk.topk_candidates_reference(x, sae.W_enc, sae.b_enc, c)
    # Same keys up to fp32 summation order: the same columns almost everywhere, the same values to 1e-3.
    assert (cand == twin).float().mean() > 0.95
    decoded = (cand & -256).view(torch.float32)
    assert (decoded - (twin & -256).view(torch.float32)).abs().max() < 1e-2
    split = fe._encode_split(x, sae)
    assert_topk_up_to_ties(split, _true_acts(x, sae), sae.k, rel=2**-7, abs_=1e-3)
    whole = fe._encode_tilelang(x, sae)
    pieces = fe._encode_tilelang(x, sae, chunk_tokens=100)
    # Rows are computed alike in any chunk (a recomputed row may differ in its last fp32 bits).
    assert (whole.indices == pieces.indices).float().mean() > 0.99
    assert torch.allclose(whole.values.float(), pieces.values.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.hopper
def test_recompute_is_encode_sparse_up_to_fp32_summation_order_on_hopper():
    """The fallback of uncertain rows: one bf16 GEMM with fp32 output instead of encode_sparse's fp32 GEMM on a
    converted W_enc; the same exact products, summed in another order."""
    sae = _sae(256, 2048, 16, seed=5, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(77, 256, device="cuda").bfloat16()
    got, ref = fe._recompute(x, sae), sae.encode_sparse(x)
    assert got.values.dtype == torch.bfloat16 and got.indices.dtype == torch.long
    assert_topk_up_to_ties(got, _true_acts(x, sae), sae.k, rel=2**-7, abs_=1e-3)
    assert ((got.values.float() - ref.values.float()).abs() <= 2**-7 * ref.values.float().abs() + 1e-3).all()
    assert (got.indices == ref.indices).float().mean() > 0.99
